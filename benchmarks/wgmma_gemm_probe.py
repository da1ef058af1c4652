"""A 3xTF32 GEMM on Hopper's wgmma, measured against cuBLAS (strict fp32 and TF32) and float64: is the warpgroup
instruction the way past cuBLAS's fp32 SGEMM for the Linear layers of the strict policy?

Our mma.sync 3xTF32 kernel (kernelfuse.codegen.gemm_tc) runs at 0.93-1.03x of cuBLAS's fp32 GEMM (stop 43). wgmma
issues 64 x N x 8 products per warpgroup from shared-memory descriptors; at a third of the TF32 tensor rate the
3xTF32 product still has about twice the FP32 FMA rate to spend. This probe is the kernel alone, not yet a plan
anchor: C = A Bᵀ (A M x K, B N x K, both row-major, as nn.Linear), M and N multiples of 128, K of 32.

The kernel: 128 x 128 tiles, two consumer warpgroups of 64 rows, K in stages of 32 through a 3-deep cp.async ring.
B's stage lands in shared memory in the 128-byte swizzled K-major layout wgmma's descriptors read; every thread
then splits it in place, position by position, into its TF32-rounded big part and the rounded remainder (a second
tile). A's fragments come from a padded (conflict-free) tile into registers and split there. Per 8-deep k step
three wgmma.m64n128k8: small x big, big x small, big x big; each stage's products go to a fresh accumulator that
is then added to the running sum in fp32 (the tensor cores' accumulation truncates: stop 41). `run(..., 33)` is
the same with four stages and the next stage's B split while this stage's products run; `run(..., 34)` that with
the truncating split (the fp32 tile is its own big part: the form kernelfuse.codegen.gemm_wgmma took, stop 45);
`run(..., 35)` that with the next stage's A fragments also split during the products; `run(..., 1)` plain TF32
(big x big only, accumulated across stages) for the raw rate.

Run on the GPU machine from the repo root (builds for sm_90a):
    PYTHONPATH=. python benchmarks/wgmma_gemm_probe.py > $OUT/wgmma_gemm_probe.md
"""

from __future__ import annotations

import os

import torch
from torch.utils.cpp_extension import load_inline

from kernelfuse.bench.timer import median_event_ms

SHAPES = [(1024, 8192, 8192), (2048, 8192, 8192), (4096, 4096, 4096), (128, 4096, 4096)]


def _accumulator_operands(name: str, first: int) -> tuple[str, str]:
    """(the PTX register list {%first, ...} of 64 floats, the asm operand list "+f"(name[0]), ...)."""
    regs = ", ".join(f"%{first + i}" for i in range(64))
    ops = ", ".join(f'"+f"({name}[{i}])' for i in range(64))
    return "{" + regs + "}", ops


_D_REGS, _D_OPS = _accumulator_operands("d", 0)

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {
constexpr int BM = 128, BN = 128, BK = 32, STAGES = 3, THREADS = 256;
constexpr int A_PITCH = BK + 4;                          // floats a row of the A tile: fragment reads conflict-free
constexpr int B_TILE = BN * BK;                          // floats of one B tile (128 rows of 128 bytes, swizzled)
constexpr int STAGE_FLOATS = 2 * B_TILE + BM * A_PITCH;  // B big | B small | A: 51200 bytes, a multiple of 1024
constexpr int SMEM_BYTES = STAGES * STAGE_FLOATS * 4 + 1024;

__device__ __forceinline__ float tf32_round(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}
__device__ __forceinline__ float tf32_trunc(float x) { return __uint_as_float(__float_as_uint(x) & 0xffffe000u); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// wgmma's shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups 1024 bytes apart
__device__ __forceinline__ uint64_t b_descriptor(const float* tile, int k_step) {
  const uint64_t addr = (unsigned)__cvta_generic_to_shared(tile) + k_step * 32;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_tf32(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 D_REGS, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : D_OPS
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// One stage's tiles, k0 on: B's rows swizzled (16-byte chunk c of row r at chunk c ^ (r % 8)), A's padded.
__device__ __forceinline__ void load_stage(float* stage, const float* A, const float* B, int K, int m0, int n0,
                                           int k0) {
  float* b = stage;
  float* a = stage + 2 * B_TILE;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = threadIdx.x + i * THREADS, r = q >> 3, c = q & 7;
    cp_async16(b + r * BK + ((c ^ (r & 7)) << 2), B + (size_t)(n0 + r) * K + k0 + c * 4);
    cp_async16(a + r * A_PITCH + c * 4, A + (size_t)(m0 + r) * K + k0 + c * 4);
  }
}

// B's stage split in place, position by position (the swizzle does not matter): TF32-rounded big part over the
// fp32 value, the rounded remainder into the second tile
template <bool TRUNC = false>
__device__ __forceinline__ void split_b(float* b_big, float* b_small) {
#pragma unroll
  for (int i = 0; i < B_TILE / 4 / THREADS; ++i) {
    const int q = (threadIdx.x + i * THREADS) * 4;
    const float4 v = *reinterpret_cast<const float4*>(b_big + q);
    if (TRUNC) {  // the big part is the fp32 value itself (the tensor cores read its top 19 bits): only the rest
      *reinterpret_cast<float4*>(b_small + q) = make_float4(v.x - tf32_trunc(v.x), v.y - tf32_trunc(v.y),
                                                            v.z - tf32_trunc(v.z), v.w - tf32_trunc(v.w));
      continue;
    }
    const float4 big = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
    *reinterpret_cast<float4*>(b_big + q) = big;
    *reinterpret_cast<float4*>(b_small + q) = make_float4(tf32_round(v.x - big.x), tf32_round(v.y - big.y),
                                                          tf32_round(v.z - big.z), tf32_round(v.w - big.w));
  }
}

// The warp's A fragments of the stage's four k8 steps (rows row and row + 8, columns t and t + 4), split
template <bool TRUNC = false>
__device__ __forceinline__ void a_fragments(const float* a_tile, int row, int t, uint32_t (&a_big)[4][4],
                                            uint32_t (&a_small)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const float raw[4] = {a_tile[row * A_PITCH + ks * 8 + t], a_tile[(row + 8) * A_PITCH + ks * 8 + t],
                          a_tile[row * A_PITCH + ks * 8 + t + 4], a_tile[(row + 8) * A_PITCH + ks * 8 + t + 4]};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (TRUNC) {
        a_big[ks][j] = __float_as_uint(raw[j]);
        a_small[ks][j] = __float_as_uint(raw[j] - tf32_trunc(raw[j]));
        continue;
      }
      const float big = tf32_round(raw[j]);
      a_big[ks][j] = __float_as_uint(big);
      a_small[ks][j] = __float_as_uint(tf32_round(raw[j] - big));
    }
  }
}

// The stage's 3xTF32 products into a fresh accumulator d: small x big, big x small, big x big per k8 step
__device__ __forceinline__ void issue_3x(float (&d)[64], const uint32_t (&a_big)[4][4], const uint32_t (&a_small)[4][4],
                                         const float* b_big, const float* b_small) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    wgmma_tf32(d, a_small[ks], b_descriptor(b_big, ks), ks > 0);
    wgmma_tf32(d, a_big[ks], b_descriptor(b_small, ks), 1);
    wgmma_tf32(d, a_big[ks], b_descriptor(b_big, ks), 1);
  }
}

// accumulator fragment of m64n128: n8 block j holds (row g, cols 8j + 2t, +1) and (row g + 8, the same cols)
__device__ __forceinline__ void store_c(float* C, int N, int row, int col0, int t, const float (&total)[64]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = col0 + 8 * j + 2 * t;
    *reinterpret_cast<float2*>(C + (size_t)row * N + col) = make_float2(total[4 * j], total[4 * j + 1]);
    *reinterpret_cast<float2*>(C + (size_t)(row + 8) * N + col) = make_float2(total[4 * j + 2], total[4 * j + 3]);
  }
}

__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A block's place: its tile's corner, this thread's accumulator row within the tile (warpgroup, warp, lane group)
// and its column pair; the shared memory base 1024-aligned (the 128-byte swizzle's atom)
struct Place {
  float* smem;
  int m0, n0, row, t;
};
__device__ __forceinline__ Place place(float* smem_raw) {
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  return {reinterpret_cast<float*>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023), (int)blockIdx.y * BM,
          (int)blockIdx.x * BN, wg * 64 + warp * 16 + lane / 4, lane % 4};
}
// the first S - 1 stages in flight, one commit group each (empty past K's end)
template <int S>
__device__ __forceinline__ void prefetch(const Place& at, const float* A, const float* B, int K) {
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < K / BK) load_stage(at.smem + s * STAGE_FLOATS, A, B, K, at.m0, at.n0, s * BK);
    cp_async_commit();
  }
}

template <int SPLIT>
__global__ void __launch_bounds__(THREADS, 1) gemm_wgmma(const float* __restrict__ A, const float* __restrict__ B,
                                                         float* __restrict__ C, int M, int N, int K) {
  extern __shared__ float smem_raw[];
  const Place at = place(smem_raw);
  float* const smem = at.smem;
  const int m0 = at.m0, n0 = at.n0, row = at.row, t = at.t, KT = K / BK;
  float total[64] = {}, d[64];
  prefetch<STAGES>(at, A, B, K);
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    fence_async();    // cp.async's writes, then wgmma's async reads
    __syncthreads();  // the stage is in; every warpgroup is done with the slot the next load overwrites
    if (kt + STAGES - 1 < KT)
      load_stage(smem + ((kt + STAGES - 1) % STAGES) * STAGE_FLOATS, A, B, K, m0, n0, (kt + STAGES - 1) * BK);
    cp_async_commit();
    float* stage = smem + (kt % STAGES) * STAGE_FLOATS;
    if (SPLIT == 3) {
      split_b(stage, stage + B_TILE);
      fence_async();  // generic stores, then wgmma's async reads
      __syncthreads();
    }
    uint32_t a_big[4][4], a_small[4][4];
    a_fragments(stage + 2 * B_TILE, row, t, a_big, a_small);
    wgmma_fence();
    if (SPLIT == 3) {
      issue_3x(d, a_big, a_small, stage, stage + B_TILE);
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_tf32(total, a_big[ks], b_descriptor(stage, ks), kt > 0 || ks > 0);
    }
    wgmma_commit();
    wgmma_wait();
    if (SPLIT == 3) {
#pragma unroll
      for (int i = 0; i < 64; ++i) total[i] += d[i];
    }
  }
  store_c(C, N, m0 + row, n0, t, total);
}

// 3xTF32 with the next stage's B split while the tensor cores run this stage's products: four stages (200 KB), the
// load of stage kt + 3 issued into the slot stage kt - 1 freed
constexpr int OVERLAP_STAGES = 4;
constexpr int OVERLAP_SMEM_BYTES = OVERLAP_STAGES * STAGE_FLOATS * 4 + 1024;

// PREFETCH_A: the next stage's A fragments are loaded and split while this stage's products run (after its B split),
// so that between two stages' products only the wait, the sum and a barrier remain
template <bool TRUNC, bool PREFETCH_A = false>
__global__ void __launch_bounds__(THREADS, 1) gemm_wgmma_overlap(const float* __restrict__ A,
    const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
  constexpr int S = OVERLAP_STAGES;
  extern __shared__ float smem_raw[];
  const Place at = place(smem_raw);
  float* const smem = at.smem;
  const int m0 = at.m0, n0 = at.n0, row = at.row, t = at.t, KT = K / BK;
  float total[64] = {}, d[64];
  prefetch<S>(at, A, B, K);
  cp_async_wait<S - 2>();  // stage 0 is in
  __syncthreads();
  split_b<TRUNC>(smem, smem + B_TILE);
  fence_async();
  __syncthreads();
  uint32_t a_big[4][4], a_small[4][4];
  if (PREFETCH_A) a_fragments<TRUNC>(smem + 2 * B_TILE, row, t, a_big, a_small);
  for (int kt = 0; kt < KT; ++kt) {
    if (kt + S - 1 < KT)  // into stage kt - 1's slot: every warpgroup finished it before the last barrier
      load_stage(smem + ((kt + S - 1) % S) * STAGE_FLOATS, A, B, K, m0, n0, (kt + S - 1) * BK);
    cp_async_commit();
    float* stage = smem + (kt % S) * STAGE_FLOATS;
    if (!PREFETCH_A) a_fragments<TRUNC>(stage + 2 * B_TILE, row, t, a_big, a_small);
    wgmma_fence();
    issue_3x(d, a_big, a_small, stage, stage + B_TILE);
    wgmma_commit();
    uint32_t next_big[4][4], next_small[4][4];
    if (kt + 1 < KT) {  // while the products run: stage kt + 1 in (two later groups may be pending), its B split
      cp_async_wait<S - 2>();
      __syncthreads();
      float* next = smem + ((kt + 1) % S) * STAGE_FLOATS;
      split_b<TRUNC>(next, next + B_TILE);
      fence_async();
      if (PREFETCH_A) a_fragments<TRUNC>(next + 2 * B_TILE, row, t, next_big, next_small);
    }
    wgmma_wait();
    if (PREFETCH_A) {  // this stage's A registers are free only now (the products read them asynchronously)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          a_big[ks][j] = next_big[ks][j];
          a_small[ks][j] = next_small[ks][j];
        }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] += d[i];
    __syncthreads();  // the next stage's split is visible; every warpgroup is done with this stage's slot
  }
  store_c(C, N, m0 + row, n0, t, total);
}
}  // namespace

void run(torch::Tensor a, torch::Tensor b, torch::Tensor c, int64_t split) {
  const int M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(M % BM == 0 && N % BN == 0 && K % BK == 0, "the probe's kernel takes M, N % 128 == 0, K % 32 == 0");
  auto kernel = split == 3 ? gemm_wgmma<3> : split == 1 ? gemm_wgmma<1>
      : split == 34 ? gemm_wgmma_overlap<true> : split == 35 ? gemm_wgmma_overlap<true, true>
      : gemm_wgmma_overlap<false>;
  const int smem = split >= 33 ? OVERLAP_SMEM_BYTES : SMEM_BYTES;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<dim3(N / BN, M / BM), THREADS, smem, c10::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), M, N, K);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}
""".replace("D_REGS", _D_REGS).replace("D_OPS", _D_OPS)


def build():
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # wgmma needs the arch-specific target, whatever the host sets
    return load_inline("kf_wgmma_gemm_probe", cpp_sources="void run(torch::Tensor a, torch::Tensor b, torch::Tensor c, "
                       "int64_t split);", cuda_sources=CUDA, functions=["run"], extra_cuda_cflags=["-O3"])


def layout_check(ext) -> None:
    """Exact integer products that name their operands: A one-hot (A[m][k] = 1 where k = m % 32), B[n][k] =
    (n % 16) * 64 + k, small enough for TF32. C[m][n] then names the B element each output read; the first
    mismatches are printed decoded, so that a wrong fragment or swizzle shows which rows and columns it mixed up."""
    m, n, k = 128, 256, 64
    a = torch.zeros(m, k, device="cuda")
    rows = torch.arange(m, device="cuda")
    a[rows, rows % 32] = 1.0
    nn, kk = torch.meshgrid(torch.arange(n, device="cuda"), torch.arange(k, device="cuda"), indexing="ij")
    b = ((nn % 16) * 64 + kk % 64).float()
    want = a @ b.T
    for split in (1, 3, 33, 34, 35):
        c = torch.full((m, n), float("nan"), device="cuda")
        ext.run(a, b, c, split)
        torch.cuda.synchronize()
        bad = (c != want).nonzero()
        print(f"layout check, SPLIT {split}: {'ok' if len(bad) == 0 else f'{len(bad)} of {m * n} wrong'}")
        for i, j in bad[:12].tolist():
            got = c[i, j].item()
            print(f"  C[{i}][{j}] = {got:g} (B row % 16 = {int(got) // 64 if got == got else '?'}, k = "
                  f"{int(got) % 64 if got == got else '?'}), want {want[i, j].item():g}")


def main() -> None:
    ext = build()
    layout_check(ext)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; TFLOP/s = 2MNK / time; error = max |C - "
          "float64| / max |float64|\n")
    print("| M x N x K | method | ms | TFLOP/s | rel. max error | error / cuBLAS fp32's |\n|---|---|---|---|---|---|")
    for m, n, k in SHAPES:
        probe_shape(ext, m, n, k)


def probe_shape(ext, m: int, n: int, k: int) -> None:
    """One shape's rows: cuBLAS in fp32 and TF32, the wgmma kernel in 3xTF32 and TF32."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    ref = a.double() @ b.double().T
    scale = ref.abs().max().item()
    c = torch.empty(m, n, device="cuda")

    def cublas(tf32: bool):
        def call():
            torch.backends.cuda.matmul.allow_tf32 = tf32
            return a @ b.T
        return call

    rows = [("cuBLAS fp32 (eager, strict)", cublas(False)), ("cuBLAS TF32", cublas(True)),
            ("wgmma 3xTF32", lambda: ext.run(a, b, c, 3)),
            ("wgmma 3xTF32, next B split during the products", lambda: ext.run(a, b, c, 33)),
            ("the same, big parts truncated by the tensor cores (only the rest written)", lambda: ext.run(a, b, c, 34)),
            ("the same, next A fragments split during the products", lambda: ext.run(a, b, c, 35)),
            ("wgmma TF32", lambda: ext.run(a, b, c, 1))]
    base_err = None
    for label, call in rows:
        out = call()
        out = c if out is None else out
        err = (out.double() - ref).abs().max().item() / scale
        base_err = base_err or err
        ms = median_event_ms(call, 10)
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"| {m} x {n} x {k} | {label} | {ms:.3f} | {2 * m * n * k / ms / 1e9:.0f} | {err:.2e} | "
              f"{err / base_err:.2f} |", flush=True)

if __name__ == "__main__":
    main()
