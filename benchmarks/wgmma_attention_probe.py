"""A bf16 flash-attention forward on Hopper's wgmma, head dim 64, measured against torch's SDPA backends and
float64: how much of the gap to cuDNN's attention (0.60-0.75x at stop 44 for our mma.sync kernel) the warpgroup
instruction closes, before it becomes a plan kernel.

The kernel: a block of 128 query rows, two warpgroups of 64; key tiles of 64 in a 2-deep cp.async ring. Q, K and V
tiles sit in shared memory in the 128-byte swizzled layout (a row of 64 bf16 is 128 bytes: 16-byte chunk c of row
r at chunk c ^ (r % 8)). S = Q Kᵀ is four wgmma.m64n64k16 with both operands from descriptors (K-major); the online
softmax runs on the accumulator fragments (exp2 with the scale folded, rows reduced over a quad); P goes back to
registers as bf16 A fragments and O += P V is four wgmma.m64n64k16 with V read through an MN-major descriptor
(imm-trans-b = 1; V's natural [key][d] rows are that layout). No warp specialization or TMA yet: the point is the
instruction's rate and the layouts, checked first on structured inputs.

Run on the GPU machine from the repo root (builds for sm_90a):
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py > $OUT/wgmma_attention_probe.md
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.cpp_extension import load_inline

from kernelfuse.bench.timer import median_event_ms

# (batch, heads, sequence, causal): GPT-2 small's attention, a long non-causal one, a ViT-sized one
CASES = [(8, 12, 1024, True), (4, 16, 4096, False), (64, 12, 256, False)]


def _regs(first: int, count: int) -> str:
    return "{" + ", ".join(f"%{first + i}" for i in range(count)) + "}"


def _ops(name: str, count: int) -> str:
    return ", ".join(f'"+f"({name}[{i}])' for i in range(count))


CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {
constexpr int D = 64, BR = 128, BC = 64, THREADS = 256;
constexpr int TILE_BYTES = 64 * 128;  // 64 rows of 128 bytes (64 bf16)
// shared memory: Q (2 tiles of 64 rows) | K[2] | V[2], every tile 1024-byte aligned for the swizzle
constexpr int SMEM_BYTES = 6 * TILE_BYTES + 1024;

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// 64 rows x 64 bf16 from global (row pitch `pitch` elements) into a swizzled tile; 512 chunks of 16 bytes
__device__ __forceinline__ void load_tile(char* tile, const __nv_bfloat16* src, long long pitch, int rows_left) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int q = threadIdx.x + i * THREADS, r = q >> 3, c = q & 7;
    char* dst = tile + r * 128 + ((c ^ (r & 7)) << 4);
    if (r < rows_left) cp_async16(dst, src + (long long)r * pitch + c * 8);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// descriptor of a 128-byte-swizzled tile: 8-row groups 1024 bytes apart (stride byte offset); `offset` bytes into
// it (a k step). The leading byte offset is unused where one swizzle atom spans the tile's 128-byte rows: K-major
// Q and K (64 bf16 of head dim), and V read MN-major (64 bf16 of head dim along N); V's is set to 1024 as well, so
// that either reading of the two offsets for MN-major layouts gives the same addresses.
__device__ __forceinline__ uint64_t descriptor(const char* tile, int offset, int leading = 16) {
  const uint64_t addr = (unsigned)__cvta_generic_to_shared(tile) + offset;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(leading >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// S (m64n64, fp32) = Q Kᵀ over one k16 step: both from descriptors, K-major
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 S_REGS, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : S_OPS
      : "l"(a), "l"(b), "r"(accumulate));
}
// O (m64n64, fp32) += P V over one k16 step: P from registers, V through an MN-major descriptor (transposed B)
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 S_REGS, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : S_OPS
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <bool CAUSAL>
__global__ void __launch_bounds__(THREADS, 1) attention_wgmma(const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o,
    int S, float scale_log2) {
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  char* q_tile = smem;                       // 2 tiles: rows 0-63, 64-127
  char* k_tile = smem + 2 * TILE_BYTES;      // 2 slots
  char* v_tile = smem + 4 * TILE_BYTES;      // 2 slots
  const long long head = (long long)blockIdx.y * S * D;
  const int q0 = blockIdx.x * BR;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  load_tile(q_tile, q + head + (long long)q0 * D, D, S - q0);
  load_tile(q_tile + TILE_BYTES, q + head + (long long)(q0 + 64) * D, D, S - q0 - 64);
  const int kv_end = CAUSAL ? min(S, q0 + BR) : S;
  const int tiles = (kv_end + BC - 1) / BC;
  load_tile(k_tile, k + head, D, S);
  load_tile(v_tile, v + head, D, S);
  cp_async_commit();
  float acc[32], s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int my_row = q0 + wg * 64 + warp * 16 + g;  // and my_row + 8
  for (int j = 0; j < tiles; ++j) {
    if (j + 1 < tiles) {
      const int slot = (j + 1) & 1, k0 = (j + 1) * BC;
      load_tile(k_tile + slot * TILE_BYTES, k + head + (long long)k0 * D, D, S - k0);
      load_tile(v_tile + slot * TILE_BYTES, v + head + (long long)k0 * D, D, S - k0);
    }
    cp_async_commit();
    cp_async_wait<1>();
    fence_async();
    __syncthreads();
    const char* kt = k_tile + (j & 1) * TILE_BYTES;
    const char* vt = v_tile + (j & 1) * TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss(s, descriptor(q_tile + wg * TILE_BYTES, ks * 32), descriptor(kt, ks * 32), ks > 0);
    wgmma_commit();
    wgmma_wait();
    // s fragment: n8 block c holds (row g, keys 8c + 2t, +1) and (row g + 8, the same keys)
    const int key0 = j * BC;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * c + 2 * t + (e & 1), row = my_row + (e >> 1) * 8;
        float x = s[4 * c + e] * scale_log2;
        if (key >= S || (CAUSAL && key > row)) x = -INFINITY;
        s[4 * c + e] = x;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
      }
    }
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
      const float new_max = fmaxf(row_max[h], tile_max[h]);
      correction[h] = new_max == -INFINITY ? 1.0f : exp2f(row_max[h] - new_max);
      row_max[h] = new_max;
      row_sum[h] *= correction[h];
    }
    uint32_t p[4][4];  // A fragments of P for the four k16 steps over the tile's keys
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      float e4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m = row_max[e >> 1];
        e4[e] = m == -INFINITY ? 0.0f : exp2f(s[4 * c + e] - m);
        row_sum[e >> 1] += e4[e];
      }
      // k16 step c / 2: n8 block 2 (c / 2) gives a0 (row g) and a1 (row g + 8); block 2 (c / 2) + 1 gives a2, a3
      p[c / 2][(c & 1) * 2 + 0] = pack_bf16(e4[0], e4[1]);
      p[c / 2][(c & 1) * 2 + 1] = pack_bf16(e4[2], e4[3]);
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      acc[4 * c + 0] *= correction[0];
      acc[4 * c + 1] *= correction[0];
      acc[4 * c + 2] *= correction[1];
      acc[4 * c + 3] *= correction[1];
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BC / 16; ++ks) wgmma_rs(acc, p[ks], descriptor(vt, ks * 16 * 128, 1024));
    wgmma_commit();
    wgmma_wait();
    __syncthreads();  // every warpgroup is done with this slot before the next iteration's load overwrites it
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = my_row + 8 * h;
    if (row >= S) continue;
    const float inv = row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int col = 8 * c + 2 * t;
      *reinterpret_cast<uint32_t*>(o + head + (long long)row * D + col) =
          pack_bf16(acc[4 * c + 2 * h] * inv, acc[4 * c + 2 * h + 1] * inv);
    }
  }
}
}  // namespace

void run(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o, bool causal) {
  TORCH_CHECK(q.dtype() == torch::kBFloat16 && q.size(-1) == D && q.is_contiguous() && k.is_contiguous() &&
              v.is_contiguous() && o.is_contiguous(), "the probe's kernel: contiguous bf16 (B, H, S, 64)");
  const int S = q.size(2), heads = q.size(0) * q.size(1);
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  auto kernel = causal ? attention_wgmma<true> : attention_wgmma<false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  kernel<<<dim3((S + BR - 1) / BR, heads), THREADS, SMEM_BYTES, c10::cuda::getCurrentCUDAStream()>>>(
      (const __nv_bfloat16*)q.data_ptr(), (const __nv_bfloat16*)k.data_ptr(), (const __nv_bfloat16*)v.data_ptr(),
      (__nv_bfloat16*)o.data_ptr(), S, scale_log2);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}
""".replace("S_REGS", _regs(0, 32)).replace("S_OPS", _ops("d", 32))


def build():
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # wgmma needs the arch-specific target, whatever the host sets
    return load_inline("kf_wgmma_attention_probe", cpp_sources="void run(torch::Tensor q, torch::Tensor k, "
                       "torch::Tensor v, torch::Tensor o, bool causal);", cuda_sources=CUDA, functions=["run"],
                       extra_cuda_cflags=["-O3"])


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """float64 attention of the bf16 inputs."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def layout_check(ext) -> None:
    """Structured inputs that expose a wrong fragment, swizzle or descriptor: one query attending (through a large
    score) to exactly one key whose value row names it; the output row must be that value row."""
    b, h, s = 1, 1, 128
    q = torch.zeros(b, h, s, 64, device="cuda")
    k = torch.zeros(b, h, s, 64, device="cuda")
    for i in range(s):  # query i matches key (i * 37) % s only: score 64 against 0
        q[0, 0, i, i % 64] = 8.0
        k[0, 0, (i * 37) % s, i % 64] = 8.0
    v = torch.arange(s, device="cuda").float().view(1, 1, s, 1) + torch.arange(64, device="cuda") / 128.0
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    o = torch.empty_like(q)
    ext.run(q, k, v, o, False)
    want = reference(q, k, v, False)
    bad = ((o.double() - want).abs() > 0.05 * (1 + want.abs())).nonzero()
    print(f"layout check: {'ok' if len(bad) == 0 else f'{len(bad)} of {o.numel()} elements wrong'}")
    for _, _, i, d in bad[:12].tolist():
        print(f"  O[{i}][{d}] = {o[0, 0, i, d].item():.3f}, want {want[0, 0, i, d].item():.3f}")


def main() -> None:
    ext = build()
    layout_check(ext)
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, head dim 64\n")
    print("| batch, heads, seq, causal | method | ms | max abs err vs fp64 |\n|---|---|---|---|")
    for b, h, s, causal in CASES:
        probe_case(ext, b, h, s, causal)


def probe_case(ext, b: int, h: int, s: int, causal: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    want = reference(q, k, v, causal)
    o = torch.empty_like(q)
    rows = [("wgmma kernel", lambda: ext.run(q, k, v, o, causal))]
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        rows.append((name, call))
    for label, call in rows:
        try:
            out = call()
            out = o if out is None else out
            err = (out.double() - want).abs().max().item()
            print(f"| {b}, {h}, {s}, {causal} | {label} | {median_event_ms(call, 20):.4f} | {err:.2e} |", flush=True)
        except RuntimeError as e:
            print(f"| {b}, {h}, {s}, {causal} | {label} | n/a | {str(e).splitlines()[0][:80]} |")


if __name__ == "__main__":
    main()
