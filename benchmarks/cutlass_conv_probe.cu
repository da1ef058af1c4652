// CUTLASS 3.x sm90 TF32 implicit-GEMM convolution, built by benchmarks/cutlass_conv_probe.py (issue 22's route
// measurement: the template library against cuDNN and our own kernels). One variant per build (KF_VARIANT), so
// that each configuration's build time is measured on its own:
//   0: TMA epilogue, NHWC output, no fusion (the bare anchor)
//   1: TMA epilogue, NHWC output, per-channel bias + mish(mish(.)) as an epilogue visitor (the fused anchor)
//   2: register epilogue (no shared memory), NCHW output written straight from the accumulators, no fusion
//   3: as 0 with a 128 x 64 tile (the narrower output-channel tiling)
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convolution.h"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/default_epilogue.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"

using namespace cute;

// mish(mish(x)) with torch's softplus threshold (20): the level-2 "Conv2d_Mish_Mish" chain.
template <class T>
struct KfMishMish {
  CUTLASS_HOST_DEVICE static float mish(float x) {
    float sp = x > 20.f ? x : log1pf(expf(x));
    return x * tanhf(sp);
  }
  CUTLASS_HOST_DEVICE T operator()(T const& x) const { return T(mish(mish(float(x)))); }
};
template <class T, int N>
struct KfMishMish<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v) const {
    cutlass::Array<T, N> r;
    KfMishMish<T> op;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = op(v[i]);
    return r;
  }
};

#if KF_VARIANT == 3
using TileShape = Shape<_128, _64, Shape<_32>>;
#else
using TileShape = Shape<_128, _128, Shape<_32>>;
#endif
using ClusterShape = Shape<_1, _1, _1>;
using LayoutNHWC = cutlass::layout::TensorNHWC;
constexpr cutlass::conv::Operator kFprop = cutlass::conv::Operator::kFprop;

#if KF_VARIANT == 2
// NCHW output: the pixel mode ((Q, P, N)) and the channel mode both have run-time strides.
using StrideNCHW = Stride<Stride<int64_t, int64_t, int64_t>, int64_t, Int<0>>;
using ThreadOp = cutlass::epilogue::thread::LinearCombination<float, 1, float, float,
    cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling, cutlass::FloatRoundStyle::round_to_nearest, float>;
using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
    cutlass::epilogue::collective::DefaultEpilogue<void, StrideNCHW, StrideNCHW, ThreadOp, cutlass::gemm::EpilogueDefault>>;
#else
#if KF_VARIANT == 1
using Fusion = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<KfMishMish, float, float, float, void, float>;
#else
using Fusion = cutlass::epilogue::fusion::LinearCombination<float, float, void, float>;
#endif
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutNHWC, 4, float, LayoutNHWC, 4,
    cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
#endif

using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kFprop,
    float, LayoutNHWC, 4, float, LayoutNHWC, 4, float, TileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

using Problem = cutlass::conv::ConvProblemShape<kFprop, Mainloop::DispatchPolicy::NumSpatialDimensions>;
using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;

// x: (N, C, H, W) in channels-last memory; w: (K, C, R, S) in channels-last memory; out: (N, K, P, Q), NHWC
// memory for variants 0, 1, 3 and NCHW for 2; bias: (K,) (variant 1).
void run(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out, std::vector<int64_t> pad,
         std::vector<int64_t> stride, std::vector<int64_t> dil) {
  const int n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int k = w.size(0), r = w.size(2), s = w.size(3);
  const int p = out.size(2), q = out.size(3);
  Problem problem(cutlass::conv::Mode::kCrossCorrelation, {n, h, wd, c}, {k, r, s, c},
                  {int(pad[0]), int(pad[1])}, {int(pad[0]), int(pad[1])}, {int(stride[0]), int(stride[1])},
                  {int(dil[0]), int(dil[1])}, 1);
  typename Conv::Arguments args{problem, {x.data_ptr<float>(), w.data_ptr<float>()}, {}};
  auto& epi = args.epilogue;
  epi.ptr_D = out.data_ptr<float>();
#if KF_VARIANT == 2
  epi.thread = typename ThreadOp::Params(1.f, 0.f);
  get<0, 0>(epi.dD) = 1;
  get<0, 1>(epi.dD) = q;
  get<0, 2>(epi.dD) = int64_t(k) * p * q;
  get<1>(epi.dD) = int64_t(p) * q;
#else
  epi.thread.alpha = 1.f;
  epi.thread.beta = 0.f;
#if KF_VARIANT == 1
  epi.thread.bias_ptr = bias.data_ptr<float>();
#endif
  for_each(make_seq<rank<0>(typename Kernel::StrideD{})>{},
           [&](auto i) { get<0, i>(epi.dD) = problem.stride_C[Problem::RankT - 2 - i]; });
#endif
  Conv conv;
  TORCH_CHECK(conv.can_implement(args) == cutlass::Status::kSuccess, "CUTLASS cannot run this convolution");
  auto workspace = torch::empty({int64_t(Conv::get_workspace_size(args)) + 1},
                                x.options().dtype(torch::kUInt8));
  auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(conv.initialize(args, workspace.data_ptr(), stream) == cutlass::Status::kSuccess, "initialize");
  TORCH_CHECK(conv.run(stream) == cutlass::Status::kSuccess, "run");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
