"""The 3xTF32 GEMM's main loop on Hopper's warpgroup MMA (wgmma), for sm_90a builds: the same product and the same
epilogue call as kernelfuse.codegen.gemm_tc's mma.sync loop, about 1.65x its speed where the tiles fill the GPU.

Measured (benchmarks/wgmma_gemm_probe.py, stop 45, H200, `benchmarks/results/wgmma_gemm_probe_s45_h200.md`):
1024 x 8192 x 8192 in 1.65 ms against cuBLAS's strict-fp32 SGEMM's 2.73 ms (83 against 50 TFLOP/s), error against
float64 0.24x SGEMM's; 4096^3 1.65 against 2.80 ms. Splitting by rounding (both parts written) took 1.94 ms: the
loop is bound by shared memory's bandwidth (B is read three times a k step), so each write saved counts. At 128 x
4096 x 4096 (32 tiles on 132 SMs) it is half cuBLAS's speed, so the launcher takes this loop only where the 128 x
128 tiles cover three quarters of the SMs, and only on a compute-capability 9.0 device (the file's loader then
builds for sm_90a); else the mma.sync loop runs.

The loop: 128 x 128 tiles, two warpgroups of 64 rows, K in stages of 32 through a four-deep cp.async ring (zeros
past M, N and K). B's stage lands in the 128-byte swizzled K-major layout wgmma's descriptors read. The fp32 tile
is its own big part (the tensor cores read a TF32 operand's top 19 bits: they truncate it themselves); while the
tensor cores run the previous stage, the remainder under that truncation goes to a second tile. A's fragments come
from a padded tile into registers and are split there the same way. Per 8-deep k step three wgmma.m64n128k8 (small
x big, big x small, big x big) into a fresh accumulator per stage, added to the running sum in fp32 with
round-to-nearest (the tensor cores' accumulation truncates: stop 41). The tests' CPU emulation runs this loop too
(kf_wg's emulated descriptors and register fragments, KF_EMULATION), so CI checks its logic without a GPU.
"""

from __future__ import annotations

WG_BM, WG_BN, WG_BK, WG_STAGES, WG_THREADS = 128, 128, 32, 4, 256
WG_STAGE_FLOATS = 2 * WG_BN * WG_BK + WG_BM * (WG_BK + 4)  # B big | B small | A (padded rows): 51200 bytes
WG_SMEM_BYTES = WG_STAGES * WG_STAGE_FLOATS * 4 + 1024  # + the 1024-byte alignment of the swizzled tiles


def accumulator_operands(count: int = 64) -> tuple[str, str]:
    """(the PTX register list {%0, ...} of `count` accumulator floats, the asm operand list "+f"(d[0]), ...): a
    wgmma.m64nN product's accumulator is N / 2 floats a thread."""
    regs = ", ".join(f"%{i}" for i in range(count))
    ops = ", ".join(f'"+f"(d[{i}])' for i in range(count))
    return "{" + regs + "}", ops


_D_REGS, _D_OPS = accumulator_operands()

# What every wgmma kernel of a file shares (the GEMM's loop here, the dense convolution's in conv_wgmma, attention's
# in attention_wgmma): the switch the loader sets, the launchers' test, the shared-memory descriptor of a
# 128-byte-swizzled K-major tile, the fences.
WGMMA_COMMON = r"""
// ---- Hopper's warpgroup MMA (wgmma), sm_90a: what the GEMM, convolution and attention kernels share ----
#if defined(__CUDACC__) || defined(KF_EMULATION)
namespace kf_wg {
// set by the loader (kf_wgmma_enable) when it built this library for sm_90a; off, the wgmma kernels only trap
inline bool& enabled() {
  static bool on = false;
  return on;
}
#if defined(KF_EMULATION)
// the tests' CPU emulation takes the wgmma forms it has (the convolution's, attention's) wherever the test enabled
// them
inline int sm90_sms() { return enabled() ? 132 : 0; }
inline bool fits_tiles(long long) { return enabled(); }
#else
// the current device's SMs where the library holds the wgmma kernels and the device is of compute capability 9.0,
// else 0; the device's answers read once per device
inline int sm90_sms() {
  static int major[16], minor[16], sms[16];
  int dev = 0;
  if (!enabled()) return 0;
  cudaGetDevice(&dev);
  if (dev >= 16) return 0;
  if (sms[dev] == 0) {
    cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor[dev], cudaDevAttrComputeCapabilityMinor, dev);
    cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
  }
  return major[dev] == 9 && minor[dev] == 0 ? sms[dev] : 0;
}
// the GEMM and convolution launchers' choice: wgmma (sm90_sms) where a launch's `tiles` blocks cover three quarters
// of the SMs
inline bool fits_tiles(long long tiles) {
  const int sms = sm90_sms();
  return sms > 0 && tiles * 4 >= 3LL * sms;
}
#endif
// (row, k) of a K-major tile of rows of 32 floats (128 bytes) in the 128-byte swizzle wgmma's descriptors read:
// 16-byte chunk c of row r at chunk c ^ (r % 8)
__device__ __forceinline__ int swz128(int row, int k) {
  return row * 32 + (((k >> 2) ^ (row & 7)) << 2) + (k & 3);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma's shared-memory descriptor of such a tile (1024-byte aligned) at k step ks: K-major rows of 128 bytes,
// 128-byte swizzle, groups of eight rows 1024 bytes apart
__device__ __forceinline__ uint64_t desc(const float* tile, int ks) {
  const uint64_t addr = (unsigned)__cvta_generic_to_shared(tile) + ks * 32;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// wait until at most N committed groups of this warpgroup's products are still running
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// generic-proxy writes to shared memory (copies, splits, roundings), then wgmma's asynchronous reads of them
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#elif defined(KF_EMULATION)
// The tests' CPU emulation: a descriptor is the tile's address (1024-byte aligned) plus its k step, the fences and
// waits are nothing (each product is done when it returns), and a thread computes its own fragment of an m64nNk8
// product, both operands K-major swizzled tiles read as the tensor cores read them (a TF32 operand's top 19 bits).
inline uint64_t desc(const float* tile, int ks) { return (uint64_t)(uintptr_t)tile | (uint64_t)ks; }
inline void fence() {}
inline void commit() {}
template <int N> inline void wait() {}
inline void fence_async() {}
// this thread's accumulator fragment (rows row and row + 8, columns 8j + 2t and + 1) plus A's `rows` (those two
// rows' eight k of the step) times B's tile at descriptor b
template <int N> inline void accumulate_fragment(float (&d)[N / 2], const float (&rows)[2][8], uint64_t b) {
  const float* B = reinterpret_cast<const float*>((uintptr_t)(b & ~uint64_t(1023)));
  const int kb = int(b & 1023) * 8, t = threadIdx.x % 4;
  auto tf32 = [](float x) { return __uint_as_float(__float_as_uint(x) & 0xffffe000u); };
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) {  // (row, 8j + 2t), (row, 8j + 2t + 1), then the same for row + 8
      const int c = 8 * j + 2 * t + (e & 1);
      float v = d[4 * j + e];
      for (int kk = 0; kk < 8; ++kk) v = fmaf(tf32(rows[e >> 1][kk]), tf32(B[swz128(c, kb + kk)]), v);
      d[4 * j + e] = v;
    }
}
// an m64nNk8 product, A's tile at descriptor a
template <int N> inline void mma_emulated(float (&d)[N / 2], uint64_t a, uint64_t b) {
  const float* A = reinterpret_cast<const float*>((uintptr_t)(a & ~uint64_t(1023)));
  const int ka = int(a & 1023) * 8, row = threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4;
  float rows[2][8];
  for (int h = 0; h < 2; ++h)
    for (int kk = 0; kk < 8; ++kk) rows[h][kk] = A[swz128(row + 8 * h, ka + kk)];
  accumulate_fragment<N>(d, rows, b);
}
// the same with A's m64k8 fragment from registers: (row, t), (row + 8, t), (row, t + 4), (row + 8, t + 4) of the
// k step, the rows of a lane's quad; the thread gathers its rows' eight k from its quad (emulated shuffles)
template <int N> inline void mma_emulated_ra(float (&d)[N / 2], const unsigned (&a)[4], uint64_t b) {
  const int quad = threadIdx.x % 32 / 4 * 4;
  float rows[2][8];
  for (int t = 0; t < 4; ++t)
    for (int h = 0; h < 2; ++h) {
      rows[h][t] = __shfl_sync(0xffffffffu, __uint_as_float(a[h]), quad + t);
      rows[h][t + 4] = __shfl_sync(0xffffffffu, __uint_as_float(a[2 + h]), quad + t);
    }
  accumulate_fragment<N>(d, rows, b);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}  // namespace kf_wg
KF_EXPORT void kf_wgmma_enable(int on) { kf_wg::enabled() = on != 0; }
#endif  // __CUDACC__ || KF_EMULATION
"""

WGMMA_PRELUDE = r"""
// ---- the 3xTF32 GEMM's main loop on wgmma, sm_90a (kernelfuse.codegen.gemm_wgmma) ----
#if defined(__CUDACC__) || defined(KF_EMULATION)
namespace kf_wg {
KF_WG_SIZES
[[maybe_unused]] constexpr int A_PITCH = BK + 4;  // floats a row of the A tile: the fragment reads are conflict-free
[[maybe_unused]] constexpr int B_TILE = BN * BK;  // floats of one B tile: 128 rows of 128 bytes, swizzled
[[maybe_unused]] constexpr int STAGE_FLOATS = 2 * B_TILE + BM * A_PITCH;
static_assert(STAGE_FLOATS * 4 % 1024 == 0, "each stage's B tiles start on the swizzle's 1024-byte atom");
// the GEMM launcher's choice (fits_tiles) for its M x N output
inline bool fits(int M, int N) { return fits_tiles((long long)((M + BM - 1) / BM) * ((N + BN - 1) / BN)); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mma(float (&d)[64], const unsigned (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 D_REGS, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : D_OPS
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#elif defined(KF_EMULATION)
inline void mma(float (&d)[64], const unsigned (&a)[4], uint64_t b, int accumulate) {
  if (!accumulate)  // scale-d 0: the product replaces the accumulator
    for (float& v : d) v = 0.0f;
  mma_emulated_ra<128>(d, a, b);
}
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)

// K tile k0 of both operands into a stage, zeros past M, N and K: B's rows swizzled (16-byte chunk c of row r at
// chunk c ^ (r % 8)), A's padded
__device__ __forceinline__ void load_stage(float* stage, const float* A, const float* B, int M, int N, int K, int m0,
                                           int n0, int k0) {
  float* b = stage;
  float* a = stage + 2 * B_TILE;
#pragma unroll
  for (int i = 0; i < BN * BK / 4 / THREADS; ++i) {
    const int q = threadIdx.x + i * THREADS, r = q >> 3, c = q & 7, k = k0 + c * 4;
    const bool b_in = n0 + r < N && k < K, a_in = m0 + r < M && k < K;
    kf_gemm_cp16(b + r * BK + ((c ^ (r & 7)) << 2), b_in ? B + (long long)(n0 + r) * K + k : B, b_in);
    kf_gemm_cp16(a + r * A_PITCH + c * 4, a_in ? A + (long long)(m0 + r) * K + k : A, a_in);
  }
}

// a stage's B split: its fp32 tile stays the big part (the tensor cores read a TF32 operand's top 19 bits, so they
// truncate it themselves), the remainder under that truncation goes to the second tile
__device__ __forceinline__ float trunc_tf32(float x) { return __uint_as_float(__float_as_uint(x) & 0xffffe000u); }
__device__ __forceinline__ void split_b(const float* big, float* small) {
#pragma unroll
  for (int i = 0; i < B_TILE / 4 / THREADS; ++i) {
    const int q = (threadIdx.x + i * THREADS) * 4;
    const float4 v = *reinterpret_cast<const float4*>(big + q);
    *reinterpret_cast<float4*>(small + q) =
        float4{v.x - trunc_tf32(v.x), v.y - trunc_tf32(v.y), v.z - trunc_tf32(v.z), v.w - trunc_tf32(v.w)};
  }
}

// a stage's products into the fresh accumulator d: the thread's A fragments of the four k8 steps (rows row and
// row + 8, columns t and t + 4), split as B's, then small x big, big x small, big x big each step
__device__ __forceinline__ void stage_products(float (&d)[64], const float* stage, int row, int t) {
  const float* a = stage + 2 * B_TILE;
  unsigned big[4][4], small[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const float raw[4] = {a[row * A_PITCH + ks * 8 + t], a[(row + 8) * A_PITCH + ks * 8 + t],
                          a[row * A_PITCH + ks * 8 + t + 4], a[(row + 8) * A_PITCH + ks * 8 + t + 4]};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      big[ks][j] = __float_as_uint(raw[j]);
      small[ks][j] = __float_as_uint(raw[j] - trunc_tf32(raw[j]));
    }
  }
  fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    mma(d, small[ks], desc(stage, ks), ks > 0);
    mma(d, big[ks], desc(stage + B_TILE, ks), 1);
    mma(d, big[ks], desc(stage, ks), 1);
  }
  commit();
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}  // namespace kf_wg

// C = A Bᵀ (A: M x K, B: N x K, row-major, K % 4 == 0, 16-byte aligned rows) for the block's 128 x 128 tile,
// each element pair to epi(row, col, v0, v1, pair) as kf_gemm_3xtf32 gives them; THREADS threads, dynamic shared
// memory gemm_wgmma.WG_SMEM_BYTES, grid (N tiles, M tiles)
template <typename Epi>
__device__ __forceinline__ void kf_gemm_3xtf32_wgmma(const float* __restrict__ A, const float* __restrict__ B, int M,
                                                     int N, int K, Epi epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)
  using namespace kf_wg;
  KF_DYNAMIC_SHARED(kf_wg_raw);
  float* const smem = reinterpret_cast<float*>(((uintptr_t)kf_wg_raw + 1023) & ~(uintptr_t)1023);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, KT = (K + BK - 1) / BK;
  const int row = threadIdx.x / 128 * 64 + threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  float total[64] = {}, d[64];
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(smem + s * STAGE_FLOATS, A, B, M, N, K, m0, n0, s * BK);
    kf_cp_async_commit();  // empty groups past K's end keep the count the waits rely on
  }
  kf_cp_async_wait<STAGES - 2>();
  __syncthreads();
  split_b(smem, smem + B_TILE);
  fence_async();
  __syncthreads();
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    if (kt + STAGES - 1 < KT)  // into stage kt - 1's slot: every warpgroup finished it before the last barrier
      load_stage(smem + (kt + STAGES - 1) % STAGES * STAGE_FLOATS, A, B, M, N, K, m0, n0, (kt + STAGES - 1) * BK);
    kf_cp_async_commit();
    stage_products(d, smem + kt % STAGES * STAGE_FLOATS, row, t);
    if (kt + 1 < KT) {  // while the products run: stage kt + 1 in (two later groups may be pending), its B split
      kf_cp_async_wait<STAGES - 2>();
      __syncthreads();
      float* next = smem + (kt + 1) % STAGES * STAGE_FLOATS;
      split_b(next, next + B_TILE);
      fence_async();
    }
    wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] += d[i];
    __syncthreads();  // the next stage's split is visible; every warpgroup is done with this stage's slot
  }
  // accumulator fragment of m64n128: n8 block j holds (row, cols 8j + 2t, +1) and (row + 8, the same columns)
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = n0 + 8 * j + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + row + 8 * h;
      if (r < M && col < N) epi(r, col, total[4 * j + 2 * h], total[4 * j + 2 * h + 1], col + 1 < N);
    }
  }
#else
  __trap();  // never launched: kf_wg::fits is false unless the loader built sm_90a
#endif
}
#endif  // __CUDACC__ || KF_EMULATION
""".replace("D_REGS", _D_REGS).replace("D_OPS", _D_OPS).replace(
    "KF_WG_SIZES",
    f"[[maybe_unused]] constexpr int BM = {WG_BM}, BN = {WG_BN}, BK = {WG_BK}, STAGES = {WG_STAGES}, "
    f"THREADS = {WG_THREADS};")
