"""The tensor-core attention kernels that are not the flash kernel: the first bf16 one (mma.sync m16n8k16, for
layouts the flash kernel does not take) and the fp32 one (mma.sync m16n8k8, TF32 or 3xTF32). They share the
parameter block, tile loop, masking and online softmax of kernelfuse.codegen.attention_prelude; the emitted file
holds them after it (kernelfuse.codegen.cuda)."""

from kernelfuse.codegen.attention_prelude import FRESH_END, FRESH_START, ONLINE_SOFTMAX, SCORE_CHUNK_END, SCORE_CHUNKS
from kernelfuse.codegen.tensorcore import TF32_SPLIT

MMA_ATTENTION_PRELUDE = TF32_SPLIT + r"""
// ---- the same on tensor cores, for bf16 (mma.sync m16n8k16, fp32 accumulation) ----
// 4 warps x 16 query rows; scores and the output accumulate in fp32 fragments, probabilities are rounded to bf16
// for the second product (as flash attention does). Head dims in steps of 8: the scores in k16 steps over zero-padded
// shared rows (kf_attn_bf16_pitch), the output in D / 8 n8 tiles. Elements are raw bf16 bits (unsigned short). The
// flash kernel below takes over where q, k and v are contiguous along d; this one stays for the other layouts.
__device__ __forceinline__ float kf_bf16_float(unsigned short x) { return __uint_as_float((unsigned int)x << 16); }
__device__ __forceinline__ unsigned short kf_float_bf16(float f) {  // round to nearest even, NaN kept
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned int kf_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned int r;  // the same rounding in one instruction (a NaN stays a NaN)
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned int)kf_float_bf16(lo) | ((unsigned int)kf_float_bf16(hi) << 16);
#endif
}
// The probabilities of keys 16 kk .. 16 kk + 15 as an A fragment: the C fragments of key groups 2 kk and 2 kk + 1
// (the scores' accumulators, exponentiated in place), rounded to bf16
template <int NT>
__device__ __forceinline__ void kf_attn_probs(const float (&s)[NT][4], int kk, unsigned int (&a)[4]) {
  a[0] = kf_bf16x2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = kf_bf16x2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = kf_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = kf_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
#ifndef KF_EMULATION
__device__ __forceinline__ void kf_mma_bf16_16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                                  unsigned int b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the launcher only picks this kernel for sm_80 and newer
#endif
}
#endif

// One K/V tile for the tensor-core kernels: keys row-major into ks (row pitch DP), values transposed into vt (row
// pitch KP), rows past L zero. `vec`: 16-byte loads (and key stores), where both are contiguous along d and every
// row starts 16-byte aligned (the launcher checks); else one element at a time through the strides.
struct alignas(16) kf_attn_vec { unsigned int w[4]; };

template <typename U, int D, int BK, int DP, int KP>
__device__ __forceinline__ void kf_attn_load_kv(const U* K, const U* V, U* ks, U* vt, int k0,
                                                const kf_attn_params& p, bool vec) {
  if (vec) {
    constexpr int E = 16 / sizeof(U), W = D / E;
    for (int i = threadIdx.x; i < BK * W; i += 128) {
      const int c = i / W, d = i % W * E;
      kf_attn_vec key = {}, value = {};
      if (k0 + c < p.L) {
        key = *reinterpret_cast<const kf_attn_vec*>(K + (k0 + c) * p.sk[2] + d);
        value = *reinterpret_cast<const kf_attn_vec*>(V + (k0 + c) * p.sv[2] + d);
      }
      *reinterpret_cast<kf_attn_vec*>(ks + c * DP + d) = key;
      const U* e = reinterpret_cast<const U*>(&value);
#pragma unroll
      for (int j = 0; j < E; ++j) vt[(d + j) * KP + c] = e[j];
    }
    return;
  }
  for (int i = threadIdx.x; i < BK * D; i += 128) {
    const int c = i / D, d = i % D;
    const bool in = k0 + c < p.L;
    ks[c * DP + d] = in ? K[(k0 + c) * p.sk[2] + d * p.sk[3]] : (U)0;
    vt[d * KP + c] = in ? V[(k0 + c) * p.sv[2] + d * p.sv[3]] : (U)0;
  }
}

// The bf16 tensor-core kernels' shared row pitch (row-major q and k tiles, the flash kernel's v tiles), in elements:
// d rounded up to the mma's k16 steps, then 8 more, so that the 8 rows an ldmatrix phase or a fragment load reads fall
// in distinct banks and every row stays 16-byte aligned. A head dim that is an odd multiple of 8 leaves 8 pad columns
// after column D - 1, which the last k16 step of q k^T reads: zeros (kf_attn_zero_pad), adding nothing to the scores.
template <int D> constexpr int kf_attn_bf16_pitch = (D + 15) / 16 * 16 + 8;

// The pad columns D..D + 7 of `n` shared bf16 rows (pitch DP) zeroed where D is an odd multiple of 8: once a block,
// before the barrier that precedes the first fragment load, as the tiles' loads write columns 0..D - 1 only
template <int D, int DP, int THREADS>
__device__ __forceinline__ void kf_attn_zero_pad(unsigned short* rows, int n) {
  if constexpr (D % 16 != 0)
    for (int r = threadIdx.x; r < n; r += THREADS) *reinterpret_cast<kf_attn_vec*>(rows + r * DP + D) = kf_attn_vec{};
}

// Can K and V (and Q, with `queries`) move 16 bytes at a time? Contiguous along d, 16-byte aligned bases and row
// strides (in elements of `size` bytes).
inline bool kf_attn_vectorised(const kf_attn_params& p, int size, bool queries = false) {
  const int e = 16 / size;
  const long long* strides[3] = {p.sk, p.sv, p.sq};
  for (int i = 0; i < (queries ? 3 : 2); ++i)
    if (strides[i][3] != 1 || strides[i][0] % e || strides[i][1] % e || strides[i][2] % e) return false;
  return (uintptr_t)p.k % 16 == 0 && (uintptr_t)p.v % 16 == 0 && (!queries || (uintptr_t)p.q % 16 == 0);
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU>
__global__ void __launch_bounds__(128) kf_attention_tc_kernel(const kf_attn_params p, int tiles, bool vec) {
  // KS: k16 steps over d (the last one half pad where D is an odd multiple of 8); DT: the output's n8 tiles
  constexpr int BQ = 64, BK = 64, DP = kf_attn_bf16_pitch<D>, KP = BK + 8, NT = BK / 8, DT = D / 8, KS = (D + 15) / 16;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  unsigned short* qs = reinterpret_cast<unsigned short*>(kf_attn_smem);  // [BQ][DP]
  unsigned short* ks = qs + BQ * DP;                                     // [BK][DP]: keys, row-major
  unsigned short* vt = ks + BK * DP;                                     // [D][KP]: values, transposed
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, r0 = tid / 32 * 16;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const unsigned short* Q = (const unsigned short*)p.q + b * p.sq[0] + h * p.sq[1];
  const unsigned short* K = (const unsigned short*)p.k + b * p.sk[0] + hk * p.sk[1];
  const unsigned short* V = (const unsigned short*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  for (int i = tid; i < BQ * D; i += 128) {
    const int r = i / D, d = i % D;
    qs[r * DP + d] = q0 + r < p.S ? Q[(q0 + r) * p.sq[2] + d * p.sq[3]] : (unsigned short)0;
  }
  kf_attn_zero_pad<D, DP, 128>(qs, BQ + BK);  // the query and key rows' pad
  __syncthreads();
  unsigned int qa[KS][4];  // the warp's 16 query rows as A fragments
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const unsigned short* row = qs + (r0 + g) * DP + kk * 16 + 2 * t;
    qa[kk][0] = *reinterpret_cast<const unsigned int*>(row);
    qa[kk][1] = *reinterpret_cast<const unsigned int*>(row + 8 * DP);
    qa[kk][2] = *reinterpret_cast<const unsigned int*>(row + 8);
    qa[kk][3] = *reinterpret_cast<const unsigned int*>(row + 8 * DP + 8);
  }
  float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;
  for (int k0 = 0; k0 < kend; k0 += BK) {
    unsigned int valid = 0;  // bit j * 4 + e: fragment element e of key group j takes part
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
        bool ok = row < p.S && col < p.L && (!CAUSAL || col <= row);
        if constexpr (MASK == 1 || MASK == 2)  // only bool masks compare with 0 (a bf16 value has no !=)
          if (ok) ok = (mask[row * p.sm[2] + col * p.sm[3]] != 0) == (MASK == 1);
        valid |= (unsigned int)ok << (j * 4 + e);
      }
    if (!__syncthreads_or(valid != 0)) continue;  // also the barrier after the previous tile's reads
    kf_attn_load_kv<unsigned short, D, BK, DP, KP>(K, V, ks, vt, k0, p, vec);
    __syncthreads();
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const unsigned short* key = ks + (j * 8 + g) * DP + kk * 16 + 2 * t;
        kf_mma_bf16_16816(s[j], qa[kk], *reinterpret_cast<const unsigned int*>(key),
                          *reinterpret_cast<const unsigned int*>(key + 8));
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
        float x = kf_attn_softcap(p, s[j][e] * p.scale);
        if constexpr (MASK == 3)
          if (row < p.S && col < p.L) x += kf_attn_additive(p, mask, b, h, row, col);
        s[j][e] = (valid >> (j * 4 + e) & 1u) ? x : -INFINITY;
        if (RELU) s[j][e] = s[j][e] > 0.0f || s[j][e] != s[j][e] ? s[j][e] : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
""" + ONLINE_SOFTMAX + r"""#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {  // the scores' C fragments are the probabilities' A fragments
      unsigned int a[4];
      kf_attn_probs(s, kk, a);
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        const unsigned short* value = vt + (j * 8 + g) * KP + kk * 16 + 2 * t;
        kf_mma_bf16_16816(o[j], a, *reinterpret_cast<const unsigned int*>(value),
                          *reinterpret_cast<const unsigned int*>(value + 8));
      }
    }
  }
  unsigned short* out = (unsigned short*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int j = 0; j < DT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = q0 + r0 + g + (e >> 1) * 8, d = j * 8 + 2 * t + (e & 1);
      const float sum = l[e >> 1];
      if (row < p.S)
        out[row * p.so[2] + d * p.so[3]] =
            kf_float_bf16(RELU ? o[j][e] : sum != 0.0f ? o[j][e] / sum : EMPTY_NAN ? NAN : 0.0f);
    }
}

// ---- fp32 on tensor cores: TF32 (the tf32 policy) or 3xTF32 (SPLIT: big and small parts, three products, the
// arithmetic of torch's own fp32 SDPA kernel on sm_80+) with mma.sync m16n8k8 ----
__device__ __forceinline__ unsigned int kf_tf32(float x) {  // cvt.rna.tf32.f32: 10 mantissa bits, ties away
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned int r;  // one instruction where the bit arithmetic below takes five
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
#else
  const unsigned int u = __float_as_uint(x);
  return (u & 0x7f800000u) == 0x7f800000u ? u : (u + 0x1000u) & 0xffffe000u;
#endif
}
#ifndef KF_EMULATION
__device__ __forceinline__ void kf_mma_tf32_1688(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                                 unsigned int b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the launcher only picks this kernel for sm_80 and newer
#endif
}
#endif

// An fp32 operand's TF32 parts: TF32 alone, rounded to nearest; 3xTF32 (SPLIT), kf_tf32_split's big and small parts
template <bool SPLIT>
__device__ __forceinline__ void kf_tf32_parts(float x, unsigned int& big, unsigned int& small) {
  if (SPLIT)
    kf_tf32_split(x, big, small);
  else
    big = kf_tf32(x);
}

template <bool SPLIT>
__device__ __forceinline__ void kf_mma_f32(float (&d)[4], const float (&a)[4], float b0, float b1) {
  unsigned int big[4], small[4], bb0, bb1, bs0, bs1;
  kf_tf32_parts<SPLIT>(b0, bb0, bs0);
  kf_tf32_parts<SPLIT>(b1, bb1, bs1);
#pragma unroll
  for (int i = 0; i < 4; ++i) kf_tf32_parts<SPLIT>(a[i], big[i], small[i]);
  if (SPLIT) {  // the small products first, then the big one: a * b ~ as * bb + ab * bs + ab * bb
    kf_mma_tf32_1688(d, small, bb0, bb1);
    kf_mma_tf32_1688(d, big, bs0, bs1);
  }
  kf_mma_tf32_1688(d, big, bb0, bb1);
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, bool SPLIT>
__global__ void __launch_bounds__(128) kf_attention_tf32_kernel(const kf_attn_params p, int tiles, bool vec) {
  constexpr int BQ = 64, BK = 64, DP = D + 4, KP = BK + 4, NT = BK / 8, DT = D / 8;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  float* qs = kf_attn_smem;   // [BQ][DP]
  float* ks = qs + BQ * DP;   // [BK][DP]: keys, row-major
  float* vt = ks + BK * DP;   // [D][KP]: values, transposed
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, r0 = tid / 32 * 16;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const float* Q = (const float*)p.q + b * p.sq[0] + h * p.sq[1];
  const float* K = (const float*)p.k + b * p.sk[0] + hk * p.sk[1];
  const float* V = (const float*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  for (int i = tid; i < BQ * D; i += 128) {
    const int r = i / D, d = i % D;
    qs[r * DP + d] = q0 + r < p.S ? Q[(q0 + r) * p.sq[2] + d * p.sq[3]] : 0.0f;
  }
  float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;
  const int src = (lane & ~3) | (t >> 1);  // the lane holding a probability this lane's operand fragment needs
  for (int k0 = 0; k0 < kend; k0 += BK) {
    unsigned int valid = 0;  // bit j * 4 + e: fragment element e of key group j takes part
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
        bool ok = row < p.S && col < p.L && (!CAUSAL || col <= row);
        if constexpr (MASK == 1 || MASK == 2)  // only bool masks compare with 0 (a bf16 value has no !=)
          if (ok) ok = (mask[row * p.sm[2] + col * p.sm[3]] != 0) == (MASK == 1);
        valid |= (unsigned int)ok << (j * 4 + e);
      }
    if (!__syncthreads_or(valid != 0)) continue;  // also the barrier after the previous tile's reads
    kf_attn_load_kv<float, D, BK, DP, KP>(K, V, ks, vt, k0, p, vec);
    __syncthreads();
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
""" + SCORE_CHUNKS + r"""    for (int kk = 0; kk < DT; ++kk) {
      const float* row = qs + (r0 + g) * DP + kk * 8 + t;
      const float a[4] = {row[0], row[8 * DP], row[4], row[8 * DP + 4]};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* key = ks + (j * 8 + g) * DP + kk * 8 + t;
        kf_mma_f32<SPLIT>(CHUNKED ? sc[j] : s[j], a, key[0], key[4]);
      }
""" + SCORE_CHUNK_END + r"""    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
        float x = kf_attn_softcap(p, s[j][e] * p.scale);
        if constexpr (MASK == 3)
          if (row < p.S && col < p.L) x += kf_attn_additive(p, mask, b, h, row, col);
        s[j][e] = (valid >> (j * 4 + e) & 1u) ? x : -INFINITY;
        if (RELU) s[j][e] = s[j][e] > 0.0f || s[j][e] != s[j][e] ? s[j][e] : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
""" + ONLINE_SOFTMAX + FRESH_START + r"""#pragma unroll
    for (int kk = 0; kk < NT; ++kk) {  // the probabilities of key group kk, moved into the operand layout
      float a[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float lo0 = __shfl_sync(0xffffffffu, s[kk][0], src + 2 * half);
        const float hi0 = __shfl_sync(0xffffffffu, s[kk][1], src + 2 * half);
        const float lo1 = __shfl_sync(0xffffffffu, s[kk][2], src + 2 * half);
        const float hi1 = __shfl_sync(0xffffffffu, s[kk][3], src + 2 * half);
        a[2 * half] = t & 1 ? hi0 : lo0;      // row g, key 4 * half + t
        a[2 * half + 1] = t & 1 ? hi1 : lo1;  // row g + 8
      }
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        const float* value = vt + (j * 8 + g) * KP + kk * 8 + t;
        kf_mma_f32<SPLIT>(FRESH ? pv[j] : o[j], a, value[0], value[4]);
      }
    }
""" + FRESH_END + r"""  }
  float* out = (float*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int j = 0; j < DT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = q0 + r0 + g + (e >> 1) * 8, d = j * 8 + 2 * t + (e & 1);
      const float sum = l[e >> 1];
      if (row < p.S)
        out[row * p.so[2] + d * p.so[3]] = RELU ? o[j][e] : sum != 0.0f ? o[j][e] / sum : EMPTY_NAN ? NAN : 0.0f;
    }
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, bool SPLIT>
cudaError_t kf_attention_tf32(const kf_attn_params& p, int batch, cudaStream_t stream) {
  return kf_attn_launch<kf_attention_tf32_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, SPLIT>>(
      p, batch, 64, 128, ((64 + 64) * (D + 4) + D * (64 + 4)) * 4, kf_attn_vectorised(p, 4), stream);
}
"""
