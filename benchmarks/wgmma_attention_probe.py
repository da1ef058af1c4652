"""A bf16 flash-attention forward on Hopper's wgmma, measured against torch's SDPA backends and float64: several
kernel structures in one GPU run, each checked (structured layout inputs and random inputs against float64) before
it is timed, to find which of FlashAttention-3's ideas close the gap to cuDNN (stop 45: 0.56-0.92x of cuDNN).

Shared by every variant (proven at stop 45): Q, K and V tiles in shared memory in the 128-byte swizzled layout (a
row of 64 bf16 is 128 bytes: 16-byte chunk c of row r at chunk c ^ (r % 8); head dim 128 is two such 64-column
atoms side by side); S = Q Kᵀ by wgmma with both operands from K-major descriptors; the online softmax on the
accumulator fragments; P back to registers as bf16 A fragments; O += P V by wgmma with V read through an MN-major
descriptor (imm-trans-b = 1). Each variant is its own translation unit, so ninja builds them in parallel.

Variants (each builds on the one above it unless said otherwise):
  base         stop 45's kernel unchanged: 128 query rows (two warpgroups), 64-key tiles, 2-deep cp.async ring,
               two block barriers and two full wgmma waits a tile, every element masked.
  k128         128-key tiles (S is one m64n128k16 chain; P V eight k16 steps): half the barriers and waits a key.
  masked       + masks only on tiles that need them (the last one, causal diagonal ones), the scale folded into
               exp2's argument (one FFMA), ex2.approx.ftz, causal query blocks longest first.
  pipelined    + FA3's intra-warpgroup overlap: tile j's S and tile j-1's P V issued together; j's softmax runs
               while P V is on the tensor cores; a 3-deep K/V ring (K two tiles ahead, V one), one barrier a tile.
  pipe-2cta    pipelined with 64-key tiles and __launch_bounds__(256, 2): two blocks a SM (64 KB shared each),
               so one block's softmax and barriers overlap the other's MMAs.
  pipe-3wg     pipelined with 192 query rows (three warpgroups, 168 registers at most).
  pipe-mbar    pipelined without the block barrier: an mbarrier a ring slot says its copies landed (cp.async's
               own arrive) and another that its readers are done (4 slots, K two ahead, V one), so the warpgroups
               drift apart and one's softmax meets the other's MMAs, as FA3's warp specialization gives.
  pipe-d128    pipelined at head dim 128 (2-deep ring, 160 KB): P V as two m64n64k16 per k16 step, one per
               64-column atom of V, so no descriptor offset beyond stop 45's proven ones.
  pipe-d128n   as pipe-d128 but P V as one m64n128k16 reading both atoms of V through the leading byte offset
               (riskiest: the one descriptor field not yet proven on the GPU).

Every variant is first checked in a child process (the layout check and ragged random cases against float64), so
that a trap or a hang costs only that variant (a new child carries on after it); variants that came back are then
timed beside SDPA.

Then FORMS: attentions through the planner, so kernelfuse's own wgmma kernel (kernelfuse.codegen.attention_wgmma)
with its head dims and masks beyond the probe's: minGPT's head dim 96 (SDPA's is_causal, and minGPT's own
masked_fill by a causal mask tensor), 80, UNet's 40, 32 (Swin's window with its per-head bias, and a long one),
BERT's 64 with a padding mask (additive, and bool). Each form's library is built once (the builds overlap), checked
in a child like the variants (the wgmma kernel ran, by its launch counter; within 3x the mma.sync kernel's error
against float64, which comes from the same plan with the wgmma switch off), then timed beside SDPA's backends on the
same semantics (a causal mask tensor as is_causal) and beside the mma.sync kernel.

Run on the GPU machine from the repo root (builds for sm_90a):
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py > $OUT/wgmma_attention_probe.md
Compile only, printing ptxas's registers and spills per kernel, the forms' generated files too (no GPU needed):
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --compile-only
The warp-specialized form's tilings (kernelfuse.codegen.attention_wgmma_ws; benchmarks/ws_attention_probe.py, which
says more), against the wgmma kernel, cuDNN and flash on the long-row and GPT-2 shapes, a short table:
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --configs ws   # or --configs ws-d64-3wg,ws-d128-pp
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F
from attention_probe import CASES as PLANNER_CASES
from attention_probe import Case
from torch.nn.attention import SDPBackend, sdpa_kernel
from variant_probe import build as build_variants
from variant_probe import checked, ident, start, template_label
from variant_probe import compile_only as report_ptxas

from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import make_plan
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.ir import AttnStep, Plan

# (batch, heads, sequence, causal): GPT-2 small's attention, a long non-causal one, a ViT-sized one, longer ones
CASES = [(8, 12, 1024, True), (4, 16, 4096, False), (64, 12, 256, False), (2, 16, 8192, False),
         (8, 16, 2048, True)]
CASES_D128 = [(8, 12, 1024, True), (4, 16, 4096, False), (8, 16, 2048, True)]
NAME = "kf_wgmma_attention_probe2"
CHILD_TIMEOUT_S = 240  # the variants' checks take ~15 s, the forms' (float64 at their full shapes) more; a hang
# (an mbarrier never completing) costs this


def _regs(first: int, count: int) -> str:
    return "{" + ", ".join(f"%{first + i}" for i in range(count)) + "}"


def _ops(name: str, count: int) -> str:
    return ", ".join(f'"+f"({name}[{i}])' for i in range(count))


# Helpers every translation unit holds (stop 45's, unchanged, then the new ones).
COMMON = r"""
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {
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
template <int N> __device__ __forceinline__ void wgmma_wait_n() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
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
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 R32, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : OPS32
      : "l"(a), "l"(b), "r"(accumulate));
}
// the same with 128 keys (m64n128): one instruction a k16 step for a 128-key tile
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 R64, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : OPS64
      : "l"(a), "l"(b), "r"(accumulate));
}
// O (m64n64, fp32) += P V over one k16 step: P from registers, V through an MN-major descriptor (transposed B)
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 R32, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : OPS32
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// O (m64n128) += P V at head dim 128 in one instruction: N spans V's two 64-column atoms (leading byte offset)
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 R64, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : OPS64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// cp.async with a source size: 0 fills the 16 bytes with zeros (rows past S), so every write to a ring slot is a
// cp.async that the slot's mbarrier tracks
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int bytes) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// arrives once this thread's earlier cp.async copies have landed (noinc: counted in the init count)
__device__ __forceinline__ void mbar_arrive_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// waits for the completion of the phase with this parity (the label is local to the braces)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// Registers an in-flight wgmma reads or writes: the empty asm pins them (the compiler may not move their uses
// across it), so uses stay after the wait and writes before the issue.
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
}  // namespace
"""

# Stop 45's kernel, unchanged (the control), with its launcher taking raw pointers.
BASE = r"""
namespace {
constexpr int D = 64, BR = 128, BC = 64, THREADS = 256;
constexpr int TILE_BYTES = 64 * 128;  // 64 rows of 128 bytes (64 bf16)
// shared memory: Q (2 tiles of 64 rows) | K[2] | V[2], every tile 1024-byte aligned for the swizzle
constexpr int SMEM_BYTES = 6 * TILE_BYTES + 1024;

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
""" + "BASE_KERNEL" + r"""
}  // namespace

int launch_base(const void* q, const void* k, const void* v, void* o, int heads, int S, int d, bool causal,
                cudaStream_t stream) {
  if (d != D) return -1;
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  auto kernel = causal ? attention_wgmma<true> : attention_wgmma<false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  kernel<<<dim3((S + BR - 1) / BR, heads), THREADS, SMEM_BYTES, stream>>>(
      (const __nv_bfloat16*)q, (const __nv_bfloat16*)k, (const __nv_bfloat16*)v, (__nv_bfloat16*)o, S, scale_log2);
  return (int)cudaGetLastError();
}
"""

_BASE_KERNEL = r"""
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
"""

# The restructured kernel; the variants are its template arguments.
V2 = r"""
namespace {
// ROWS rows x D bf16 from global (row pitch D) into swizzled atoms: atom a (head dims 64a..64a+63) is ROWS rows of
// 128 bytes, atoms ROWS * 128 bytes apart (each 1024-byte aligned since ROWS is a multiple of 8)
template <int ROWS, int D, int THREADS, bool ZFILL = false>
__device__ __forceinline__ void load_rows(char* tile, const __nv_bfloat16* src, int rows_left) {
  constexpr int CPR = D / 8, TOTAL = ROWS * CPR;
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS;
    if (TOTAL % THREADS != 0 && idx >= TOTAL) break;
    const int r = idx / CPR, cc = idx % CPR, c = cc & 7;
    char* dst = tile + (cc >> 3) * ROWS * 128 + r * 128 + ((c ^ (r & 7)) << 4);
    if constexpr (ZFILL) cp_async16_zfill(dst, r < rows_left ? src + (long long)r * D + cc * 8 : src,
                                          r < rows_left ? 16 : 0);
    else if (r < rows_left) cp_async16(dst, src + (long long)r * D + cc * 8);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// One tile's online softmax on the S fragments (n8 block c: (row g, keys 8c + 2t, +1), (row g + 8, same keys)).
// FAST: raw scores' max, then exp2(s * scale_log2 - max * scale_log2) as one FFMA and ex2.approx; MASK only where
// the caller says the tile needs it. Otherwise stop 45's form (scale, mask every element, exp2f). Leaves the
// exponentials in s, the factor for O in corr; row_sum holds this thread's partial sums (reduced at the end).
template <int NS, bool FAST, bool MASK, bool CAUSAL>
__device__ __forceinline__ void softmax_tile(float (&s)[NS], float (&row_max)[2], float (&row_sum)[2],
                                             float (&corr)[2], int key0, int my_row, int S, float scale_log2) {
  const int t = threadIdx.x % 4;
  if constexpr (FAST) {
    float m[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      if constexpr (MASK) {
        const int key = key0 + 8 * (i / 4) + 2 * t + (i & 1), row = my_row + ((i >> 1) & 1) * 8;
        if (key >= S || (CAUSAL && key > row)) s[i] = -INFINITY;
      }
      m[(i >> 1) & 1] = fmaxf(m[(i >> 1) & 1], s[i]);
    }
    float scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffff, m[h], 1));
      m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffff, m[h], 2));
      scaled[h] = m[h] == -INFINITY ? 0.0f : m[h] * scale_log2;  // a fully masked row so far: exponentials 0, no NaN
      corr[h] = ex2(fmaf(row_max[h], scale_log2, -scaled[h]));  // old max -inf: 0 (O and the sum are 0 anyway)
      row_max[h] = m[h];
      row_sum[h] *= corr[h];
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      s[i] = ex2(fmaf(s[i], scale_log2, -scaled[(i >> 1) & 1]));
      row_sum[(i >> 1) & 1] += s[i];
    }
  } else {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int key = key0 + 8 * (i / 4) + 2 * t + (i & 1), row = my_row + ((i >> 1) & 1) * 8;
      float x = s[i] * scale_log2;
      if (key >= S || (CAUSAL && key > row)) x = -INFINITY;
      s[i] = x;
      tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], x);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
      const float new_max = fmaxf(row_max[h], tile_max[h]);
      corr[h] = new_max == -INFINITY ? 1.0f : exp2f(row_max[h] - new_max);
      row_max[h] = new_max;
      row_sum[h] *= corr[h];
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const float m = row_max[(i >> 1) & 1];
      s[i] = m == -INFINITY ? 0.0f : exp2f(s[i] - m);
      row_sum[(i >> 1) & 1] += s[i];
    }
  }
}

// D: head dim (64 or 128); BR: query rows a block (64 a warpgroup); BC: keys a tile (64 or 128); STAGES: K/V ring
// depth; PIPE: FA3's intra-warpgroup overlap; FAST: see softmax_tile; MIN_BLOCKS: __launch_bounds__'s second
// argument; WIDE_PV: at D = 128, P V as one m64n128k16 a k16 step instead of two m64n64k16; MBAR: mbarriers a
// ring slot instead of the block barrier a tile (pipelined only), so the warpgroups drift apart and one's softmax
// meets the other's MMAs.
template <int D, int BR, int BC, int STAGES, bool PIPE, bool FAST, int MIN_BLOCKS, bool WIDE_PV, bool MBAR,
          bool CAUSAL>
__global__ void __launch_bounds__(BR * 2, MIN_BLOCKS) attention_v2(const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o,
    int S, float scale_log2) {
  constexpr int THREADS = BR * 2, ATOMS = D / 64, NS = BC / 2, KSTEPS = BC / 16;
  constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  // After iteration j's barrier come the copies of iteration j + STAGES - 1's K and iteration j + VAHEAD's V, into
  // slot (iteration % STAGES). Pipelined, iteration j's V is read in iteration j + 1 (P V lags S by one), so it may
  // be one less ahead; its slot (iteration j - 2's) was released by the wait at the end of iteration j - 1.
  // With MBAR each is one less ahead again (4 slots: K two ahead, V one): a slot's last readers are then two
  // (K) or three (V) iterations back, slack for a warpgroup that lags the other.
  constexpr int KAHEAD = MBAR ? STAGES - 2 : STAGES - 1;
  constexpr int VAHEAD = MBAR ? STAGES - 3 : PIPE ? STAGES - 2 : STAGES - 1;
  static_assert(STAGES >= 2 && (!MBAR || (PIPE && STAGES >= 4)), "ring");
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  char* q_tile = smem;                          // BR rows, ATOMS atoms BR * 128 bytes apart
  char* k_ring = smem + Q_BYTES;                // STAGES tiles of BC rows
  char* v_ring = k_ring + STAGES * KV_BYTES;    // STAGES tiles of BC rows
  // MBAR: a slot's copies landed (full: one arrival a thread) and its readers done (empty: one a warp)
  uint64_t* full_k = reinterpret_cast<uint64_t*>(v_ring + STAGES * KV_BYTES);
  uint64_t* full_v = full_k + STAGES;
  uint64_t* empty_k = full_v + STAGES;
  uint64_t* empty_v = empty_k + STAGES;
  if constexpr (MBAR) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < STAGES; ++i) {
        mbar_init(full_k + i, THREADS);
        mbar_init(full_v + i, THREADS);
        mbar_init(empty_k + i, THREADS / 32);
        mbar_init(empty_v + i, THREADS / 32);
      }
    }
    __syncthreads();
  }
  const long long head = (long long)blockIdx.y * S * D;
  // causal: the query blocks with the most key tiles first (FA's order), so the short ones fill the last wave
  const int qblock = (FAST && CAUSAL) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int q0 = qblock * BR;
  // the warpgroup's index broadcast from lane 0: the compiler then knows branches on it are warp-uniform (a
  // divergent-looking branch around in-flight wgmma makes ptxas serialize them)
  const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int kv_end = CAUSAL ? min(S, q0 + BR) : S;
  const int tiles = (kv_end + BC - 1) / BC;
  const int wg_row0 = q0 + wg * 64, my_row = wg_row0 + warp * 16 + g;  // and my_row + 8

  // Tiles run last to first (FA3's order), so the ones that need masks (the partial last tile; causal, those
  // reaching past the block's first row) come first and the rest run in a loop without a branch: ptxas serializes
  // wgmma when a divergent-looking branch sits between an issue and its wait. Ring slots follow the iteration.
  auto tile_of = [&](int it) { return tiles - 1 - it; };
  const int unmasked = min(tiles, FAST ? (CAUSAL ? min(S, q0 + 1) : S) / BC : 0);
  const int masked = tiles - unmasked;
  auto issue_loads = [&](int it) {  // the copies of iteration it (negative: the prologue's)
    const int ki = it + KAHEAD, vi = it + VAHEAD;
    if (ki >= 0 && ki < tiles) {
      const int kt = tile_of(ki);
      if constexpr (MBAR) {  // the slot's last readers (iteration ki - STAGES) are done
        if (ki >= STAGES) mbar_wait(empty_k + ki % STAGES, ((ki - STAGES) / STAGES) & 1);
      }
      load_rows<BC, D, THREADS, MBAR>(k_ring + (ki % STAGES) * KV_BYTES, k + head + (long long)kt * BC * D,
                                      S - kt * BC);
      if constexpr (MBAR) mbar_arrive_copies(full_k + ki % STAGES);
    }
    if (vi >= 0 && vi < tiles) {
      const int vt = tile_of(vi);
      if constexpr (MBAR) {
        if (vi >= STAGES) mbar_wait(empty_v + vi % STAGES, ((vi - STAGES) / STAGES) & 1);
      }
      load_rows<BC, D, THREADS, MBAR>(v_ring + (vi % STAGES) * KV_BYTES, v + head + (long long)vt * BC * D,
                                      S - vt * BC);
      if constexpr (MBAR) mbar_arrive_copies(full_v + vi % STAGES);
    }
  };
  // Q before the first K: that K's arrival (after all of the thread's earlier copies) covers Q too
  load_rows<BR, D, THREADS, MBAR>(q_tile, q + head + (long long)q0 * D, S - q0);
#pragma unroll
  for (int it = -KAHEAD; it < 0; ++it) {
    issue_loads(it);
    cp_async_commit();
  }

  float acc[D / 2], s[NS];
  uint32_t p[KSTEPS][4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const char* qw = q_tile + wg * 64 * 128;

  auto issue_s = [&](int it) {  // S = Q Kᵀ; k16 steps 4..7 (head dims 64..127) read each operand's second atom
    const char* kt = k_ring + (it % STAGES) * KV_BYTES;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss(s, descriptor(qw + (ks / 4) * BR * 128, (ks % 4) * 32), descriptor(kt + (ks / 4) * BC * 128,
               (ks % 4) * 32), ks > 0);
  };
  auto issue_pv = [&](int it) {  // O += P V
    const char* vt = v_ring + (it % STAGES) * KV_BYTES;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      if constexpr (ATOMS == 2 && WIDE_PV) {
        // MN-major 128-byte swizzle: N = 128 head dims are two 64-column atoms; the leading byte offset is the
        // distance between them (BC rows of 128 bytes), the stride byte offset (1024) the one between 8-key groups
        wgmma_rs(acc, p[kk], descriptor(vt, kk * 16 * 128, BC * 128));
      } else {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
          wgmma_rs(*reinterpret_cast<float(*)[32]>(acc + 32 * a), p[kk], descriptor(vt + a * BC * 128,
                   kk * 16 * 128, 1024));
      }
    }
  };
  auto rescale_and_pack = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] *= corr[(i >> 1) & 1];
    // k16 step kk: n8 block 2 kk gives a0 (row g) and a1 (row g + 8); block 2 kk + 1 gives a2, a3
#pragma unroll
    for (int c = 0; c < NS / 4; ++c) {
      p[c / 2][(c & 1) * 2 + 0] = pack_bf16(s[4 * c + 0], s[4 * c + 1]);
      p[c / 2][(c & 1) * 2 + 1] = pack_bf16(s[4 * c + 2], s[4 * c + 3]);
    }
  };
  // one iteration; MASK and FIRST (no P V to overlap yet) are compile-time so the body has no branch
  auto iteration = [&](int it, auto mask, auto first) {
    constexpr bool MASK = decltype(mask)::value, FIRST = decltype(first)::value;
    // Without MBAR, one barrier a tile: this iteration's K (and V, or the last one's V pipelined) landed for every
    // thread, and every warpgroup is past the last iteration, so the slots the copies below overwrite are free.
    // With MBAR the copies wait for their slot's readers, and S and P V for their slot's copies, and nothing else.
    if constexpr (MBAR) {
      issue_loads(it);
      // both waits before the first issue: a spin loop between two wgmma issues makes ptxas add an arrive
      mbar_wait(full_k + it % STAGES, (it / STAGES) & 1);
      if constexpr (!FIRST) mbar_wait(full_v + (it - 1) % STAGES, ((it - 1) / STAGES) & 1);
      fence_async();  // the copies (generic proxy) before wgmma's reads (async proxy)
    } else {
      cp_async_wait<STAGES - 2>();
      fence_async();
      __syncthreads();
      issue_loads(it);
      cp_async_commit();
    }
    float corr[2];
    wgmma_fence();
    issue_s(it);
    wgmma_commit();
    if constexpr (PIPE && !FIRST) {  // the last tile's P V behind this S; wait for S only
      issue_pv(it - 1);
      wgmma_commit();
      wgmma_wait_n<1>();
    } else {
      wgmma_wait_n<0>();
    }
    pin(s);
    if constexpr (MBAR) {
      if (lane == 0) mbar_arrive(empty_k + it % STAGES);
    }
    softmax_tile<NS, FAST, MASK, CAUSAL>(s, row_max, row_sum, corr, tile_of(it) * BC, my_row, S, scale_log2);
    if constexpr (PIPE) {  // the softmax above ran while P V did
      wgmma_wait_n<0>();
      pin(acc);
      pin(p);
      if constexpr (MBAR && !FIRST) {
        if (lane == 0) mbar_arrive(empty_v + (it - 1) % STAGES);
      }
    }
    rescale_and_pack(corr);
    if constexpr (!PIPE) {
      wgmma_fence();
      issue_pv(it);
      wgmma_commit();
      wgmma_wait_n<0>();
      pin(acc);
    }
  };
  using yes = std::true_type;
  using no = std::false_type;
  if (masked > 0) iteration(0, yes{}, yes{});
  else iteration(0, no{}, yes{});
  for (int it = 1; it < masked; ++it) iteration(it, yes{}, no{});
  for (int it = max(1, masked); it < tiles; ++it) iteration(it, no{}, no{});
  if constexpr (MBAR) {
    mbar_wait(full_v + (tiles - 1) % STAGES, ((tiles - 1) / STAGES) & 1);
    fence_async();
  } else if constexpr (PIPE) {
    cp_async_wait<0>();
    fence_async();
    __syncthreads();
  }
  if constexpr (PIPE) {
    wgmma_fence();
    issue_pv(tiles - 1);
    wgmma_commit();
    wgmma_wait_n<0>();
    pin(acc);
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
    for (int c = 0; c < D / 8; ++c) {
      const int col = 8 * c + 2 * t;
      *reinterpret_cast<uint32_t*>(o + head + (long long)row * D + col) =
          pack_bf16(acc[4 * c + 2 * h] * inv, acc[4 * c + 2 * h + 1] * inv);
    }
  }
}

template <int D, int BR, int BC, int STAGES, bool PIPE, bool FAST, int MIN_BLOCKS, bool WIDE_PV, bool MBAR>
int launch(const void* q, const void* k, const void* v, void* o, int heads, int S, int d, bool causal,
           cudaStream_t stream) {
  if (d != D) return -1;
  constexpr int SMEM = BR * D * 2 + 2 * STAGES * BC * D * 2 + 1024 + 4 * STAGES * 8;  // + the mbarriers
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  auto kernel = causal ? attention_v2<D, BR, BC, STAGES, PIPE, FAST, MIN_BLOCKS, WIDE_PV, MBAR, true>
                       : attention_v2<D, BR, BC, STAGES, PIPE, FAST, MIN_BLOCKS, WIDE_PV, MBAR, false>;
  static bool attributes_set = false;  // once per kernel pair (the probe calls from one thread)
  if (!attributes_set) {
    cudaFuncSetAttribute(attention_v2<D, BR, BC, STAGES, PIPE, FAST, MIN_BLOCKS, WIDE_PV, MBAR, true>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    cudaFuncSetAttribute(attention_v2<D, BR, BC, STAGES, PIPE, FAST, MIN_BLOCKS, WIDE_PV, MBAR, false>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    attributes_set = true;
  }
  kernel<<<dim3((S + BR - 1) / BR, heads), BR * 2, SMEM, stream>>>(
      (const __nv_bfloat16*)q, (const __nv_bfloat16*)k, (const __nv_bfloat16*)v, (__nv_bfloat16*)o, S, scale_log2);
  return (int)cudaGetLastError();
}
}  // namespace

int launch_VARIANT(const void* q, const void* k, const void* v, void* o, int heads, int S, int d, bool causal,
                   cudaStream_t stream) {
  return launch<ARGS>(q, k, v, o, heads, S, d, causal, stream);
}
"""


CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

using Launch = int (*)(const void*, const void*, const void*, void*, int, int, int, bool, cudaStream_t);
DECLS
static const Launch LAUNCHES[] = {TABLE};

void run(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o, bool causal, int64_t variant) {
  TORCH_CHECK(q.dtype() == torch::kBFloat16 && q.dim() == 4 && q.is_contiguous() && k.is_contiguous() &&
              v.is_contiguous() && o.is_contiguous() && k.sizes() == q.sizes() && v.sizes() == q.sizes() &&
              o.sizes() == q.sizes(), "the probe's kernels: contiguous bf16 (B, H, S, D)");
  TORCH_CHECK(variant >= 0 && variant < (int64_t)(sizeof(LAUNCHES) / sizeof(LAUNCHES[0])), "no such variant");
  const int rc = LAUNCHES[variant](q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), q.size(0) * q.size(1),
                                   q.size(2), q.size(3), causal, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc != -1, "this variant is not built for head dim ", q.size(3));
  TORCH_CHECK(rc == 0, "launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
"""

# name, head dim, attention_v2's template arguments <D, BR, BC, STAGES, PIPE, FAST, MIN_BLOCKS, WIDE_PV, MBAR> (None:
# stop 45's kernel); safest first, since a trap ends the process's CUDA context
VARIANTS = [
    ("base", 64, None),
    ("k128", 64, "64, 128, 128, 2, false, false, 1, false, false"),
    ("masked", 64, "64, 128, 128, 2, false, true, 1, false, false"),
    ("pipelined", 64, "64, 128, 128, 3, true, true, 1, false, false"),
    ("pipe-2cta", 64, "64, 128, 64, 3, true, true, 2, false, false"),
    ("pipe-3wg", 64, "64, 192, 128, 3, true, true, 1, false, false"),
    ("pipe-mbar", 64, "64, 128, 128, 4, true, true, 1, false, true"),
    ("pipe-d128", 128, "128, 128, 128, 2, true, true, 1, false, false"),
    ("pipe-d128n", 128, "128, 128, 128, 2, true, true, 1, true, false"),
]


def sources() -> dict[str, str]:
    """File name -> text: the binding and one CUDA translation unit a variant."""
    common = (COMMON.replace("R32", _regs(0, 32)).replace("OPS32", _ops("d", 32))
              .replace("R64", _regs(0, 64)).replace("OPS64", _ops("d", 64)))
    base_kernel = _BASE_KERNEL
    files = {}
    for name, _, args in VARIANTS:
        if args is None:
            text = common + BASE.replace("BASE_KERNEL", base_kernel)
        else:
            text = common + V2.replace("launch_VARIANT", f"launch_{ident(name)}").replace("ARGS", args)
        files[f"attn_{ident(name)}.cu"] = text
    decls = "\n".join(f"int launch_{ident(n)}(const void*, const void*, const void*, void*, int, int, int, bool, "
                      "cudaStream_t);" for n, _, _ in VARIANTS)
    table = ", ".join(f"launch_{ident(n)}" for n, _, _ in VARIANTS)
    files["binding.cpp"] = CPP.replace("DECLS", decls).replace("TABLE", table)
    return files


def shape_of(name: str) -> Case:
    """attention_probe's case `name` (its batch, heads, sequence, head dim and mask)."""
    return next(case for case in PLANNER_CASES if case.name == name)


# Attentions through the planner, as attention_probe's Case with more masks: "none"; "causal" (SDPA's is_causal);
# "tril" (minGPT's masked_fill by its lower-triangular buffer, `bias[:, :, :S, :S] == 0`: the planner's causal guard
# runs it as causal once the binding has checked the mask); "tril-input" (the same mask handed in as an input: the
# masked kernel, MASK 2, as every minGPT form ran before the guard); "add" (a per-head additive mask, Swin's); "pad-add"
# and "pad-keep" (BERT's padding (B, 1, 1, L), additive 0 or bf16's lowest as transformers fills it, or bool; batch
# b's keys valid up to S / 2 + b S / 2B). attention_probe's shapes where it has them, a long d32, a d80, BERT-base.
FORMS = [
    replace(shape_of("L3-44 minGPT"), name="minGPT d96 causal"),
    replace(shape_of("L3-44 minGPT"), name="minGPT d96 masked_fill", mask="tril"),
    replace(shape_of("L3-44 minGPT"), name="minGPT d96 masked_fill input mask", mask="tril-input"),
    Case("d80 causal", 8, 16, 1024, 80, "causal"),
    replace(shape_of("UNet self-attn"), name="UNet d40"),
    Case("d32", 8, 16, 1024, 32, "none"),
    replace(shape_of("L3-30 Swin window"), name="Swin window d32 bias"),
    Case("BERT d64 padding add", 16, 12, 512, 64, "pad-add"),
    Case("BERT d64 padding bool", 16, 12, 512, 64, "pad-keep"),
]


def is_causal(form: Case) -> bool:
    return form.mask in ("causal", "tril", "tril-input")


class FormModel(torch.nn.Module):
    """One form's attention (its source names scaled_dot_product_attention: capture keeps the call whole)."""

    def __init__(self, mask: str, seq: int = 0) -> None:
        super().__init__()
        self.mask = mask
        if mask == "tril":  # minGPT's buffer
            self.register_buffer("bias", causal_buffer(seq, "cpu"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        if self.mask in ("tril", "tril-input"):
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            s = q.shape[-2]
            drop = self.bias[:, :, :s, :s] == 0 if self.mask == "tril" else mask[0]
            return torch.softmax(att.masked_fill(drop, float("-inf")), dim=-1) @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None,
                                              is_causal=self.mask == "causal")


def causal_buffer(seq: int, device: str) -> torch.Tensor:
    """minGPT's `bias` buffer: lower-triangular ones, (1, 1, seq, seq)."""
    return torch.tril(torch.ones(seq, seq, device=device)).view(1, 1, seq, seq)


def form_inputs(form: Case, device: str) -> list[torch.Tensor]:
    """q, k, v (bf16, (B, H, S, D)) and the form's mask on `device` ("meta": shapes and dtypes for the capture)."""
    b, h, s, d = form.batch, form.heads, form.seq, form.dim
    g = torch.Generator().manual_seed(0)

    def make(shape: tuple[int, ...], dtype: torch.dtype, fill) -> torch.Tensor:  # noqa: ANN001 - a tensor maker
        return torch.empty(shape, dtype=dtype, device="meta") if device == "meta" else fill().to(device, dtype)

    tensors = [make((b, h, s, d), torch.bfloat16, lambda: torch.randn(b, h, s, d, generator=g)) for _ in range(3)]
    valid = torch.arange(s) < (s // 2 + torch.arange(b) * s // (2 * b)).view(b, 1, 1, 1)
    if form.mask == "tril-input":
        tensors.append(make((s, s), torch.bool, lambda: torch.ones(s, s, dtype=torch.bool).triu(1)))
    elif form.mask == "add":
        tensors.append(make((h, s, s), torch.bfloat16, lambda: torch.randn(h, s, s, generator=g)))
    elif form.mask == "pad-add":
        low = torch.finfo(torch.bfloat16).min
        tensors.append(make((b, 1, 1, s), torch.bfloat16, lambda: torch.zeros(b, 1, 1, s).masked_fill(~valid, low)))
    elif form.mask == "pad-keep":
        tensors.append(make((b, 1, 1, s), torch.bool, lambda: valid))
    return tensors


def form_plan(form: Case) -> Plan:
    plan = make_plan(capture_module(FormModel(form.mask, form.seq), form_inputs(form, "meta")))
    assert len(plan.attention) == 1 and not plan.generated, plan.summary()
    assert (plan.attention[0].causal_guard is not None) == (form.mask == "tril"), plan.summary()
    return plan


def step_inputs(form: Case, tensors: list[torch.Tensor]) -> list:
    """What the step's kernel takes: the graph's inputs, kᵀ for minGPT's forms (its q @ kᵀ reads the transpose);
    for "tril" the mask its forward computes from the buffer, and the buffer (the binding checks the mask causal
    once per version of it, then runs the causal kernel)."""
    q, k, v, *mask = tensors
    if form.mask == "tril":
        bias = causal_buffer(form.seq, q.device.type)
        s = form.seq
        return [q, k.transpose(-2, -1), v, bias[:, :, :s, :s] == 0, (bias,)]
    return [q, k.transpose(-2, -1) if form.mask == "tril-input" else k, v, *mask]


def build():  # noqa: ANN201 - torch's extension module, the forms' libraries
    """The variants' extension, and each form's (library, attention step), the forms' builds overlapping."""
    plans = [form_plan(form) for form in FORMS]
    with ThreadPoolExecutor(len(FORMS)) as pool:
        libraries = list(pool.map(lambda i: load_kernels(generate(plans[i]), f"{NAME}_form{i}"), range(len(FORMS))))
    return build_variants(NAME, sources()), [(lib, plan.attention[0]) for lib, plan in zip(libraries, plans,
                                                                                           strict=True)]


def compile_only() -> None:
    files = {**sources(), **{f"form_{i}.cu": generate(form_plan(form)).cuda for i, form in enumerate(FORMS)}}
    variant = template_label(r"Li(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb(\d)ELb(\d)ELi(\d)ELb(\d)ELb(\d)ELb(\d)E",
                             r"<D\1 BR\2 BC\3 ST\4 pipe\5 fast\6 min\7 wide\8 mbar\9 causal\10>")
    wgmma = template_label(r"kf_attention_wgmma_kernelI(\w)Li(\d+)ELi(\d)ELb(\d)ELb(\d)E",
                           r"kf_attention_wgmma_kernel<M \1, D \2, MASK \3, causal \4, empty_nan \5>")
    report_ptxas(NAME, files, lambda mangled: wgmma(variant(mangled)))


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """float64 attention of the bf16 inputs, a few heads at a time (an 8192-key score matrix is 0.5 GB a head)."""
    b, h, n, d = q.shape
    qf, kf, vf = (t.reshape(b * h, n, d) for t in (q, k, v))
    out = torch.empty(b * h, n, d, dtype=torch.float64, device=q.device)
    step = max(1, (4 << 30) // (n * n * 8))
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    for i in range(0, b * h, step):
        s = (qf[i:i + step].double() @ kf[i:i + step].double().transpose(-1, -2)) / math.sqrt(d)
        if causal:
            s = s.masked_fill(mask, float("-inf"))
        out[i:i + step] = torch.softmax(s, -1) @ vf[i:i + step].double()
    return out.view(b, h, n, d)


def layout_check(ext, variant: int, d: int) -> bool:
    """Structured inputs that expose a wrong fragment, swizzle, descriptor or ring slot: query i and key (37 i) % s
    share a two-hot pattern (head dims i % (d/2) and d/2 + (i / (d/2)) % (d/2)), unique for s <= (d/2)², so each
    query attends (through a large score) to one key; V rows are distinct patterns in [-16, 16) exact in bf16.
    384 rows: three 128-key tiles (the ring wraps), two or three query blocks."""
    s, half = 384, d // 2
    q = torch.zeros(1, 1, s, d, device="cuda")
    k = torch.zeros(1, 1, s, d, device="cuda")
    for i in range(s):
        key = (i * 37) % s
        for col in (i % half, half + (i // half) % half):
            q[0, 0, i, col] = 8.0
            k[0, 0, key, col] = 8.0
    m = torch.arange(s, device="cuda").view(s, 1)
    v = (((m * 13 + torch.arange(d, device="cuda") * 7) % 127) / 4.0 - 16.0).view(1, 1, s, d)  # 127: no period 64
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    o = torch.zeros_like(q)
    ext.run(q, k, v, o, False, variant)
    want = reference(q, k, v, False)
    bad = ((o.double() - want).abs() > 0.02 * (1 + want.abs())).nonzero()
    print(f"  layout check (d {d}): {'ok' if len(bad) == 0 else f'{len(bad)} of {o.numel()} elements wrong'}")
    for _, _, i, c in bad[:8].tolist():
        print(f"    O[{i}][{c}] = {o[0, 0, i, c].item():.3f}, want {want[0, 0, i, c].item():.3f}")
    return len(bad) == 0


def random_check(ext, variant: int, d: int) -> bool:
    """Ragged sequences (partial tiles, padding rows, empty warpgroups) against float64, causal and not."""
    ok = True
    # 1100 keys: nine 128-key tiles, so every ring (and pipe-mbar's barrier phases) wraps more than twice
    for b, h, s, causal in ((1, 2, 300, False), (1, 2, 300, True), (2, 3, 520, True), (1, 1, 64, False),
                            (1, 2, 1100, False)):
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        want = reference(q, k, v, causal)
        o = torch.zeros_like(q)
        ext.run(q, k, v, o, causal, variant)
        torch.cuda.synchronize()
        err = (o.double() - want).abs().max().item()
        sdpa = (F.scaled_dot_product_attention(q, k, v, is_causal=causal).double() - want).abs().max().item()
        good = err <= 3 * sdpa + 1e-3
        ok &= good
        print(f"  ({b}, {h}, {s}, {causal}): max abs err {err:.2e} (sdpa {sdpa:.2e}){'' if good else ' WRONG'}")
    return ok


def wgmma_launches(lib) -> int:  # noqa: ANN001 - the form's loaded library
    lib._lib.kf_attention_wgmma_launches.restype = ctypes.c_longlong
    return lib._lib.kf_attention_wgmma_launches()


def form_outputs(lib, step: AttnStep, args: list[torch.Tensor], wgmma: bool) -> torch.Tensor:  # noqa: ANN001
    """The form's kernel on `args`, the wgmma switch as the loader set it (on where it built for sm_90a and the
    device is 9.0) or off for the call; the launch counter says which kernel ran."""
    if not wgmma:
        lib._allow_wgmma(False)
    try:
        before = wgmma_launches(lib)
        out = getattr(lib, step.kernel)(*args)
        torch.cuda.synchronize()
        if wgmma_launches(lib) - before != int(wgmma):
            raise RuntimeError("the wgmma kernel did not run" if wgmma else "the wgmma kernel ran")
        return out
    finally:
        if not wgmma:  # the loader's setting again: on, since the wgmma call came first and ran
            lib._allow_wgmma(True)


def form_check(lib, step: AttnStep, form: Case) -> bool:  # noqa: ANN001 - the form's loaded library
    """The wgmma kernel ran and is within 3x the mma.sync kernel's error against float64, NaN where it is."""
    args = step_inputs(form, form_inputs(form, "cuda"))
    want = attention_reference(step, *(a.double() for a in args[:3]), args[3] if len(args) > 3 else None)
    errors = []
    for wgmma in (True, False):
        try:
            got = form_outputs(lib, step, args, wgmma).double()
        except RuntimeError as e:
            print(f"  {str(e).splitlines()[0][:160]}")
            return False
        if not torch.equal(got.isnan(), want.isnan()):
            print(f"  {'wgmma' if wgmma else 'mma.sync'}: NaN where float64 has none, or the reverse")
            return False
        errors.append((got - want).abs().nan_to_num(0.0).max().item())
    good = errors[0] <= 3 * errors[1] + 1e-3
    print(f"  max abs err {errors[0]:.2e} (mma.sync {errors[1]:.2e}){'' if good else ' WRONG'}")
    if step.causal_guard is not None:  # the binding's cached verdict: the causal kernel ran
        causal = [entry[2] for key, entry in lib._causal_masks.items() if key[0] == step.kernel]
        print(f"  the mask checked causal: {causal == [True]}")
        good &= causal == [True]
    return good


def child_check(first: int) -> None:
    """The checks of variants first.. in order (safest first), then of the forms, each followed by the marker."""
    ext, forms = build()
    for index in range(first, len(VARIANTS) + len(FORMS)):
        if index < len(VARIANTS):
            name, d, _ = VARIANTS[index]
            print(f"{name} (d {d}):", flush=True)
            ok = layout_check(ext, index, d)
            ok &= random_check(ext, index, d)
        else:
            form = FORMS[index - len(VARIANTS)]
            name = f"form {form.name}"
            print(f"{name} {(form.batch, form.heads, form.seq, form.dim)}:", flush=True)
            ok = form_check(*forms[index - len(VARIANTS)], form)
        print(f"  {name}: {'passed' if ok else 'FAILED'}\n{checked(index)}", flush=True)


def tflops(b: int, h: int, s: int, d: int, causal: bool, ms: float) -> float:
    return 4 * b * h * s * s * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


def probe_case(ext, alive: list[int], b: int, h: int, s: int, causal: bool, d: int) -> None:
    from kernelfuse.bench.timer import median_event_ms

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    want = reference(q, k, v, causal)
    o = torch.empty_like(q)
    rows = []
    # cuDNN first: its time and error are the ratio's and the WRONG flag's references for the rows below
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        rows.append((name, "-", call))
    for index in alive:
        if VARIANTS[index][1] == d:
            rows.append(("wgmma kernel", VARIANTS[index][0], lambda index=index: ext.run(q, k, v, o, causal, index)))
    cudnn_ms = ref_err = None
    case = f"{b}, {h}, {s}, {causal}, {d}"
    for method, variant, call in rows:
        try:
            o.zero_()
            out = call()
            out = o if out is None else out
            err = (out.double() - want).abs().max().item()
            ms = median_event_ms(call, 20)
            if method == "sdpa cudnn":
                cudnn_ms = ms
            if method.startswith("sdpa") and ref_err is None:  # cuDNN's, or flash's where cuDNN did not run
                ref_err = err
            flag = " WRONG" if ref_err is not None and err > 3 * ref_err + 1e-3 else ""
            ratio = f"{cudnn_ms / ms:.3f}" if cudnn_ms else "-"
            print(f"| {case} | {method} | {variant} | {ms:.4f} | {tflops(b, h, s, d, causal, ms):.0f} | {ratio} | "
                  f"{err:.2e}{flag} |", flush=True)
        except RuntimeError as e:
            print(f"| {case} | {method} | {variant} | n/a | | | {str(e).splitlines()[0][:80]} |", flush=True)


def probe_form(lib, step: AttnStep, form: Case) -> None:  # noqa: ANN001 - the form's loaded library
    """SDPA's backends on the form's semantics (a causal mask tensor as is_causal), then kernelfuse's kernel with and
    without the wgmma switch; ratio = the fastest SDPA backend's ms / this ms."""
    from kernelfuse.bench.timer import median_event_ms

    q, k, v, *mask = tensors = form_inputs(form, "cuda")
    args = step_inputs(form, tensors)
    want = attention_reference(step, *(a.double() for a in args[:3]), args[3] if len(args) > 3 else None)
    sdpa_mask = mask[0] if form.mask in ("add", "pad-add", "pad-keep") else None
    rows = []
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, is_causal=is_causal(form))
        rows.append((name, call))
    rows += [(label, lambda: getattr(lib, step.kernel)(*args)) for label in ("kernelfuse wgmma", "kernelfuse mma.sync")]
    best = None
    case = f"{form.name} ({form.batch}, {form.heads}, {form.seq}, {form.dim})"
    for method, call in rows:
        off = method == "kernelfuse mma.sync"  # the form's check showed the loader's switch on and each kernel run
        if off:
            lib._allow_wgmma(False)
        try:
            err = (call().double() - want).abs().nan_to_num(0.0).max().item()
            ms = median_event_ms(call, 20)
        except RuntimeError as e:
            print(f"| {case} | {method} | n/a | | | {str(e).splitlines()[0][:80]} |", flush=True)
            continue
        finally:
            if off:
                lib._allow_wgmma(True)
        if method.startswith("sdpa"):
            best = ms if best is None else min(best, ms)
        ratio = f"{best / ms:.3f}" if best else "-"
        flops = tflops(form.batch, form.heads, form.seq, form.dim, is_causal(form), ms)
        print(f"| {case} | {method} | {ms:.4f} | {flops:.0f} | {ratio} | {err:.2e} |", flush=True)


def main() -> None:
    if any(a == "--configs" or a.startswith("--configs=") for a in sys.argv[1:]):  # the warp-specialized form's
        from ws_attention_probe import main as ws_main  # configs (benchmarks/ws_attention_probe.py)

        ws_main(sys.argv[1:])
        return
    names = [v[0] for v in VARIANTS] + [f"form {f.name}" for f in FORMS]
    started = start(__file__, names, CHILD_TIMEOUT_S, build, compile_only, child_check)
    if started is None:
        return
    _, (ext, forms), alive = started
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16. ratio = cuDNN's ms / this ms "
          "(the goal: >= 0.9); TFLOP/s counts 4 B H S² D, halved for causal\n")
    print("| batch, heads, seq, causal, d | method | variant | ms | TFLOP/s | ratio | max abs err vs fp64 |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    t0 = time.time()
    variants = [i for i in alive if i < len(VARIANTS)]
    for b, h, s, causal in CASES:
        probe_case(ext, variants, b, h, s, causal, 64)
    for b, h, s, causal in CASES_D128:
        probe_case(ext, variants, b, h, s, causal, 128)
    print("\nThrough the planner (kernelfuse.codegen.attention_wgmma); ratio = the fastest SDPA backend's ms / this ms;"
          " TFLOP/s counts every key (padding too), halved for causal\n")
    print("| form (B, H, S, D) | method | ms | TFLOP/s | ratio | max abs err vs fp64 |\n|---|---|---|---|---|---|")
    for i, form in enumerate(FORMS):
        if len(VARIANTS) + i in alive:
            probe_form(*forms[i], form)
    print(f"\ntimed cases: {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
