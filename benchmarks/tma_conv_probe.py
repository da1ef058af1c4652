"""A TF32 3x3 convolution forward on Hopper with TMA im2col loads and wgmma, measured against cuDNN's channels-last
kernel: whether hardware-generated gather addresses close stop 47's gap (our gathers were issue-bound) and whether
a ping-pong schedule hides the bias + mish(mish(.)) epilogue that cost CUTLASS 4.2x its bare kernel (stop 43).

Shared by every variant: fp32 NHWC input (C a multiple of 32), weights reordered once to (K, R, S, C), no padding,
stride 1. The GEMM is M = N P Q output pixels x N = K output channels x K = R S C, in k blocks of 32 channels of
one tap (r, s). Per k block one TMA im2col load (`cuTensorMapEncodeIm2col`, 4-d, coordinates {c, w, h, n} of the
tile's first pixel, offsets {s, r}) brings BM pixels x 32 channels, and one tiled TMA load brings BN weight rows x
32; both land 128-byte swizzled (a row of 32 fp32 is 128 bytes), the K-major layout wgmma's descriptors read
(kernelfuse.codegen.gemm_wgmma's swz128 and desc). A ring of STAGES slots, each with a full mbarrier (the
producer's expect_tx, the copies' complete_tx) and an empty one (one arrive per consumer warp once its wgmma
reading the slot completed). One producer thread (warpgroup 0) issues the copies; consumer warpgroups issue
wgmma.m64nBNk8.tf32 (fp32 accumulators), both operands from shared memory. Blocks are persistent (one a SM).
wgmma reads a TF32 operand's top 19 bits: the inputs are truncated, not rounded (cuDNN rounds); no rounding pass.

Variants (safest first: a trap ends the CUDA context, so each is checked in a child process):
  1wg-128     one consumer warpgroup, 128 x BN tile (two m64 products a k step), 4 stages
  coop-128    two consumer warpgroups, 64 rows each of one 128 x BN tile, 4 stages
  coop-256    two consumer warpgroups, 128 rows each of one 256 x BN tile (one 256-pixel im2col box), 4 stages
  pp-64       ping-pong: two consumer warpgroups on alternate 64 x BN tiles, an mbarrier turn between them so one's
              main loop runs while the other's epilogue does, 6 stages
  pp-128      ping-pong on 128 x BN tiles (128 accumulators a thread), 5 stages
BN = 128 where K is a multiple of 128, else 64. Epilogues (a runtime switch): bare NHWC store, bias + mish(mish(.))
NHWC, and both again storing NCHW (the layout the problems return), all from the accumulator registers.

Run on the GPU machine from the repo root (builds for sm_90a; ~3 minutes):
    PYTHONPATH=. python benchmarks/tma_conv_probe.py > $OUT/tma_conv_probe.md
Compile only, printing ptxas's registers and spills per kernel (no GPU needed):
    PYTHONPATH=. python benchmarks/tma_conv_probe.py --compile-only
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from variant_probe import build as build_variants
from variant_probe import checked, ident, start, template_label
from variant_probe import compile_only as report_ptxas

# (name, N, C, H, W, K) of KernelBench level 2 (3x3, no padding, stride 1; the shapes cutlass_conv_probe.py ran)
SHAPES = [("54", 64, 64, 256, 256, 64), ("4", 64, 64, 256, 256, 128), ("46", 128, 64, 128, 128, 128),
          ("52", 64, 64, 128, 128, 128)]
NAME = "kf_tma_conv_probe"
CHILD_TIMEOUT_S = 90  # checks of all variants ~20 s; a hang (an mbarrier never completing) costs this
DEVICE = "cuda"
EPILOGUES = {0: "bare NHWC", 1: "bias+mish2 NHWC", 2: "bare NCHW", 3: "bias+mish2 NCHW"}


def _regs(count: int) -> str:
    return "{" + ", ".join(f"%{i}" for i in range(count)) + "}"


def _ops(count: int) -> str:
    return ", ".join(f'"+f"(d[{i}])' for i in range(count))


COMMON = r"""
#include <cuda.h>  // CUtensorMap and its enums only: the encoders come through cudaGetDriverEntryPointByVersion
#include <cuda_runtime.h>
#include <stdint.h>

namespace {
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// the producer's arrive, announcing the bytes the slot's copies will complete
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// BM pixels from (n, h, w) on (the box walks w, then h, then n) x 32 channels from c, each pixel shifted by the
// tap (dw, dh): coordinates innermost first, offsets in the same order (W, then H)
__device__ __forceinline__ void tma_im2col(void* dst, const CUtensorMap* map, uint64_t* bar, int c, int w, int h,
                                           int n, unsigned short dw, unsigned short dh) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], {%7, %8};\n" ::"r"(smem_u32(dst)), "l"((uint64_t)map),
      "r"(smem_u32(bar)), "r"(c), "r"(w), "r"(h), "r"(n), "h"(dw), "h"(dh)
      : "memory");
}
__device__ __forceinline__ void tma_tile2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(smem_u32(bar)), "r"(c0),
      "r"(c1)
      : "memory");
}
// wgmma's descriptor of a 128-byte-swizzled K-major tile (1024-byte aligned), k step ks (8 fp32 = 32 bytes)
__device__ __forceinline__ uint64_t desc(const unsigned char* tile, int ks) {
  const uint64_t addr = smem_u32(tile) + ks * 32;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 R64, %64, %65, p, 1, 1;\n}\n"
      : OPS64
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void mma(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 R32, %32, %33, p, 1, 1;\n}\n"
      : OPS32
      : "l"(a), "l"(b), "r"(accumulate));
}
// mish(x) = x tanh(softplus(x)) = x n / (n + 2), n = e (e + 2), e = exp(x) (kernelfuse's identity); x past 20: x
__device__ __forceinline__ float mish(float x) {
  const float e = __expf(x), n = e * (e + 2.0f);
  return x > 20.0f ? x : x * __fdividef(n, n + 2.0f);
}

template <int BN, int WG_M, int CONS, bool PP, int STAGES> struct Cfg {
  static constexpr int MI = WG_M / 64;                 // m64 products a consumer warpgroup issues a k step
  static constexpr int BM = PP ? WG_M : WG_M * CONS;   // pixels of a block tile (one im2col box)
  static constexpr int A_BYTES = BM * 128, STAGE_BYTES = (BM + BN) * 128;
  static constexpr int THREADS = 128 * (CONS + 1);
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024 + 8 * (2 * STAGES + 2);
  static_assert(A_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "tiles on the swizzle's 1024-byte atoms");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

// this warpgroup's accumulators to memory: fragment of m64nBN product mi: n8 block j holds (row, cols 8j + 2t,
// +1) and (row + 8, the same); MODE bit 0: + bias, mish(mish(.)); bit 1: NCHW, else NHWC
template <int MODE, int MI, int BN>
__device__ __forceinline__ void epilogue(float (&acc)[MI][BN / 2], float* __restrict__ out,
                                         const float* __restrict__ bias, int m_first, int k0, int M, int PQ, int K) {
  const int lane = threadIdx.x % 32, row = threadIdx.x % 128 / 32 * 16 + lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m_first + mi * 64 + row + 8 * h;
      if (m >= M) continue;
      const long long img = m / PQ, pq = m % PQ;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int k = k0 + 8 * j + 2 * t;
        float v0 = acc[mi][4 * j + 2 * h], v1 = acc[mi][4 * j + 2 * h + 1];
        if (MODE & 1) {
          const float2 b = *reinterpret_cast<const float2*>(bias + k);
          v0 = mish(mish(v0 + b.x));
          v1 = mish(mish(v1 + b.y));
        }
        if (MODE & 2) {
          float* o = out + (img * K + k) * PQ + pq;
          o[0] = v0;
          o[PQ] = v1;
        } else {
          *reinterpret_cast<float2*>(out + (long long)m * K + k) = make_float2(v0, v1);
        }
      }
    }
}

template <int BN, int WG_M, int CONS, bool PP, int STAGES>
__global__ void __launch_bounds__(128 * (CONS + 1), 1)
    conv_tma(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
             float* __restrict__ out, const float* __restrict__ bias, int M, int PQ, int Q, int K, int KT, int CB,
             int S, int tiles_n, int tiles, int epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = Cfg<BN, WG_M, CONS, PP, STAGES>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * G::STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  uint64_t* turn = empty + STAGES;  // ping-pong: consumer c may start its next main loop once turn[c] completes
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], PP ? 4 : 4 * CONS);  // every consumer warp reading the slot arrives
    }
    mbar_init(&turn[0], 4);
    mbar_init(&turn[1], 4);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int my_tiles = tiles > (int)blockIdx.x ? (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
  if (wg == 0) {  // producer: one thread issues every copy, the ring's slots in order over the block's tiles
    if (CONS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      unsigned it = 0;
      for (int i = 0; i < my_tiles; ++i) {
        const int tile = blockIdx.x + i * gridDim.x, tm = tile / tiles_n, tn = tile % tiles_n;
        const int m0 = tm * G::BM, img = m0 / PQ, pq = m0 % PQ, p = pq / Q, q = pq % Q;
        for (int kb = 0; kb < KT; ++kb, ++it) {
          const int slot = it % STAGES;
          mbar_wait(&empty[slot], ((it / STAGES) & 1) ^ 1);  // a fresh barrier passes parity 1 at once
          unsigned char* a = smem + slot * G::STAGE_BYTES;
          mbar_expect_tx(&full[slot], G::STAGE_BYTES);
          const int rs = kb / CB, cb = kb % CB;
          tma_im2col(a, &tmap_x, &full[slot], cb * 32, q, p, img, (unsigned short)(rs % S), (unsigned short)(rs / S));
          tma_tile2d(a + G::A_BYTES, &tmap_w, &full[slot], kb * 32, tn * BN);
        }
      }
    }
  } else {
    if (CONS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, row_off = PP ? 0 : cw * WG_M;
    float acc[G::MI][BN / 2];
    for (int i = PP ? cw : 0, j = 0; i < my_tiles; i += PP ? 2 : 1, ++j) {
      if (PP && (cw == 1 || j > 0)) mbar_wait(&turn[cw], cw == 1 ? (j & 1) : ((j - 1) & 1));
      const unsigned it0 = (unsigned)i * KT;
      for (int kb = 0; kb < KT; ++kb) {
        const unsigned it = it0 + kb;
        const int slot = it % STAGES;
        mbar_wait(&full[slot], (it / STAGES) & 1);
        // ping-pong: every copy of this tile landed, so the other consumer's next ring lap cannot alias a phase
        if (PP && kb == KT - 1 && lane == 0) mbar_arrive(&turn[cw ^ 1]);
        const unsigned char* a = smem + slot * G::STAGE_BYTES + row_off * 128;
        const unsigned char* b = smem + slot * G::STAGE_BYTES + G::A_BYTES;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
#pragma unroll
          for (int mi = 0; mi < G::MI; ++mi) mma(acc[mi], desc(a + mi * 64 * 128, ks), desc(b, ks), kb | ks);
        wg_commit();
        wg_wait<1>();  // the previous slot's products are done: hand it back
        if (kb > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % STAGES]);
      }
      wg_wait<0>();
      if (lane == 0) mbar_arrive(&empty[(it0 + KT - 1) % STAGES]);
      const int tile = blockIdx.x + i * gridDim.x, tm = tile / tiles_n, tn = tile % tiles_n;
      const int m_first = tm * G::BM + row_off, k0 = tn * BN;
      switch (epi) {
        case 0: epilogue<0, G::MI, BN>(acc, out, bias, m_first, k0, M, PQ, K); break;
        case 1: epilogue<1, G::MI, BN>(acc, out, bias, m_first, k0, M, PQ, K); break;
        case 2: epilogue<2, G::MI, BN>(acc, out, bias, m_first, k0, M, PQ, K); break;
        default: epilogue<3, G::MI, BN>(acc, out, bias, m_first, k0, M, PQ, K); break;
      }
    }
  }
#endif
}

using EncodeIm2col = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const int*, const int*, cuuint32_t, cuuint32_t,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
void* driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return fn;
}

// x: NHWC (N, H, W, C); w: (K, R, S, C); out: NHWC or NCHW by epi's bit 1. Returns 0 or an error code.
template <int BN, int WG_M, int CONS, bool PP, int STAGES>
int launch(const float* x, const float* w, const float* bias, float* out, int N, int H, int W, int C, int K, int R,
           int S, int epi, cudaStream_t stream) {
  using G = Cfg<BN, WG_M, CONS, PP, STAGES>;
  if (C % 32 != 0 || K % BN != 0 || H < R || W < S) return -1;
  static const EncodeIm2col encode_im2col = (EncodeIm2col)driver_fn("cuTensorMapEncodeIm2col");
  static const EncodeTiled encode_tiled = (EncodeTiled)driver_fn("cuTensorMapEncodeTiled");
  if (!encode_im2col || !encode_tiled) return -2;
  const int P = H - R + 1, Q = W - S + 1, M = N * P * Q;
  CUtensorMap tx, tw;
  const cuuint64_t xdims[4] = {(cuuint64_t)C, (cuuint64_t)W, (cuuint64_t)H, (cuuint64_t)N};
  const cuuint64_t xstrides[3] = {(cuuint64_t)C * 4, (cuuint64_t)W * C * 4, (cuuint64_t)H * W * C * 4};
  // the box of the filter's first tap over the pixels: W from 0 to W - 1 - (S - 1), H likewise (inclusive);
  // W first as for the dims (R == S in every case here, so the order cannot matter)
  const int lower[2] = {0, 0}, upper[2] = {-(S - 1), -(R - 1)};
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  CUresult rc = encode_im2col(&tx, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, (void*)x, xdims, xstrides, lower, upper, 32,
                              G::BM, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) return 1000 + (int)rc;
  const cuuint64_t wdims[2] = {(cuuint64_t)R * S * C, (cuuint64_t)K};
  const cuuint64_t wstrides[1] = {(cuuint64_t)R * S * C * 4};
  const cuuint32_t wbox[2] = {32, BN};
  rc = encode_tiled(&tw, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, (void*)w, wdims, wstrides, wbox, ones,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) return 2000 + (int)rc;
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaFuncSetAttribute(conv_tma<BN, WG_M, CONS, PP, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::SMEM);
  }
  const int tiles_n = K / BN, tiles = (M + G::BM - 1) / G::BM * tiles_n;
  const int grid = tiles < sms ? tiles : sms;
  conv_tma<BN, WG_M, CONS, PP, STAGES><<<grid, G::THREADS, G::SMEM, stream>>>(
      tx, tw, out, bias, M, P * Q, Q, K, R * S * C / 32, C / 32, S, tiles_n, tiles, epi);
  return (int)cudaGetLastError();
}
}  // namespace
"""

VARIANT_TU = r"""
int launch_VARIANT(const float* x, const float* w, const float* bias, float* out, int N, int H, int W, int C, int K,
                   int R, int S, int epi, cudaStream_t stream) {
  if (K % 128 == 0) return launch<128, ARGS>(x, w, bias, out, N, H, W, C, K, R, S, epi, stream);
  return launch<64, ARGS>(x, w, bias, out, N, H, W, C, K, R, S, epi, stream);
}
"""

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

using Launch = int (*)(const float*, const float*, const float*, float*, int, int, int, int, int, int, int, int,
                       cudaStream_t);
DECLS
static const Launch LAUNCHES[] = {TABLE};

// x: (N, C, H, W) in channels-last memory; w: (K, R, S, C) contiguous; out: (N, K, P, Q), channels-last memory for
// the NHWC epilogues, contiguous for the NCHW ones
void run(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out, int64_t variant, int64_t epi) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast),
              "x: fp32, channels-last");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(3) == x.size(1), "w: contiguous (K, R, S, C)");
  TORCH_CHECK(bias.is_contiguous() && bias.numel() == w.size(0), "bias: K floats");
  const int64_t P = x.size(2) - w.size(1) + 1, Q = x.size(3) - w.size(2) + 1;
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0) && out.size(2) == P && out.size(3) == Q,
              "out: (N, K, P, Q)");
  TORCH_CHECK((epi & 2) ? out.is_contiguous() : out.is_contiguous(at::MemoryFormat::ChannelsLast),
              "out's memory layout does not match the epilogue");
  TORCH_CHECK(variant >= 0 && variant < (int64_t)(sizeof(LAUNCHES) / sizeof(LAUNCHES[0])), "no such variant");
  const int rc = LAUNCHES[variant](x.data_ptr<float>(), w.data_ptr<float>(), bias.data_ptr<float>(),
                                   out.data_ptr<float>(), x.size(0), x.size(2), x.size(3), x.size(1), w.size(0),
                                   w.size(1), w.size(2), epi, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc != -1, "shape not covered (C % 32, K % 64)");
  TORCH_CHECK(rc != -2, "no cuTensorMapEncode* from the driver");
  TORCH_CHECK(rc < 1000, "tensor map encoding failed: ", rc >= 2000 ? "weights " : "im2col ", rc % 1000);
  TORCH_CHECK(rc == 0, "launch failed: ", cudaGetErrorString((cudaError_t)rc));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
"""

# name, launch<BN, ...>'s remaining template arguments <WG_M, CONS, PP, STAGES>; safest first
VARIANTS = [
    ("1wg-128", "128, 1, false, 4"),
    ("coop-128", "64, 2, false, 4"),
    ("coop-256", "128, 2, false, 4"),
    ("pp-64", "64, 2, true, 6"),
    ("pp-128", "128, 2, true, 5"),
]


def sources() -> dict[str, str]:
    """File name -> text: the binding and one CUDA translation unit a variant (ninja builds them in parallel)."""
    common = COMMON.replace("R64", _regs(64)).replace("OPS64", _ops(64)).replace("R32", _regs(32)).replace(
        "OPS32", _ops(32))
    files = {f"conv_{ident(n)}.cu": common + VARIANT_TU.replace("launch_VARIANT", f"launch_{ident(n)}").replace(
        "ARGS", args) for n, args in VARIANTS}
    decls = "\n".join(f"int launch_{ident(n)}(const float*, const float*, const float*, float*, int, int, int, int, "
                      "int, int, int, int, cudaStream_t);" for n, _ in VARIANTS)
    files["binding.cpp"] = CPP.replace("DECLS", decls).replace("TABLE", ", ".join(
        f"launch_{ident(n)}" for n, _ in VARIANTS))
    return files


def build():  # noqa: ANN201 - torch's extension module
    return build_variants(NAME, sources())


def compile_only() -> None:
    report_ptxas(NAME, sources(), template_label(
        r"conv_tmaILi(\d+)ELi(\d+)ELi(\d+)ELb(\d)ELi(\d+)E", r"<BN\1 WG_M\2 CONS\3 pp\4 ST\5>"))


def tf32_trunc(t: torch.Tensor) -> torch.Tensor:
    """What the tensor cores read of an fp32 operand: its top 19 bits (the low 13 mantissa bits dropped)."""
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32).view_as(t)


def mish2(t: torch.Tensor) -> torch.Tensor:
    return F.mish(F.mish(t))


def run_ours(ext, variant: int, x, w_rsc, bias, epi: int, k: int) -> torch.Tensor:
    n, _, h, wd = x.shape
    p, q = h - w_rsc.shape[1] + 1, wd - w_rsc.shape[2] + 1
    out = torch.full((n, k, p, q), float("nan"), device=x.device)
    if not epi & 2:
        out = out.contiguous(memory_format=torch.channels_last)
    ext.run(x, w_rsc, bias, out, variant, epi)
    torch.cuda.synchronize()
    return out


def layout_check(ext, variant: int) -> bool:
    """Structured inputs that name what each output element read. Output channel k's filter is one-hot at tap
    (k % 9) and channel 7k % C, so out[n, k, p, q] must be x[n, 7k % C, p + r_k, q + s_k]. Two runs: x = its
    position (n H + h) W + w + 1, then x = its channel + 1 (both exact in TF32), so a wrong element decodes to the
    (n, h, w, c) it read. N P Q = 270: a partial last tile; K = 128 and 64 cover both tile widths."""
    ok = True
    n, c, h, wd, r = 3, 64, 12, 11, 3
    for k in (128, 64):
        w = torch.zeros(k, c, r, r, device=DEVICE)
        ks = torch.arange(k, device=DEVICE)
        taps, chans = ks % 9, (ks * 7) % c
        w[ks, chans, taps // 3, taps % 3] = 1.0
        w_rsc = w.permute(0, 2, 3, 1).contiguous()
        bias = torch.zeros(k, device=DEVICE)
        pos = (torch.arange(n * h * wd, device=DEVICE, dtype=torch.float32) + 1).view(n, 1, h, wd).expand(n, c, h, wd)
        chan = (torch.arange(c, device=DEVICE, dtype=torch.float32) + 1).view(1, c, 1, 1).expand(n, c, h, wd)
        for epi in (0, 2):
            got = [run_ours(ext, variant, t.contiguous(memory_format=torch.channels_last), w_rsc, bias, epi, k)
                   for t in (pos, chan)]
            want = [F.conv2d(t.double(), w.double()) for t in (pos, chan)]  # exact: one nonzero product
            bad = ((got[0].double() != want[0]) | (got[1].double() != want[1])).nonzero()
            print(f"  layout check K={k} {EPILOGUES[epi]}: "
                  f"{'ok' if len(bad) == 0 else f'{len(bad)} of {got[0].numel()} elements wrong'}")
            ok &= len(bad) == 0
            for b, kk, pp, qq in bad[:8].tolist():
                def where(v: float, cv: float) -> str:
                    if v != v or v < 1:  # NaN: never stored; 0: read nothing
                        return f"{v}"
                    i = int(v) - 1
                    return f"x[n={i // (h * wd)}, h={i // wd % h}, w={i % wd}, c={int(cv) - 1}]"
                tap = kk % 9
                read = where(got[0][b, kk, pp, qq].item(), got[1][b, kk, pp, qq].item())
                print(f"    out[n={b}, k={kk}, p={pp}, q={qq}] read {read}, want "
                      f"x[n={b}, h={pp + tap // 3}, w={qq + tap % 3}, c={(kk * 7) % c}]")
    return ok


def references(x, w) -> dict[str, torch.Tensor]:
    """The convolution of the first two images (no bias): float64, float64 of the TF32-truncated operands (what the
    tensor cores compute, less fp32 accumulation), cuDNN channels-last with TF32 on and off."""
    x2 = x[:2]
    refs = {"fp64": F.conv2d(x2.double(), w.double()),
            "trunc": F.conv2d(tf32_trunc(x2).double(), tf32_trunc(w).double())}
    for name, flag in (("cudnn_tf32", True), ("cudnn_fp32", False)):
        torch.backends.cudnn.allow_tf32 = flag
        refs[name] = F.conv2d(x2.contiguous(memory_format=torch.channels_last), w).double()
    torch.backends.cudnn.allow_tf32 = True
    return refs


def errors(out: torch.Tensor, refs: dict[str, torch.Tensor], bias, epi: int) -> dict[str, float]:
    """max |err| of `out`'s first two images against each reference (with the epilogue applied in float64)."""
    post = (lambda t: mish2(t + bias.view(1, -1, 1, 1).double())) if epi & 1 else (lambda t: t)
    got = out[:2].double()
    res = {name: (got - post(ref)).abs().max().item() for name, ref in refs.items()}
    res["scale"] = post(refs["fp64"]).abs().max().item()
    return res


def fits(e: dict[str, float]) -> bool:
    """The pass rule: within fp32 accumulation's error of the truncated operands' exact product."""
    return e["trunc"] <= 1e-4 * max(1.0, e["scale"])


def make(n: int, c: int, h: int, wd: int, k: int, seed: int = 0):
    """KernelBench's inputs (torch.rand) and nn.Conv2d's default initialisation of a 3x3 filter and its bias."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bound = 1.0 / (c * 9) ** 0.5
    x = torch.rand(n, c, h, wd, device=DEVICE, generator=g)
    w = (torch.rand(k, c, 3, 3, device=DEVICE, generator=g) * 2 - 1) * bound
    b = (torch.rand(k, device=DEVICE, generator=g) * 2 - 1) * bound
    return x, w, b


def random_check(ext, variant: int) -> bool:
    """Ragged sizes (partial tiles, images split across tiles, several tiles a block, two column tiles) against the
    float64 product of the truncated operands, every epilogue."""
    ok = True
    for n, c, h, wd, k in ((2, 64, 20, 19, 128), (3, 32, 17, 33, 64), (1, 64, 9, 10, 256), (5, 96, 13, 14, 128),
                           (12, 64, 66, 67, 128), (7, 64, 40, 41, 64)):
        x, w, b = make(n, c, h, wd, k)
        xc, w_rsc = x.contiguous(memory_format=torch.channels_last), w.permute(0, 2, 3, 1).contiguous()
        line, refs = [], references(x, w)
        for epi in EPILOGUES:
            e = errors(run_ours(ext, variant, xc, w_rsc, b, epi, k), refs, b, epi)
            good = fits(e)
            ok &= good
            line.append(f"epi{epi} {e['trunc']:.1e}/{e['fp64']:.1e}{'' if good else ' WRONG'}")
        print(f"  ({n}, {c}, {h}, {wd}) -> {k}: err vs trunc/fp64 " + ", ".join(line))
    return ok


def child_check(first: int) -> None:
    ext = build()
    for index in range(first, len(VARIANTS)):
        name = VARIANTS[index][0]
        print(f"{name}:", flush=True)
        ok = layout_check(ext, index)
        ok = random_check(ext, index) and ok
        print(f"  {name}: {'passed' if ok else 'FAILED'}\n{checked(index)}", flush=True)


def probe_shape(ext, alive: list[int], name: str, n: int, c: int, h: int, wd: int, k: int) -> None:
    from kernelfuse.bench.timer import median_event_ms

    x, w, b = make(n, c, h, wd, k)
    xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    w_rsc = w.permute(0, 2, 3, 1).contiguous()
    p, q = h - 2, wd - 2
    flops = 2 * n * p * q * k * c * 9
    case = f"{name}: ({n}, {c}, {h}, {wd}) -> {k}"
    torch.backends.cudnn.allow_tf32 = True
    with torch.no_grad():
        refs = references(x, w)
        # bare: no bias (torch adds cuDNN's bias in a second pass over the output)
        base = {"bare": median_event_ms(lambda: F.conv2d(xc, wc)),
                "mish2": median_event_ms(lambda: mish2(F.conv2d(xc, wc, b))),
                "to_nchw": median_event_ms(lambda: mish2(F.conv2d(xc, wc, b)).contiguous())}
        for label, key in (("cudnn CL conv, no bias (TF32)", "bare"), ("cudnn CL conv+bias, torch mish2", "mish2"),
                           ("  the same, .contiguous() to NCHW", "to_nchw")):
            print(f"| {case} | {label} | - | {base[key]:.3f} | {flops / base[key] / 1e9:.0f} | 1.000 | - |", flush=True)
        for index in alive:
            for epi in EPILOGUES:
                out = torch.empty(n, k, p, q, device=DEVICE)
                if not epi & 2:
                    out = out.contiguous(memory_format=torch.channels_last)
                try:
                    ext.run(xc, w_rsc, b, out, index, epi)
                    e = errors(out, refs, b, epi)
                    ms = median_event_ms(lambda index=index, epi=epi, out=out: ext.run(xc, w_rsc, b, out, index, epi))
                except RuntimeError as err:
                    print(f"| {case} | {VARIANTS[index][0]} | {EPILOGUES[epi]} | n/a | | | "
                          f"{str(err).splitlines()[0][:80]} |", flush=True)
                    continue
                ref = base["mish2"] if epi == 1 else base["to_nchw"] if epi == 3 else base["bare"]
                flag = "" if fits(e) else " WRONG"
                print(f"| {case} | {VARIANTS[index][0]} | {EPILOGUES[epi]} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                      f"{ref / ms:.3f} | {e['fp64']:.1e} / {e['trunc']:.1e} / {e['cudnn_tf32']:.1e} / "
                      f"{e['cudnn_fp32']:.1e}{flag} |", flush=True)
                del out
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="which SHAPES to time")
    started = start(__file__, [v[0] for v in VARIANTS], CHILD_TIMEOUT_S, build, compile_only, child_check, parser)
    if started is None:
        return
    args, ext, alive = started
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          "fp32 in and out, TF32 products. ratio = the cuDNN row's ms / this ms: bare rows (NHWC and NCHW) against "
          "cuDNN's channels-last conv without bias; bias+mish2 NHWC against cuDNN conv+bias then torch's mish(mish); "
          "bias+mish2 NCHW against that + .contiguous(). Errors (first two images): vs float64 / vs float64 of the "
          "TF32-truncated operands (WRONG: over 1e-4) / vs cuDNN TF32 / vs cuDNN fp32 (allow_tf32 off)\n")
    print("| shape | method | epilogue | ms | TFLOP/s | ratio | max abs err: fp64 / trunc / cudnn-tf32 / cudnn-fp32 |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    t0 = time.time()
    for shape in SHAPES:
        if shape[0] in args.shapes.split(","):
            try:
                probe_shape(ext, alive, *shape)
            except RuntimeError as err:  # one shape's failure (memory) is a line, not the end of the run
                print(f"| {shape[0]} | ERROR {str(err).splitlines()[0][:200]} |", flush=True)
    print(f"\ntimed shapes: {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
