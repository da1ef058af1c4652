"""The bf16 flash-attention kernel, FlashAttention-2 style (kernelfuse.codegen.attention picks it where q, k and v
are contiguous along the head dim; head dims in steps of 8 up to 128, an odd multiple of 8 padded to the mma's k16
steps by zero columns in shared memory): its CUDA template, beside the older kernels of
kernelfuse.codegen.attention_prelude whose parameter block, PTX wrappers and online softmax it shares (the file
appends it after theirs)."""

from kernelfuse.codegen.attention_prelude import FRESH_END, FRESH_START, ONLINE_SOFTMAX, SCORE_CHUNK_END, SCORE_CHUNKS
from kernelfuse.codegen.attention_wgmma import WGA_CONFIG

# the online softmax on scores already scaled by log2(e): exp2f is one instruction
ONLINE_SOFTMAX_EXP2 = ONLINE_SOFTMAX.replace("expf(", "exp2f(")


# The start of both flash kernels' key-tile loop (a warp of 16 query rows; K and V tiles double-buffered by
# cp.async): a bool mask's bits read while the tile's copies fly, the barrier, the next tile's copies, and the
# tiles a warp sits out.
FLASH_TILE_START = r"""
    unsigned int valid = 0;  // bool masks: bit j * 4 + e, fragment element e of key group j takes part
    if constexpr (MASK == 1 || MASK == 2)  // read while the tile's copies are in flight
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
          bool ok = row < p.S && col < p.L && (!CAUSAL || col <= row);
          if (ok) ok = (mask[row * p.sm[2] + col * p.sm[3]] != 0) == (MASK == 1);
          valid |= (unsigned int)ok << (j * 4 + e);
        }
    kf_attn_cp_wait<0>();  // this thread's copies of the tile (and, the first time, of the query tile)
    // every thread's copies landed, and every thread is done with the other buffers (the previous tile)
    bool any = true;
    if constexpr (MASK == 1 || MASK == 2)
      any = __syncthreads_or(valid != 0);
    else
      __syncthreads();
    if (k0 + BK < kend) {  // the next tile's copies, while this one is computed
      kf_attn_copy_rows<BK, D, DP, THREADS>(ks + (buf ^ 1) * BK * DP, K + (k0 + BK) * p.sk[2], p.sk[2],
                                            p.L - k0 - BK);
      kf_attn_copy_rows<BK, D, DP, THREADS>(vs + (buf ^ 1) * BK * DP, V + (k0 + BK) * p.sv[2], p.sv[2],
                                            p.L - k0 - BK);
      kf_attn_cp_commit();
    }
    // nothing to do: a bool mask drops the tile for every query of the block, or the warp's rows are all past S or
    // (causal) all before the tile's first key
    if (!any || q0 + r0 >= p.S || (CAUSAL && k0 > q0 + r0 + 15)) continue;
""".lstrip("\n")


# The end of both flash kernels: each row's output divided by its sum (a row whose every key is masked: NaN for the
# hand-written form, zeros for SDPA; a NaN sum stays NaN) and stored as `OutT`, two columns at a time.
FLASH_STORE = r"""
  OutT* out = (OutT*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = q0 + r0 + g + half * 8;
    const float sum = l[half];
    if (row >= p.S) continue;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = o[j][half * 2 + e];
        y[e] = RELU ? x : sum != 0.0f ? x / sum : EMPTY_NAN ? NAN : 0.0f;
      }
      kf_attn_store2(out + row * p.so[2] + (j * 8 + 2 * t) * p.so[3], y[0], y[1], pairs, p.so[3]);
    }
  }
}
""".lstrip("\n")


FLASH_PRELUDE = r"""
// ---- bf16 flash attention, FlashAttention-2 style, where q, k and v are contiguous along d with 16-byte aligned
// rows: WARPS warps x 16 query rows a block (one m16 tile a warp; two, FlashAttention-2's 4 warps x 32 rows, measured
// slower on every probe shape at stop 40), BK keys a tile (64 or 32), at least BLOCKS blocks an SM
// (__launch_bounds__: the registers a thread may hold). The tiling is kernelfuse.codegen.attention.FlashConfig. The
// query tile arrives once (cp.async) into shared memory; its A fragments stay in registers for the whole key loop
// (QREG), or are read again by ldmatrix at each k-step of q k^T (KS x 4 registers fewer, for more blocks an SM); key
// and value tiles stay row-major in shared memory, rows of
// kf_attn_bf16_pitch elements (the 8 rows an ldmatrix phase reads fall in distinct banks; a head dim that is an odd
// multiple of 8 has 8 zero columns after d for the last k16 step of the scores), two of each: tile j + 1's copies fly
// while tile j is computed. Keys' B fragments come by ldmatrix, values' by ldmatrix.trans (no transposing pass).
#ifndef KF_EMULATION
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KF_ASM_SM80(...) asm volatile(__VA_ARGS__)
#else
#define KF_ASM_SM80(...) __trap()  // the launcher only picks this kernel for sm_80 and newer
#endif
__device__ __forceinline__ unsigned int kf_shared_addr(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}
// ldmatrix x4: lane i gives the address of row i % 8 of matrix i / 8; r[m] is the 32-bit word at row lane / 4,
// columns 2 * (lane % 4)..+1 of matrix m (.trans: of matrix m transposed)
__device__ __forceinline__ void kf_ldmatrix_x4(unsigned int (&r)[4], const unsigned short* row) {
  KF_ASM_SM80("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
              : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kf_shared_addr(row)));
}
__device__ __forceinline__ void kf_ldmatrix_x4_trans(unsigned int (&r)[4], const unsigned short* row) {
  KF_ASM_SM80("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
              : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kf_shared_addr(row)));
}
// 16 bytes from global to shared memory, past the registers (and L1); zeros where !in (src-size 0 reads nothing)
__device__ __forceinline__ void kf_cp_async16(void* dst, const void* src, bool in) {
  KF_ASM_SM80("cp.async.cg.shared.global [%0], [%1], 16, %2;" : : "r"(kf_shared_addr(dst)), "l"(src), "r"(in ? 16 : 0));
}
__device__ __forceinline__ void kf_attn_cp_commit() { KF_ASM_SM80("cp.async.commit_group;"); }
template <int N>  // until at most N of this thread's committed groups are still in flight
__device__ __forceinline__ void kf_attn_cp_wait() { KF_ASM_SM80("cp.async.wait_group %0;" : : "n"(N)); }
#endif

// Two output columns of a row (2 t and 2 t + 1, `step` apart): side by side one 32- or 64-bit store where
// `pairs`, else two
__device__ __forceinline__ void kf_attn_store2(unsigned short* dst, float a, float b, bool pairs, long long step) {
  if (pairs) {
    *reinterpret_cast<unsigned int*>(dst) = kf_bf16x2(a, b);
  } else {
    dst[0] = kf_float_bf16(a);
    dst[step] = kf_float_bf16(b);
  }
}
__device__ __forceinline__ void kf_attn_store2(float* dst, float a, float b, bool pairs, long long step) {
  if (pairs) {
    *reinterpret_cast<float2*>(dst) = float2{a, b};
  } else {
    dst[0] = a;
    dst[step] = b;
  }
}

// ROWS rows of D elements (row stride `stride`) into shared rows of DP (bf16: kf_attn_bf16_pitch; fp32: D + 4),
// 16 bytes a copy, columns from D on untouched; rows from `valid` on are zero-filled (their copies read nothing,
// from the first row's address: valid > 0). A thread keeps one column and steps RP rows at a time (one address and
// one stride, where a copy index per thread would cost a 64-bit offset per copy); with D / E not dividing THREADS a
// few threads stay idle.
template <int ROWS, int D, int DP, int THREADS, typename U>
__device__ __forceinline__ void kf_attn_copy_rows(U* dst, const U* src, long long stride, int valid) {
  constexpr int E = 16 / sizeof(U), W = D / E, RP = THREADS / W;  // copies a row, rows a pass
  const int r = threadIdx.x / W, c = threadIdx.x % W * E;
  if (THREADS % W != 0 && r >= RP) return;
  const U* from = src + r * stride + c;
  dst += r * DP + c;
#pragma unroll
  for (int i = 0; i < ROWS; i += RP)
    if (ROWS % RP == 0 || r + i < ROWS)
      kf_cp_async16(dst + i * DP, r + i < valid ? from + i * stride : src, r + i < valid);
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, int WARPS, int BK, bool QREG,
          int BLOCKS>
__global__ void __launch_bounds__(WARPS * 32, BLOCKS)
    kf_attention_fa2_kernel(const kf_attn_params p, int tiles, bool pairs) {
  // KS: k16 steps over d (the last one half pad where D is an odd multiple of 8); DT: the output's n8 tiles
  constexpr int THREADS = WARPS * 32, BQ = WARPS * 16, DP = kf_attn_bf16_pitch<D>, NT = BK / 8, DT = D / 8,
                KS = (D + 15) / 16;
  constexpr float LOG2E = 1.4426950408889634f;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  unsigned short* qs = reinterpret_cast<unsigned short*>(kf_attn_smem);  // [BQ][DP]
  unsigned short* ks = qs + BQ * DP;                                     // [2][BK][DP]: keys, two tiles
  unsigned short* vs = ks + 2 * BK * DP;                                 // [2][BK][DP]: values, two tiles
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, r0 = tid / 32 * 16;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const unsigned short* Q = (const unsigned short*)p.q + b * p.sq[0] + h * p.sq[1] + q0 * p.sq[2];
  const unsigned short* K = (const unsigned short*)p.k + b * p.sk[0] + hk * p.sk[1];
  const unsigned short* V = (const unsigned short*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  kf_attn_copy_rows<BQ, D, DP, THREADS>(qs, Q, p.sq[2], p.S - q0);
  kf_attn_cp_commit();
  kf_attn_copy_rows<BK, D, DP, THREADS>(ks, K, p.sk[2], p.L);
  kf_attn_copy_rows<BK, D, DP, THREADS>(vs, V, p.sv[2], p.L);
  kf_attn_cp_commit();
  kf_attn_zero_pad<D, DP, THREADS>(qs, BQ + 4 * BK);  // every query, key and value row's pad
  kf_attn_cp_wait<1>();  // the query tile; the first keys and values may still be on their way
  __syncthreads();
  // ldmatrix rows: lane i reads row i % 16 from column 8 * (i / 16) (an A operand; the values' two dim groups), for
  // the keys row i % 8 + 8 * (i / 16) from column 8 * (i / 8 % 2) (the B fragments of two key groups)
  const int arow = lane % 16 * DP + lane / 16 * 8, krow = (lane % 8 + lane / 16 * 8) * DP + lane / 8 % 2 * 8;
  // the warp's query rows as A fragments: every k-step's (QREG), else the current k-step's
  const unsigned short* qt = qs + r0 * DP + arow;
  unsigned int qa[QREG ? KS : 1][4];
  if constexpr (QREG)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) kf_ldmatrix_x4(qa[kk], qt + kk * 16);
  float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8: output, max and sum
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  // softmax scores in log2 units (for exp2f); ReLU weighs with the scores themselves
  const float scale = RELU ? p.scale : p.scale * LOG2E;
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;  // causal: no key after the block's last query
  for (int k0 = 0, buf = 0; k0 < kend; k0 += BK, buf ^= 1) {
""" + FLASH_TILE_START + r"""
    const unsigned short* kt = ks + buf * BK * DP + krow;
    const unsigned short* vt = vs + buf * BK * DP + arow;
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if constexpr (!QREG) kf_ldmatrix_x4(qa[0], qt + kk * 16);
      const unsigned int(&q)[4] = qa[QREG ? kk : 0];
#pragma unroll
      for (int j = 0; j < NT; j += 2) {  // key groups j and j + 1
        unsigned int kb[4];
        kf_ldmatrix_x4(kb, kt + j * 8 * DP + kk * 16);
        kf_mma_bf16_16816(s[j], q, kb[0], kb[1]);
        kf_mma_bf16_16816(s[j + 1], q, kb[2], kb[3]);
      }
    }
    const int rt = q0 + r0;  // the warp's first row
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)  // one product where there is no soft cap (scale holds LOG2E already)
        s[j][e] = p.cap_out != 0.0f ? kf_attn_softcap(p, s[j][e] * p.scale) * (RELU ? 1.0f : LOG2E) : s[j][e] * scale;
    // per element only where needed: a mask, keys past L, the causal diagonal across the warp's rows
    if (MASK != 0 || k0 + BK > p.L || (CAUSAL && k0 + BK - 1 > rt))
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = rt + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
          bool ok = col < p.L && (!CAUSAL || col <= row);  // rows past S are never written
          if constexpr (MASK == 1 || MASK == 2) ok = valid >> (j * 4 + e) & 1u;
          if constexpr (MASK == 3)
            if (ok && row < p.S)
              s[j][e] += kf_attn_additive(p, mask, b, h, row, col) * (RELU ? 1.0f : LOG2E);
          if (!ok) s[j][e] = -INFINITY;
        }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (RELU) s[j][e] = s[j][e] > 0.0f || s[j][e] != s[j][e] ? s[j][e] : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
""" + ONLINE_SOFTMAX_EXP2 + r"""#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {  // the scores' C fragments are the probabilities' A fragments
      unsigned int a[4];
      kf_attn_probs(s, kk, a);
#pragma unroll
      for (int j = 0; j < DT; j += 2) {  // dim groups j and j + 1 (an odd D / 8: the last group alone)
        unsigned int vb[4];
        kf_ldmatrix_x4_trans(vb, vt + kk * 16 * DP + j * 8);
        kf_mma_bf16_16816(o[j], a, vb[0], vb[1]);
        if (j + 1 < DT) kf_mma_bf16_16816(o[j + 1], a, vb[2], vb[3]);
      }
    }
  }
  using OutT = unsigned short;
""" + FLASH_STORE + r"""
// The wgmma flash kernel's launcher (kernelfuse.codegen.attention_wgmma, further down the file wherever bf16
// attention is in it): true where it took the launch (`error` its result), false where the kernel does not apply
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN>
bool kf_attention_wgmma(const kf_attn_params& p, int batch, cudaStream_t stream, cudaError_t& error);

// WARPS > 0: the flash kernel (WARPS warps of 16 query rows, BK keys a tile, QREG, BLOCKS) where the bases are
// aligned; before it, on Hopper (an sm_90a library on a 9.0 device), the wgmma kernel where it applies: its head
// dims (attention_wgmma.WGA_CONFIG), any mask, no ReLU here, the run-time conditions in kf_attention_wgmma
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, int WARPS, int BK, bool QREG,
          int BLOCKS>
cudaError_t kf_attention_tc(const kf_attn_params& p, int batch, cudaStream_t stream) {
  if constexpr (WARPS > 0 && (WGMMA_DIMS) && !RELU) {
    cudaError_t error = cudaSuccess;
    if (kf_attention_wgmma<M, D, MASK, CAUSAL, EMPTY_NAN>(p, batch, stream, error)) return error;
  }
  if constexpr (WARPS > 0)  // the plan's strides suit the flash kernel: it runs where the bases are aligned too
    if (kf_attn_vectorised(p, 2, true))
      return kf_attn_launch<kf_attention_fa2_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, WARPS, BK, QREG, BLOCKS>>(
          p, batch, WARPS * 16, WARPS * 32, (WARPS * 16 + 4 * BK) * kf_attn_bf16_pitch<D> * 2, kf_attn_pairs(p, 2),
          stream);
  return kf_attn_launch<kf_attention_tc_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU>>(
      p, batch, 64, 128, ((64 + 64) * kf_attn_bf16_pitch<D> + D * (64 + 8)) * 2, kf_attn_vectorised(p, 2), stream);
}
"""

# The fp32 flash kernel on tensor cores (TF32, or 3xTF32 with SPLIT): the bf16 kernel's structure with mma.sync
# m16n8k8, whose fragments ldmatrix cannot give (32-bit elements), so they are plain shared-memory loads.
FLASH_PRELUDE += r"""
// ---- fp32 flash attention on tensor cores, FlashAttention-2 style, where q, k and v are contiguous along d with
// 16-byte aligned rows: TF32 (the tf32 policy) or 3xTF32 (SPLIT: each operand as a TF32 big part and its remainder,
// kf_tf32_parts; three products, torch's own fp32 SDPA arithmetic). WARPS warps x 16 query rows a block, BK keys a
// tile. Query, key and value tiles arrive by cp.async into shared rows padded to D + 4 floats (every fragment load
// below then falls in 32 distinct banks); the key and value tiles are double-buffered. Operands are split into
// their TF32 parts in registers as they are loaded. The probabilities' A fragments come from the
// scores' C fragments without shuffles: in the second product, operand column t of key group kk stands for key 2 t
// and column t + 4 for key 2 t + 1, and the value rows are read in that order.

// d += a b in TF32 (one product) or 3xTF32 (the small products first, then the big one)
template <bool SPLIT>
__device__ __forceinline__ void kf_mma_parts(float (&d)[4], const unsigned int (&ab)[4], const unsigned int (&as)[4],
                                             unsigned int bb0, unsigned int bb1, unsigned int bs0, unsigned int bs1) {
  if (SPLIT) {
    kf_mma_tf32_1688(d, as, bb0, bb1);
    kf_mma_tf32_1688(d, ab, bs0, bs1);
  }
  kf_mma_tf32_1688(d, ab, bb0, bb1);
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, bool SPLIT, int WARPS, int BK>
__global__ void __launch_bounds__(WARPS * 32) kf_attention_fa2_f32_kernel(const kf_attn_params p, int tiles,
                                                                          bool pairs) {
  constexpr int THREADS = WARPS * 32, BQ = WARPS * 16, DP = D + 4, NT = BK / 8, DT = D / 8;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  float* qs = kf_attn_smem;     // [BQ][DP]
  float* ks = qs + BQ * DP;     // [2][BK][DP]: keys, two tiles
  float* vs = ks + 2 * BK * DP; // [2][BK][DP]: values, two tiles
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, r0 = tid / 32 * 16;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const float* Q = (const float*)p.q + b * p.sq[0] + h * p.sq[1] + q0 * p.sq[2];
  const float* K = (const float*)p.k + b * p.sk[0] + hk * p.sk[1];
  const float* V = (const float*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  kf_attn_copy_rows<BQ, D, DP, THREADS>(qs, Q, p.sq[2], p.S - q0);
  kf_attn_copy_rows<BK, D, DP, THREADS>(ks, K, p.sk[2], p.L);
  kf_attn_copy_rows<BK, D, DP, THREADS>(vs, V, p.sv[2], p.L);
  kf_attn_cp_commit();
  const float* qrow = qs + (r0 + g) * DP + t;  // A fragment (row g, column t) of k-step kk at qrow + 8 kk
  float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;  // causal: no key after the block's last query
  for (int k0 = 0, buf = 0; k0 < kend; k0 += BK, buf ^= 1) {
""" + FLASH_TILE_START + r"""
    const float* kt = ks + buf * BK * DP + g * DP + t;      // key row 8 j + g, column 8 kk + t
    const float* vt = vs + buf * BK * DP + 2 * t * DP + g;  // value rows 8 kk + 2 t (+ 1), column 8 j + g
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
""" + SCORE_CHUNKS + r"""    for (int kk = 0; kk < DT; ++kk) {
      unsigned int qb[4], qsm[4];
      kf_tf32_parts<SPLIT>(qrow[kk * 8], qb[0], qsm[0]);
      kf_tf32_parts<SPLIT>(qrow[8 * DP + kk * 8], qb[1], qsm[1]);
      kf_tf32_parts<SPLIT>(qrow[kk * 8 + 4], qb[2], qsm[2]);
      kf_tf32_parts<SPLIT>(qrow[8 * DP + kk * 8 + 4], qb[3], qsm[3]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        unsigned int bb0, bb1, bs0, bs1;
        kf_tf32_parts<SPLIT>(kt[j * 8 * DP + kk * 8], bb0, bs0);
        kf_tf32_parts<SPLIT>(kt[j * 8 * DP + kk * 8 + 4], bb1, bs1);
        kf_mma_parts<SPLIT>(CHUNKED ? sc[j] : s[j], qb, qsm, bb0, bb1, bs0, bs1);
      }
""" + SCORE_CHUNK_END + r"""    }
    float mx[2] = {-INFINITY, -INFINITY};
    const int rt = q0 + r0;  // the warp's first row
    // per element only where needed: a mask, keys past L, the causal diagonal across the warp's rows
    const bool edge = MASK != 0 || k0 + BK > p.L || (CAUSAL && k0 + BK - 1 > rt);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = kf_attn_softcap(p, s[j][e] * p.scale);
        if (edge) {
          const int row = rt + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
          bool ok = col < p.L && (!CAUSAL || col <= row);  // rows past S are never written
          if constexpr (MASK == 1 || MASK == 2) ok = valid >> (j * 4 + e) & 1u;
          if constexpr (MASK == 3)
            if (ok && row < p.S) x += kf_attn_additive(p, mask, b, h, row, col);
          if (!ok) x = -INFINITY;
        }
        if (RELU) x = x > 0.0f || x != x ? x : 0.0f;
        s[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
""" + ONLINE_SOFTMAX + FRESH_START + r"""#pragma unroll
    for (int kk = 0; kk < NT; ++kk) {  // key group kk: operand columns t and t + 4 are keys 2 t and 2 t + 1
      unsigned int pb[4], psm[4];
      kf_tf32_parts<SPLIT>(s[kk][0], pb[0], psm[0]);
      kf_tf32_parts<SPLIT>(s[kk][2], pb[1], psm[1]);
      kf_tf32_parts<SPLIT>(s[kk][1], pb[2], psm[2]);
      kf_tf32_parts<SPLIT>(s[kk][3], pb[3], psm[3]);
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        unsigned int bb0, bb1, bs0, bs1;
        kf_tf32_parts<SPLIT>(vt[kk * 8 * DP + j * 8], bb0, bs0);
        kf_tf32_parts<SPLIT>(vt[kk * 8 * DP + DP + j * 8], bb1, bs1);
        kf_mma_parts<SPLIT>(FRESH ? pv[j] : o[j], pb, psm, bb0, bb1, bs0, bs1);
      }
    }
""" + FRESH_END + r"""  }
  using OutT = float;
""" + FLASH_STORE + r"""
// WARPS > 0: the flash kernel (WARPS warps of 16 query rows, BK keys a tile) where the bases are aligned too; else
// the first fp32 tensor-core kernel
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, bool SPLIT, int WARPS, int BK>
cudaError_t kf_attention_f32tc(const kf_attn_params& p, int batch, cudaStream_t stream) {
  if constexpr (WARPS > 0) {
    if (kf_attn_vectorised(p, 4, true))
      return kf_attn_launch<kf_attention_fa2_f32_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, SPLIT, WARPS, BK>>(
          p, batch, WARPS * 16, WARPS * 32, (WARPS * 16 + 4 * BK) * (D + 4) * 4, kf_attn_pairs(p, 4), stream);
  }
  return kf_attention_tf32<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, SPLIT>(p, batch, stream);
}
"""
FLASH_PRELUDE = FLASH_PRELUDE.replace("WGMMA_DIMS", " || ".join(f"D == {d}" for d in WGA_CONFIG))
