"""Can a GEMM of our own on tensor cores beat cuBLAS's exact-fp32 SGEMM at fp32 accuracy (3xTF32)?

    PYTHONPATH=. python benchmarks/gemm_probe.py [OUT.md]

Issue 22 asks for GEMM anchors with the epilogue inside, at eager's precision: exact fp32 where eager's matmul is
fp32. cuBLAS's SGEMM runs on the fp32 pipes (~51 TFLOP/s measured on an H200 at 1024 x 8192 x 8192); TF32 tensor
cores through mma.sync are several times faster, and three TF32 products per multiply (each operand split into a
TF32 part and the TF32 rounding of the rest) keep fp32 accuracy. Whether the tripled tensor-core work still beats
the fp32 pipes is what this measures, per tile configuration, on level-2 and transformer GEMM shapes:
out = x @ w.T + bias (a Linear: both operands K-contiguous), against F.linear (strict fp32), torch.mm with TF32
(the tensor cores' speed through cuBLAS) and our 1xTF32 kernel (how close our main loop gets to cuBLAS's).
Errors are max abs against float64. L2 flushed, median of 20 CUDA-event timings.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import optimizer_variants

SHAPES = [  # (M, N, K): KernelBench level 2's Linear, BERT-base (8 x 512 tokens), Llama's MLP, a small one
    (1024, 8192, 8192), (4096, 3072, 768), (4096, 768, 3072), (4096, 768, 768), (2048, 2816, 1024),
    (128, 4096, 4096),
]
# (BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS)
# (config, chunked accumulation, 16-byte fragment loads). Stop 41's three runs, kept in benchmarks/results: the
# first found tensor-core accumulation across all of K 16x less accurate than SGEMM at K = 8192 (3.4e-4), the
# second fixed it with a fresh accumulator per K tile, the third added 16-byte fragment loads; the one kept
# (64 x 128 x 32, what kernelfuse.codegen.gemm_tc runs) against the fastest unchunked one
VARIANTS = [((64, 128, 32, 2, 2, 3, 2), True, True), ((256, 128, 16, 4, 2, 3, 1), False, False)]


class Linears(torch.nn.Module):
    """One Linear per shape: the planner's `-tcgemm` variant makes one kernelfuse GEMM of each (k0, k1, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(k, n) for _, n, k in SHAPES)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(lin(x) for lin, x in zip(self.linears, xs, strict=True))


def kernelfuse_gemms() -> tuple[object, list]:
    """The GEMM kernels as kernelfuse plans them, built (the planner's own shapes: a real Linear per SHAPES row)."""
    model = Linears().eval()
    graph = capture_module(model, [torch.randn(m, k) for m, _, k in SHAPES])
    (plan,) = [p for p in optimizer_variants(graph) if p.variant.endswith("-tcgemm")]
    return load_kernels(generate(plan), "kf_gemm_probe_planned"), [s.kernel for s in plan.fused]

CUDA = r"""
#include <cuda_runtime.h>
__device__ __forceinline__ unsigned int kf_tf32(float x) {
  unsigned int r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void kf_cp16(float* dst, const float* src, bool in) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(in ? 16 : 0));
}
__device__ __forceinline__ void kf_mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C[M][N] = A[M][K] B[N][K]^T + bias[N]; A and B row-major (K contiguous, K % 4 == 0, 16-byte aligned).
// CHUNK: each K tile's products go into a fresh tensor-core accumulator, added to the fp32 one in registers
// (round to nearest): the tensor cores' own fp32 accumulation truncates, an error that grows with K.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int MINB, bool SPLIT, bool CHUNK, bool VEC>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, MINB)
kf_gemm(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ bias,
        float* __restrict__ C, int M, int N, int K) {
  constexpr int THREADS = WARPS_M * WARPS_N * 32, LD = VEC ? (BK % 32 == 16 ? BK : BK + 16) : BK + 4, WM = BM / WARPS_M, WN = BN / WARPS_N;
  constexpr int MF = WM / 16, NF = WN / 8, KQ = BK / 4;
  extern __shared__ float smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
  const int KT = (K + BK - 1) / BK;
  auto issue = [&](int kt) {
    float* As = smem + (kt % STAGES) * (BM + BN) * LD;
    float* Bs = As + BM * LD;
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < (BM * KQ + THREADS - 1) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      if (BM * KQ % THREADS == 0 || e < BM * KQ) {
        const int r = e / KQ, c = (e % KQ) * 4;
        const bool in = m0 + r < M && k0 + c < K;
        kf_cp16(As + r * LD + c, in ? A + (long long)(m0 + r) * K + k0 + c : A, in);
      }
    }
#pragma unroll
    for (int i = 0; i < (BN * KQ + THREADS - 1) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      if (BN * KQ % THREADS == 0 || e < BN * KQ) {
        const int r = e / KQ, c = (e % KQ) * 4;
        const bool in = n0 + r < N && k0 + c < K;
        kf_cp16(Bs + r * LD + c, in ? B + (long long)(n0 + r) * K + k0 + c : B, in);
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  float acc[MF][NF][4];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) issue(s);
    else asm volatile("cp.async.commit_group;");
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
    __syncthreads();
    if (kt + STAGES - 1 < KT) issue(kt + STAGES - 1);
    else asm volatile("cp.async.commit_group;");
    const float* As = smem + (kt % STAGES) * (BM + BN) * LD;
    const float* Bs = As + BM * LD;
    float part[CHUNK ? MF : 1][CHUNK ? NF : 1][4];
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < MF; ++i)
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
    }
    auto& sum = [&]() -> auto& { if constexpr (CHUNK) return part; else return acc; }();
    if constexpr (VEC) {
      // K permuted inside each 16-column group, the same way for A and B (a sum's order of terms, nothing
      // else): thread t's k = t and t + 4 of the first k8 step are columns 4t, 4t + 1, of the second 4t + 2,
      // 4t + 3, so one 16-byte load serves two steps (LD % 32 == 16: a quarter warp's loads hit 32 banks)
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        float4 bv[NF], lo[MF], hi[MF];
#pragma unroll
        for (int j = 0; j < NF; ++j) bv[j] = *reinterpret_cast<const float4*>(Bs + (wn + j * 8 + g) * LD + kk + 4 * t);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          lo[i] = *reinterpret_cast<const float4*>(As + (wm + i * 16 + g) * LD + kk + 4 * t);
          hi[i] = *reinterpret_cast<const float4*>(As + (wm + i * 16 + g + 8) * LD + kk + 4 * t);
        }
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          unsigned int bh[NF][2], bl[SPLIT ? NF : 1][2];
#pragma unroll
          for (int j = 0; j < NF; ++j) {
            const float b0 = step ? bv[j].z : bv[j].x, b1 = step ? bv[j].w : bv[j].y;
            bh[j][0] = kf_tf32(b0);
            bh[j][1] = kf_tf32(b1);
            if constexpr (SPLIT) {
              bl[j][0] = kf_tf32(b0 - __uint_as_float(bh[j][0]));
              bl[j][1] = kf_tf32(b1 - __uint_as_float(bh[j][1]));
            }
          }
#pragma unroll
          for (int i = 0; i < MF; ++i) {
            const float av[4] = {step ? lo[i].z : lo[i].x, step ? hi[i].z : hi[i].x, step ? lo[i].w : lo[i].y,
                                 step ? hi[i].w : hi[i].y};
            unsigned int ah[4], al[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              ah[r] = kf_tf32(av[r]);
              if constexpr (SPLIT) al[r] = kf_tf32(av[r] - __uint_as_float(ah[r]));
            }
#pragma unroll
            for (int j = 0; j < NF; ++j) {
              if constexpr (SPLIT) {
                kf_mma(sum[i][j], al, bh[j][0], bh[j][1]);
                kf_mma(sum[i][j], ah, bl[j][0], bl[j][1]);
              }
              kf_mma(sum[i][j], ah, bh[j][0], bh[j][1]);
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < BK; kk += 8) {
        unsigned int bh[NF][2], bl[SPLIT ? NF : 1][2];
  #pragma unroll
        for (int j = 0; j < NF; ++j)
  #pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float v = Bs[(wn + j * 8 + g) * LD + kk + t + r * 4];
            bh[j][r] = kf_tf32(v);
            if constexpr (SPLIT) bl[j][r] = kf_tf32(v - __uint_as_float(bh[j][r]));
          }
  #pragma unroll
        for (int i = 0; i < MF; ++i) {
          unsigned int ah[4], al[4];
  #pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float v = As[(wm + i * 16 + g + (r & 1) * 8) * LD + kk + t + (r >> 1) * 4];
            ah[r] = kf_tf32(v);
            if constexpr (SPLIT) al[r] = kf_tf32(v - __uint_as_float(ah[r]));
          }
  #pragma unroll
          for (int j = 0; j < NF; ++j) {
            if constexpr (SPLIT) {
              kf_mma(sum[i][j], al, bh[j][0], bh[j][1]);
              kf_mma(sum[i][j], ah, bl[j][0], bl[j][1]);
            }
            kf_mma(sum[i][j], ah, bh[j][0], bh[j][1]);
          }
        }
      }
    }
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < MF; ++i)
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];
    }
  }
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm + i * 16 + g + h * 8, col = n0 + wn + j * 8 + 2 * t;
        if (row >= M || col >= N) continue;
        float2 v = make_float2(acc[i][j][2 * h] + bias[col], acc[i][j][2 * h + 1] + (col + 1 < N ? bias[col + 1] : 0.f));
        if (col + 1 < N) *reinterpret_cast<float2*>(C + (long long)row * N + col) = v;
        else C[(long long)row * N + col] = v.x;
      }
}
"""


def _wrapper(i: int, cfg: tuple[int, ...], chunk: bool, vec: bool) -> str:
    bm, bn, bk, wmn, wnn, stages, minb = cfg
    ld = (bk if bk % 32 == 16 else bk + 16) if vec else bk + 4
    smem = stages * (bm + bn) * ld * 4
    kern = f"kf_gemm<{bm}, {bn}, {bk}, {wmn}, {wnn}, {stages}, {minb}, true, {str(chunk).lower()}, {str(vec).lower()}>"
    return f"""
torch::Tensor gemm{i}(torch::Tensor a, torch::Tensor b, torch::Tensor bias) {{
  const int M = a.size(0), K = a.size(1), N = b.size(0);
  auto c = torch::empty({{M, N}}, a.options());
  cudaFuncSetAttribute({kern}, cudaFuncAttributeMaxDynamicSharedMemorySize, {smem});
  dim3 grid((M + {bm - 1}) / {bm}, (N + {bn - 1}) / {bn});
  {kern}<<<grid, {wmn * wnn * 32}, {smem}, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), bias.data_ptr<float>(), c.data_ptr<float>(), M, N, K);
  return c;
}}
"""


def build() -> tuple[object, list[tuple[str, tuple[int, ...], bool, bool]]]:
    variants = [(f"3xTF32 {'chunked' if chunk else 'unchunked'}{' vec' if vec else ''} {cfg[0]}x{cfg[1]}x{cfg[2]} "
                 f"w{cfg[3]}x{cfg[4]} s{cfg[5]}", cfg, chunk, vec) for cfg, chunk, vec in VARIANTS]
    src = "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n" + CUDA + "".join(
        _wrapper(i, cfg, chunk, vec) for i, (_, cfg, chunk, vec) in enumerate(variants))
    names = [f"gemm{i}" for i in range(len(variants))]
    cpp = "".join(f"torch::Tensor {n}(torch::Tensor a, torch::Tensor b, torch::Tensor bias);\n" for n in names)
    ext = load_inline("kf_gemm_probe", cpp, cuda_sources=src, functions=names, verbose=False,
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v"])
    return ext, variants


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    ext, variants = build()
    planned, names = kernelfuse_gemms()
    lines = ["| M x N x K | version | ms | TFLOP/s | vs cuBLAS fp32 | max abs err (fp64) |", "|---|---|---|---|---|---|"]
    for (m, n, k), name in zip(SHAPES, names, strict=True):
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") / k**0.5
        b = torch.randn(n, device="cuda")
        ref = torch.addmm(b.double(), x.double(), w.double().t())

        def row(name: str, fn, base: float | None, ref=ref, shape=(m, n, k)) -> float:  # noqa: ANN001
            err = (fn().double() - ref).abs().max().item()
            ms = median_event_ms(fn)
            vs = f"{base / ms:.3f}x" if base else "1.000x"
            flop = 2 * shape[0] * shape[1] * shape[2]
            lines.append(f"| {'x'.join(map(str, shape))} | {name} | {ms:.4f} | {flop / ms / 1e9:.1f} | {vs} | {err:.2e} |")
            print(lines[-1], flush=True)
            return ms

        args = (x, w, b)
        base = row("cuBLAS fp32 (F.linear)", lambda args=args: F.linear(*args), None)
        torch.backends.cuda.matmul.allow_tf32 = True
        row("cuBLAS TF32 (F.linear)", lambda args=args: F.linear(*args), base)
        torch.backends.cuda.matmul.allow_tf32 = False
        fn = getattr(planned, name)
        row("kernelfuse (the planner's kernel)", lambda fn=fn, args=args: fn(args[0], args[1].t(), args[2]), base)
        for i, (label, *_) in enumerate(variants):
            fn = getattr(ext, f"gemm{i}")
            row(label, lambda fn=fn, args=args: fn(*args), base)
    text = "\n".join(lines) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(f"# GEMM probe ({torch.cuda.get_device_name()})\n\n" + text)


if __name__ == "__main__":
    main()
