"""The channels-last plans' layout passes (NCHW -> NHWC before the convolution, NHWC -> NCHW in the epilogue), timed
by tiling against a plain copy, ATen's and Triton's (torch.compile) layout change: how far each is from the copy.

The kernels are the shape of kf_nchw_to_nhwc_v4 and the pointwise epilogue's k*_kernel_v (16-byte accesses both
ways through a shared tile), parameterized by the tile's channels TC and positions TP, the block's threads, and
streaming cache hints (ld.global.cs / st.global.cs). Run on the GPU machine from the repo root:
    PYTHONPATH=. python benchmarks/transpose_probe.py > $OUT/transpose_probe.md
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from kernelfuse.bench.timer import median_event_ms

CONFIGS = [(32, 64, 256, False), (32, 64, 256, True), (64, 64, 256, False), (64, 64, 256, True),
           (32, 128, 256, False), (64, 64, 512, False), (64, 128, 512, False), (32, 32, 128, False)]
SHAPES = [(64, 64, 256 * 256), (64, 64, 254 * 254), (64, 128, 126 * 126), (128, 64, 128 * 128)]

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

template <bool S> __device__ __forceinline__ float4 ld4(const float* p) {
  return S ? __ldcs(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
}
template <bool S> __device__ __forceinline__ void st4(float* p, float4 v) {
  if (S) __stcs(reinterpret_cast<float4*>(p), v); else *reinterpret_cast<float4*>(p) = v;
}

// x[n][c][p] -> y[n][p][c]
template <int TC, int TP, int THREADS, bool S>
__global__ void __launch_bounds__(THREADS) to_nhwc(const float* __restrict__ x, float* __restrict__ y, int C, int HW) {
  __shared__ float tile[TP][TC + 1];
  const long long base = (long long)blockIdx.z * C * HW;
  const int p0 = blockIdx.x * TP, c0 = blockIdx.y * TC;
  constexpr int RL = TP / 4, WL = TC / 4;
#pragma unroll
  for (int j = 0; j < TC * RL / THREADS; ++j) {
    const int t = threadIdx.x + j * THREADS, r = t / RL, h = (t % RL) * 4;
    if (c0 + r < C && p0 + h < HW) {
      const float4 v = ld4<S>(x + base + (long long)(c0 + r) * HW + p0 + h);
      tile[h][r] = v.x; tile[h + 1][r] = v.y; tile[h + 2][r] = v.z; tile[h + 3][r] = v.w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < TP * WL / THREADS; ++j) {
    const int t = threadIdx.x + j * THREADS, p = t / WL, q = (t % WL) * 4;
    if (p0 + p < HW && c0 + q < C)
      st4<S>(y + base + (long long)(p0 + p) * C + c0 + q,
             make_float4(tile[p][q], tile[p][q + 1], tile[p][q + 2], tile[p][q + 3]));
  }
}

// x[n][p][c] -> y[n][c][p]
template <int TC, int TP, int THREADS, bool S>
__global__ void __launch_bounds__(THREADS) to_nchw(const float* __restrict__ x, float* __restrict__ y, int C, int HW) {
  __shared__ float tile[TC][TP + 1];
  const long long base = (long long)blockIdx.z * C * HW;
  const int p0 = blockIdx.x * TP, c0 = blockIdx.y * TC;
  constexpr int RL = TP / 4, WL = TC / 4;
#pragma unroll
  for (int j = 0; j < TP * WL / THREADS; ++j) {
    const int t = threadIdx.x + j * THREADS, p = t / WL, q = (t % WL) * 4;
    if (p0 + p < HW && c0 + q < C) {
      const float4 v = ld4<S>(x + base + (long long)(p0 + p) * C + c0 + q);
      tile[q][p] = v.x; tile[q + 1][p] = v.y; tile[q + 2][p] = v.z; tile[q + 3][p] = v.w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < TC * RL / THREADS; ++j) {
    const int t = threadIdx.x + j * THREADS, r = t / RL, h = (t % RL) * 4;
    if (c0 + r < C && p0 + h < HW)
      st4<S>(y + base + (long long)(c0 + r) * HW + p0 + h,
             make_float4(tile[r][h], tile[r][h + 1], tile[r][h + 2], tile[r][h + 3]));
  }
}

// The epilogue form (k*_kernel_v): NHWC -> NCHW through bias, a per-channel multiplier, leaky ReLU and erf GELU.
// FLAT: each element's channel from its flat NCHW index, as the generated k*_apply(acc, i, ...) finds it; else
// from the tile's own coordinates, once a thread (its 4 positions share the channel).
__device__ __forceinline__ float epi(float acc, float b, float m) {
  const float v = (acc + b) * m, l = v > 0.0f ? v : v * 0.01f;
  return 0.5f * l * (1.0f + erff(l * 0.70710678118654752440f));
}
template <int C, int HW, bool FLAT>
__global__ void __launch_bounds__(256) epi_nchw(const float* __restrict__ x, float* __restrict__ y,
                                                const float* __restrict__ bias, const float* __restrict__ mult) {
  __shared__ float tile[32][65];
  const int base = (int)blockIdx.z * C * HW;
  const int p0 = blockIdx.x * 64, c0 = blockIdx.y * 32;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int t = threadIdx.x + j * 256, p = t >> 3, q = (t & 7) * 4;
    if (p0 + p < HW && c0 + q < C) {
      const float4 v = *reinterpret_cast<const float4*>(x + base + (p0 + p) * C + c0 + q);
      tile[q][p] = v.x; tile[q + 1][p] = v.y; tile[q + 2][p] = v.z; tile[q + 3][p] = v.w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int t = threadIdx.x + j * 256, r = t >> 4, h = (t & 15) * 4;
    if (p0 + h < HW && c0 + r < C) {
      const int i = base + (c0 + r) * HW + p0 + h;
      float4 v;
      if (FLAT) {
        v.x = epi(tile[r][h], bias[(i / HW) % C], mult[(i / HW) % C]);
        v.y = epi(tile[r][h + 1], bias[((i + 1) / HW) % C], mult[((i + 1) / HW) % C]);
        v.z = epi(tile[r][h + 2], bias[((i + 2) / HW) % C], mult[((i + 2) / HW) % C]);
        v.w = epi(tile[r][h + 3], bias[((i + 3) / HW) % C], mult[((i + 3) / HW) % C]);
      } else {
        const float b = bias[c0 + r], m = mult[c0 + r];
        v.x = epi(tile[r][h], b, m); v.y = epi(tile[r][h + 1], b, m);
        v.z = epi(tile[r][h + 2], b, m); v.w = epi(tile[r][h + 3], b, m);
      }
      *reinterpret_cast<float4*>(y + i) = v;
    }
  }
}

void run_epi(torch::Tensor x, torch::Tensor y, torch::Tensor bias, torch::Tensor mult, bool flat) {
  TORCH_CHECK(x.numel() == 64LL * 64 * 64516, "the probe's one epilogue shape");
  dim3 grid((64516 + 63) / 64, 2, 64);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float *px = x.data_ptr<float>(), *pb = bias.data_ptr<float>(), *pm = mult.data_ptr<float>();
  float* py = y.data_ptr<float>();
  if (flat) epi_nchw<64, 64516, true><<<grid, 256, 0, stream>>>(px, py, pb, pm);
  else epi_nchw<64, 64516, false><<<grid, 256, 0, stream>>>(px, py, pb, pm);
}

template <int TC, int TP, int THREADS, bool S>
void launch(const torch::Tensor& x, torch::Tensor& y, int64_t N, int64_t C, int64_t HW, bool nhwc) {
  dim3 grid((HW + TP - 1) / TP, (C + TC - 1) / TC, N);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (nhwc) to_nhwc<TC, TP, THREADS, S><<<grid, THREADS, 0, stream>>>(x.data_ptr<float>(), y.data_ptr<float>(), C, HW);
  else to_nchw<TC, TP, THREADS, S><<<grid, THREADS, 0, stream>>>(x.data_ptr<float>(), y.data_ptr<float>(), C, HW);
}

void run(torch::Tensor x, torch::Tensor y, int64_t N, int64_t C, int64_t HW, bool nhwc, int64_t config) {
  switch (config) {
    case 0: launch<32, 64, 256, false>(x, y, N, C, HW, nhwc); break;
    case 1: launch<32, 64, 256, true>(x, y, N, C, HW, nhwc); break;
    case 2: launch<64, 64, 256, false>(x, y, N, C, HW, nhwc); break;
    case 3: launch<64, 64, 256, true>(x, y, N, C, HW, nhwc); break;
    case 4: launch<32, 128, 256, false>(x, y, N, C, HW, nhwc); break;
    case 5: launch<64, 64, 512, false>(x, y, N, C, HW, nhwc); break;
    case 6: launch<64, 128, 512, false>(x, y, N, C, HW, nhwc); break;
    case 7: launch<32, 32, 128, false>(x, y, N, C, HW, nhwc); break;
  }
}
"""


def main() -> None:
    ext = load_inline("kf_transpose_probe", cpp_sources="void run(torch::Tensor x, torch::Tensor y, int64_t N, "
                      "int64_t C, int64_t HW, bool nhwc, int64_t config);\nvoid run_epi(torch::Tensor x, "
                      "torch::Tensor y, torch::Tensor bias, torch::Tensor mult, bool flat);", cuda_sources=CUDA,
                      functions=["run", "run_epi"], extra_cuda_cflags=["-O3", "-arch=sm_90"])
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; GB/s = (read + written) / time\n")
    probe_epilogue(ext)
    for n, c, hw in SHAPES:
        probe_shape(ext, n, c, hw)


def probe_epilogue(ext) -> None:
    """Level-2 54's epilogue (NHWC in, NCHW out): the channel per element from the flat index or once a thread,
    against Triton's kernel for the same function and the plain layout change."""
    n, c, hw = 64, 64, 64516
    xl = torch.randn(n, hw, c, device="cuda")
    bias, mult = torch.randn(c, device="cuda"), torch.rand(c, device="cuda") + 0.5
    y = torch.empty(n, c, hw, device="cuda")
    x4 = xl.view(n, 254, 254, c).permute(0, 3, 1, 2)  # channels-last (n, c, h, w)

    def chain(t):
        return F.gelu(F.leaky_relu((t + bias.view(1, c, 1, 1)) * mult.view(1, c, 1, 1), 0.01)).contiguous()

    triton = torch.compile(chain)
    want = chain(x4).view(n, c, hw)
    gb = 2 * xl.numel() * 4 / 1e9
    rows = [("copy (clone)", xl.clone), ("Triton (torch.compile) of the chain", lambda: triton(x4)),
            ("layout change alone (TC 32 TP 64)", lambda: ext.run(xl, y, n, c, hw, False, 0))]
    for flat in (True, False):
        ext.run_epi(xl, y, bias, mult, flat)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        rows.append((f"epilogue, channel {'per element from the flat index' if flat else 'once a thread'}",
                     lambda flat=flat: ext.run_epi(xl, y, bias, mult, flat)))
    print(f"\n### epilogue of level-2 54: N {n}, C {c}, HW {hw} ({gb:.2f} GB moved)\n\n| kernel | ms | GB/s |\n"
          "|---|---|---|")
    for label, call in rows:
        ms = median_event_ms(call, 30)
        print(f"| {label} | {ms:.4f} | {gb / ms * 1e3:.0f} |", flush=True)


def probe_shape(ext, n: int, c: int, hw: int) -> None:
    """One table: the copy, ATen's and Triton's layout change, then every CONFIGS tiling both ways."""
    x = torch.randn(n, c, hw, device="cuda")
    xl = x.transpose(1, 2).contiguous()  # [n][hw][c]
    x4 = x.view(n, c, hw, 1)
    y = torch.empty_like(x)
    gb = 2 * x.numel() * 4 / 1e9
    triton = torch.compile(lambda t: t.contiguous(memory_format=torch.channels_last))
    rows = [("copy (clone)", x.clone),
            ("ATen .contiguous(channels_last)", lambda: x4.contiguous(memory_format=torch.channels_last)),
            ("Triton (torch.compile) channels_last", lambda: triton(x4))]
    for i, (tc, tp, threads, stream) in enumerate(CONFIGS):
        tag = f"TC {tc} TP {tp} threads {threads}{' streaming' if stream else ''}"
        rows.append((f"to NHWC, {tag}", lambda i=i: ext.run(x, y, n, c, hw, True, i)))
        rows.append((f"to NCHW, {tag}", lambda i=i: ext.run(xl, y, n, c, hw, False, i)))
    for i in range(len(CONFIGS)):
        ext.run(x, y, n, c, hw, True, i)
        assert torch.equal(y.view(n, hw, c), xl), CONFIGS[i]
        ext.run(xl, y, n, c, hw, False, i)
        assert torch.equal(y, x), CONFIGS[i]
    print(f"\n### N {n}, C {c}, HW {hw} ({gb:.2f} GB moved)\n\n| kernel | ms | GB/s |\n|---|---|---|")
    for label, call in rows:
        ms = median_event_ms(call, 30)
        print(f"| {label} | {ms:.4f} | {gb / ms * 1e3:.0f} |", flush=True)

if __name__ == "__main__":
    main()
