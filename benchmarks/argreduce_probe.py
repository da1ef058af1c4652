"""argmin over an outer (middle) dim, strategies side by side: which access pattern reaches DRAM bandwidth?

    PYTHONPATH=. python benchmarks/argreduce_probe.py [B R C] > $OUT/argreduce.md

x is (B, R, C) float32, argmin over dim 1 (KernelBench level-1 52: 128 x 4096 x 4095). Strategies:
- aten: torch.argmin.
- column-N: one thread per output column walks the R rows, N loads in flight (kernelfuse's `strided` today: N=8).
- rows-K-S: a block of 256 threads takes (batch, S row chunks) and reads each row of its chunk whole, each thread
  keeping K columns' (value, index) in registers; a second kernel combines the S chunks' partials.
Every result is compared with torch.argmin (exact). Times are CUDA-event medians, L2 flushed before each call.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.cpp_extension import load_inline

from kernelfuse.bench.timer import median_event_ms

SRC = r"""
#include <torch/extension.h>
__device__ __forceinline__ void better(float& v, int& i, float vb, int ib) {
  // later index: wins only if strictly smaller or NaN (first NaN kept)
  if (v == v && !(vb >= v)) { v = vb; i = ib; }
}
__device__ __forceinline__ void merge(float& v, int& i, float vb, int ib) {
  if (v != v) { if (vb != vb && ib < i) { i = ib; } return; }
  if (vb != vb || vb < v || (vb == v && ib < i)) { v = vb; i = ib; }
}
template <int N>
__global__ void column(const float* __restrict__ x, long long* __restrict__ out, int B, int R, int C) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)B * C) return;
  const int b = t / C, c = t % C;
  const float* p = x + (long long)b * R * C + c;
  float v = __int_as_float(0x7f800000); int idx = 0x7fffffff;
  v = p[0]; idx = 0;
  int r = 1;
  for (; r + N <= R; r += N) {
    float w[N];
#pragma unroll
    for (int j = 0; j < N; ++j) w[j] = __ldg(p + (long long)(r + j) * C);
#pragma unroll
    for (int j = 0; j < N; ++j) better(v, idx, w[j], r + j);
  }
  for (; r < R; ++r) better(v, idx, __ldg(p + (long long)r * C), r);
  out[t] = idx;
}
template <int K>
__global__ void __launch_bounds__(256) rows(const float* __restrict__ x, float* __restrict__ pv, int* __restrict__ pi,
                                           int B, int R, int C, int S) {
  const int b = blockIdx.x / S, s = blockIdx.x % S;
  const int per = (R + S - 1) / S, r0 = s * per, r1 = min(R, r0 + per);
  float v[K]; int idx[K];
#pragma unroll
  for (int k = 0; k < K; ++k) { v[k] = __int_as_float(0x7fffffff); idx[k] = 0x7fffffff; }
  const float* base = x + (long long)b * R * C;
  bool first = true;
  for (int r = r0; r < r1; ++r) {
    const float* row = base + (long long)r * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + 256 * k;
      if (c < C) {
        const float w = __ldg(row + c);
        if (first) { v[k] = w; idx[k] = r; } else better(v[k], idx[k], w, r);
      }
    }
    first = false;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + 256 * k;
    if (c < C) { const long long o = ((long long)b * S + s) * C + c; pv[o] = v[k]; pi[o] = idx[k]; }
  }
}
__global__ void combine(const float* __restrict__ pv, const int* __restrict__ pi, long long* __restrict__ out,
                        int B, int C, int S) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)B * C) return;
  const int b = t / C, c = t % C;
  float v = pv[(long long)b * S * C + c]; int i = pi[(long long)b * S * C + c];
  for (int s = 1; s < S; ++s) merge(v, i, pv[((long long)b * S + s) * C + c], pi[((long long)b * S + s) * C + c]);
  out[t] = i;
}
torch::Tensor run_column(torch::Tensor x, int64_t n) {
  const int B = x.size(0), R = x.size(1), C = x.size(2);
  auto out = torch::empty({B, C}, x.options().dtype(torch::kLong));
  const long long total = (long long)B * C;
  const int blocks = (total + 255) / 256;
  if (n == 8) column<8><<<blocks, 256>>>(x.data_ptr<float>(), (long long*)out.data_ptr<int64_t>(), B, R, C);
  else column<16><<<blocks, 256>>>(x.data_ptr<float>(), (long long*)out.data_ptr<int64_t>(), B, R, C);
  return out;
}
torch::Tensor run_rows(torch::Tensor x, int64_t S) {
  const int B = x.size(0), R = x.size(1), C = x.size(2);
  auto pv = torch::empty({B, S, C}, x.options());
  auto pi = torch::empty({B, S, C}, x.options().dtype(torch::kInt));
  auto out = torch::empty({B, C}, x.options().dtype(torch::kLong));
  TORCH_CHECK(C <= 256 * 16, "C too large for the probe");
  rows<16><<<B * S, 256>>>(x.data_ptr<float>(), pv.data_ptr<float>(), pi.data_ptr<int>(), B, R, C, S);
  const long long total = (long long)B * C;
  combine<<<(total + 255) / 256, 256>>>(pv.data_ptr<float>(), pi.data_ptr<int>(),
                                        (long long*)out.data_ptr<int64_t>(), B, C, S);
  return out;
}
"""
CPP = "torch::Tensor run_column(torch::Tensor x, int64_t n);\ntorch::Tensor run_rows(torch::Tensor x, int64_t S);"


def main(argv: list[str]) -> int:
    b, r, c = (int(a) for a in argv) if argv else (128, 4096, 4095)
    ext = load_inline("argreduce_probe", CPP, cuda_sources=SRC, functions=["run_column", "run_rows"],
                      extra_cuda_cflags=["-O3"])
    x = torch.rand(b, r, c, device="cuda")
    x[0, 7, 3] = x[0, 9, 3] = -1.0  # a tie: the lower index must win
    want = torch.argmin(x, dim=1)
    floor_ms = x.numel() * 4 / 4.16e12 * 1e3
    cases = {"aten": lambda: torch.argmin(x, dim=1), "sum over dim 1 (aten)": lambda: x.sum(1)}
    cases.update({f"column-{n}": (lambda n=n: ext.run_column(x, n)) for n in (8, 16)})
    cases.update({f"rows-16-S{s}": (lambda s=s: ext.run_rows(x, s)) for s in (4, 8, 16, 32)})
    print(f"{torch.cuda.get_device_name()} · x {tuple(x.shape)} argmin over dim 1 · floor {floor_ms:.3f} ms")
    print("| strategy | ms | / floor | exact |\n|---|---|---|---|")
    for name, fn in cases.items():
        got = fn()
        exact = "-" if got.dtype != torch.long else str(bool(torch.equal(got, want)))
        ms = median_event_ms(fn)
        print(f"| {name} | {ms:.3f} | {ms / floor_ms:.2f} | {exact} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
