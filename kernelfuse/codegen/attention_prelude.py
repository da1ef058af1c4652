"""The attention kernels' CUDA templates (kernelfuse.codegen.attention instantiates them per step): the fp32 FMA
kernel, the bf16 tensor-core kernels (mma.sync m16n8k16: the flash kernel where q, k and v are contiguous along d,
the first one elsewhere) and the fp32 tensor-core kernel (mma.sync m16n8k8, TF32 or 3xTF32), sharing one parameter
block, tile loop, masking and online softmax. Kept apart from the launcher and binding code, as
kernelfuse.codegen.reduce_prelude is from the row kernels."""

# The online-softmax step both tensor-core kernels (bf16 and TF32) take after scoring a key tile: the row
# maximum and sum across the 4 lanes that share a row, the running output rescaled by the correction.
_ONLINE_SOFTMAX = r"""
    if (!RELU) {  // online softmax: a row's 4 lanes share its maximum and sum
      float corr[2], sum[2] = {0.0f, 0.0f}, base[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
        const float mnew = fmaxf(m[half], mx[half]);
        base[half] = mnew == -INFINITY ? 0.0f : mnew;
        corr[half] = expf(m[half] - base[half]);
        m[half] = mnew;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = expf(s[j][e] - base[e >> 1]);
          sum[e >> 1] += s[j][e];
        }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 1);
        sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 2);
        l[half] = l[half] * corr[half] + sum[half];
      }
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[j][0] *= corr[0]; o[j][1] *= corr[0]; o[j][2] *= corr[1]; o[j][3] *= corr[1];
      }
    }
""".lstrip("\n")
# ... the same for the flash kernel, whose scores are already scaled by log2(e): exp2f is one instruction.
_ONLINE_SOFTMAX_EXP2 = _ONLINE_SOFTMAX.replace("expf(", "exp2f(")


def _indented(code: str) -> str:
    """CUDA code one level (2 spaces) deeper; preprocessor lines stay in column 0."""
    return "".join(line if line.startswith("#") or not line.strip() else "  " + line
                   for line in code.splitlines(keepends=True))

ATTENTION_PRELUDE = r"""
// ---- flash attention (kernelfuse.codegen.attention) ----
#ifndef KF_DYNAMIC_SHARED
#define KF_DYNAMIC_SHARED(name) extern __shared__ __align__(16) float name[]
#endif

struct kf_attn_params {
  const void* q; const void* k; const void* v; const void* mask; void* out;
  int heads, group, S, L;  // group: query heads per kv head
  long long sq[4], sk[4], sv[4], sm[4], so[4];  // element strides over (batch, head, row, col)
  float scale;
};

// A kernel's opt-in to more dynamic shared memory than the default, once per device (not again inside a graph
// capture); the kernel is a template argument, so each has flags of its own
template <auto KERNEL>
cudaError_t kf_attn_opt_in(int bytes) {
  static bool ready[16] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 16 && ready[dev]) return cudaSuccess;
  const cudaError_t error = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (error == cudaSuccess && dev < 16) ready[dev] = true;
  return error;
}

// Tile geometry: 128 threads as 8 row groups x 16 lanes; a thread owns RQ query rows, CK keys of a tile and
// DJ output columns (d = lane + 16 j). Rows of the transposed shared tiles are padded by 4 floats: fewer bank
// conflicts on the transposing stores, and every row stays 16-byte aligned for the vector loads.
template <int D, int BQ, int BK>
struct kf_attn_tile {
  static constexpr int TX = 16, RQ = BQ / 8, CK = BK / TX, DJ = (D + TX - 1) / TX;
  static constexpr int QP = BQ + 4, KP = BK + 4;
  static constexpr int KV = D * KP > BK * D ? D * KP : BK * D;  // K transposed, then V, in one buffer
  static constexpr int FLOATS = D * QP + KV + BK * QP;
};

// N consecutive floats of shared memory in 16- or 8-byte loads (the callers' addresses are aligned so).
template <int N>
__device__ __forceinline__ void kf_attn_load(const float* src, float (&dst)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 t = *reinterpret_cast<const float4*>(src + i);
      dst[i] = t.x; dst[i + 1] = t.y; dst[i + 2] = t.z; dst[i + 3] = t.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 t = *reinterpret_cast<const float2*>(src + i);
      dst[i] = t.x; dst[i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// MASK: 0 none, 1 bool (true attends, SDPA), 2 bool (true masked, masked_fill), 3 additive (the query's dtype).
// RELU: relu(scores) weigh the values as they are (ReLU self-attention): no maximum, no sum, no normalisation.
template <typename T, typename M, int D, int BQ, int BK, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU>
__global__ void __launch_bounds__(128) kf_attention_kernel(const kf_attn_params p, int tiles) {
  typedef kf_attn_tile<D, BQ, BK> Tile;
  constexpr int TX = Tile::TX, RQ = Tile::RQ, CK = Tile::CK, DJ = Tile::DJ, QP = Tile::QP, KP = Tile::KP;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  float* qt = kf_attn_smem;  // [D][QP]: the query tile, transposed
  float* kv = qt + D * QP;   // [D][KP]: the key tile, transposed; then [BK][D]: the value tile
  float* pt = kv + Tile::KV; // [BK][QP]: the tile's probabilities, transposed
  const int tid = threadIdx.x, tx = tid % TX, r0 = tid / TX * RQ, c0 = tx * CK;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  // a head's query tiles run side by side (its K and V stay in L2); causal: the longest (last) tiles first
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const T* Q = (const T*)p.q + b * p.sq[0] + h * p.sq[1];
  const T* K = (const T*)p.k + b * p.sk[0] + hk * p.sk[1];
  const T* V = (const T*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  for (int i = tid; i < BQ * D; i += 128) {
    const int r = i / D, d = i % D;
    qt[d * QP + r] = q0 + r < p.S ? kf_load(Q[(q0 + r) * p.sq[2] + d * p.sq[3]]) : 0.0f;
  }
  float o[RQ][DJ], m[RQ], l[RQ];
#pragma unroll
  for (int r = 0; r < RQ; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < DJ; ++j) o[r][j] = 0.0f;
  }
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;  // causal: no key after the tile's last query
  for (int k0 = 0; k0 < kend; k0 += BK) {
    unsigned int valid = 0;  // bit r * CK + c: the score of (query q0 + r0 + r, key k0 + c0 + c) takes part
#pragma unroll
    for (int r = 0; r < RQ; ++r)
#pragma unroll
      for (int c = 0; c < CK; ++c) {
        const int row = q0 + r0 + r, col = k0 + c0 + c;
        bool ok = row < p.S && col < p.L && (!CAUSAL || col <= row);
        if constexpr (MASK == 1 || MASK == 2)  // only bool masks compare with 0 (a bf16 value has no !=)
          if (ok) ok = (mask[row * p.sm[2] + col * p.sm[3]] != 0) == (MASK == 1);
        valid |= (unsigned int)ok << (r * CK + c);
      }
    // also the barrier after the previous tile's reads of kv and pt
    if (!__syncthreads_or(valid != 0)) continue;  // every key of the tile masked for every query: skip it
    for (int i = tid; i < BK * D; i += 128) {
      const int c = i / D, d = i % D;
      kv[d * KP + c] = k0 + c < p.L ? kf_load(K[(k0 + c) * p.sk[2] + d * p.sk[3]]) : 0.0f;
    }
    __syncthreads();
    float s[RQ][CK];
#pragma unroll
    for (int r = 0; r < RQ; ++r)
#pragma unroll
      for (int c = 0; c < CK; ++c) s[r][c] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      float qv[RQ], kk[CK];
      kf_attn_load(&qt[d * QP + r0], qv);
      kf_attn_load(&kv[d * KP + c0], kk);
#pragma unroll
      for (int r = 0; r < RQ; ++r)
#pragma unroll
        for (int c = 0; c < CK; ++c) s[r][c] = fmaf(qv[r], kk[c], s[r][c]);
    }
#pragma unroll
    for (int r = 0; r < RQ; ++r) {  // online softmax: the row's 16 lanes share its maximum and sum
      const int row = q0 + r0 + r;
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < CK; ++c) {
        float x = s[r][c] * p.scale;
        if constexpr (MASK == 3)
          if (row < p.S && k0 + c0 + c < p.L) x += kf_load(mask[row * p.sm[2] + (k0 + c0 + c) * p.sm[3]]);
        s[r][c] = (valid >> (r * CK + c) & 1u) ? x : -INFINITY;
        mx = fmaxf(mx, s[r][c]);
      }
      if (RELU) {
#pragma unroll
        for (int c = 0; c < CK; ++c) pt[(c0 + c) * QP + r0 + r] = s[r][c] > 0.0f || s[r][c] != s[r][c] ? s[r][c] : 0.0f;
        continue;
      }
#pragma unroll
      for (int off = TX / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mnew = fmaxf(m[r], mx);
      const float base = mnew == -INFINITY ? 0.0f : mnew;  // a row masked so far: its terms are all zero
      const float corr = expf(m[r] - base);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < CK; ++c) {
        s[r][c] = expf(s[r][c] - base);
        sum += s[r][c];
      }
#pragma unroll
      for (int off = TX / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[r] = l[r] * corr + sum;
      m[r] = mnew;
#pragma unroll
      for (int j = 0; j < DJ; ++j) o[r][j] *= corr;
#pragma unroll
      for (int c = 0; c < CK; ++c) pt[(c0 + c) * QP + r0 + r] = s[r][c];
    }
    __syncthreads();  // every score read from the key tile: the buffer takes the values
    for (int i = tid; i < BK * D; i += 128) {
      const int c = i / D, d = i % D;
      kv[c * D + d] = k0 + c < p.L ? kf_load(V[(k0 + c) * p.sv[2] + d * p.sv[3]]) : 0.0f;
    }
    __syncthreads();
    const int keys = min(BK, p.L - k0);
    for (int c = 0; c < keys; ++c) {
      float pv[RQ], vv[DJ];
      kf_attn_load(&pt[c * QP + r0], pv);
#pragma unroll
      for (int j = 0; j < DJ; ++j) vv[j] = (D % TX == 0 || tx + TX * j < D) ? kv[c * D + tx + TX * j] : 0.0f;
#pragma unroll
      for (int r = 0; r < RQ; ++r)
#pragma unroll
        for (int j = 0; j < DJ; ++j) o[r][j] = fmaf(pv[r], vv[j], o[r][j]);
    }
  }
  T* out = (T*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int r = 0; r < RQ; ++r) {
    const int row = q0 + r0 + r;
    if (row >= p.S) continue;
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      const int d = tx + TX * j;
      if (D % TX == 0 || d < D)
        out[row * p.so[2] + d * p.so[3]] =
            kf_store<T>(RELU ? o[r][j] : l[r] > 0.0f ? o[r][j] / l[r] : EMPTY_NAN ? NAN : 0.0f);
    }
  }
}

template <typename T, typename M, int D, int BQ, int BK, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU>
cudaError_t kf_attention(const kf_attn_params& p, int batch, cudaStream_t stream) {
  constexpr auto kernel = kf_attention_kernel<T, M, D, BQ, BK, MASK, CAUSAL, EMPTY_NAN, RELU>;
  const int bytes = kf_attn_tile<D, BQ, BK>::FLOATS * (int)sizeof(float);
  const cudaError_t opted = kf_attn_opt_in<kernel>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + BQ - 1) / BQ;
  kernel<<<(unsigned int)(tiles * (long long)batch * p.heads), 128, bytes, stream>>>(p, tiles);
  return cudaGetLastError();
}
// ---- the same on tensor cores, for bf16 (mma.sync m16n8k16, fp32 accumulation) ----
// 4 warps x 16 query rows; scores and the output accumulate in fp32 fragments, probabilities are rounded to bf16
// for the second product (as flash attention does). Elements are raw bf16 bits (unsigned short). The flash kernel
// below takes over where q, k and v are contiguous along d; this one stays for the other layouts.
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
  constexpr int BQ = 64, BK = 64, DP = D + 8, KP = BK + 8, NT = BK / 8, DT = D / 8, KS = D / 16;
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
        float x = s[j][e] * p.scale;
        if constexpr (MASK == 3)
          if (row < p.S && col < p.L) x += kf_bf16_float(mask[row * p.sm[2] + col * p.sm[3]]);
        s[j][e] = (valid >> (j * 4 + e) & 1u) ? x : -INFINITY;
        if (RELU) s[j][e] = s[j][e] > 0.0f || s[j][e] != s[j][e] ? s[j][e] : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
""" + _ONLINE_SOFTMAX + r"""#pragma unroll
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
            kf_float_bf16(RELU ? o[j][e] : sum > 0.0f ? o[j][e] / sum : EMPTY_NAN ? NAN : 0.0f);
    }
}

// ---- bf16 flash attention, FlashAttention-2 style, where q, k and v are contiguous along d with 16-byte aligned
// rows: WARPS warps x ROWS query rows a block (ROWS 16 or 32: one or two m16 tiles a warp; with two, as
// FlashAttention-2's 4 warps x 32 rows, every key and value B fragment feeds two mma), 64 keys a tile. The query
// tile arrives once (cp.async) into shared memory and stays in registers as A fragments (two m-tiles over more than
// 64 dims, or 32 with a mask: the registers go to the accumulators, the A fragments come by ldmatrix at every k-step);
// key and value tiles stay row-major in shared memory, rows padded to D + 8 elements (the 8 rows an ldmatrix phase
// reads fall in distinct banks), two of each: tile j + 1's copies fly while tile j is computed. Keys' B fragments
// come by ldmatrix, values' by ldmatrix.trans (no transposing pass).
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
__device__ __forceinline__ void kf_cp_async16(unsigned short* dst, const unsigned short* src, bool in) {
  KF_ASM_SM80("cp.async.cg.shared.global [%0], [%1], 16, %2;" : : "r"(kf_shared_addr(dst)), "l"(src), "r"(in ? 16 : 0));
}
__device__ __forceinline__ void kf_attn_cp_commit() { KF_ASM_SM80("cp.async.commit_group;"); }
template <int N>  // until at most N of this thread's committed groups are still in flight
__device__ __forceinline__ void kf_attn_cp_wait() { KF_ASM_SM80("cp.async.wait_group %0;" : : "n"(N)); }
#endif

// ROWS rows of D elements (row stride `stride`) into shared rows of D + 8, 16 bytes a copy; rows from `valid` on
// are zero-filled (their copies read nothing, from the first row's address: valid > 0). A thread keeps one column
// and steps RP rows at a time (one address and one stride, where a copy index per thread would cost a 64-bit offset
// per copy); with D / 8 not dividing THREADS a few threads stay idle.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void kf_attn_copy_rows(unsigned short* dst, const unsigned short* src, long long stride,
                                                  int valid) {
  constexpr int W = D / 8, RP = THREADS / W;  // copies a row, rows a pass
  const int r = threadIdx.x / W, c = threadIdx.x % W * 8;
  if (THREADS % W != 0 && r >= RP) return;
  const unsigned short* from = src + r * stride + c;
  dst += r * (D + 8) + c;
#pragma unroll
  for (int i = 0; i < ROWS; i += RP)
    if (ROWS % RP == 0 || r + i < ROWS)
      kf_cp_async16(dst + i * (D + 8), r + i < valid ? from + i * stride : src, r + i < valid);
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, int WARPS, int ROWS>
__global__ void __launch_bounds__(WARPS * 32, (D <= 64 ? 256 : 128) / (WARPS * ROWS))
    kf_attention_fa2_kernel(const kf_attn_params p, int tiles, bool pairs) {
  // MT m16 tiles a warp, rows r0 + 16 mt ... The query A fragments of every k-step stay in registers (QREG) where
  // they fit beside the accumulators without spills: one m-tile; two up to 64 dims, up to 32 with a mask (its loads
  // and bits take registers too). Elsewhere each k-step's come by ldmatrix again.
  constexpr int MT = ROWS / 16, THREADS = WARPS * 32, BQ = WARPS * ROWS, BK = 64, DP = D + 8, NT = BK / 8,
                DT = D / 8, KS = D / 16;
  constexpr bool QREG = MT == 1 || D <= (MASK ? 32 : 64);
  constexpr float LOG2E = 1.4426950408889634f;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  unsigned short* qs = reinterpret_cast<unsigned short*>(kf_attn_smem);  // [BQ][DP]
  unsigned short* ks = qs + BQ * DP;                                     // [2][BK][DP]: keys, two tiles
  unsigned short* vs = ks + 2 * BK * DP;                                 // [2][BK][DP]: values, two tiles
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, r0 = tid / 32 * ROWS;
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BQ;
  const unsigned short* Q = (const unsigned short*)p.q + b * p.sq[0] + h * p.sq[1] + q0 * p.sq[2];
  const unsigned short* K = (const unsigned short*)p.k + b * p.sk[0] + hk * p.sk[1];
  const unsigned short* V = (const unsigned short*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  kf_attn_copy_rows<BQ, D, THREADS>(qs, Q, p.sq[2], p.S - q0);
  kf_attn_cp_commit();
  kf_attn_copy_rows<BK, D, THREADS>(ks, K, p.sk[2], p.L);
  kf_attn_copy_rows<BK, D, THREADS>(vs, V, p.sv[2], p.L);
  kf_attn_cp_commit();
  kf_attn_cp_wait<1>();  // the query tile; the first keys and values may still be on their way
  __syncthreads();
  // ldmatrix rows: lane i reads row i % 16 from column 8 * (i / 16) (an A operand; the values' two dim groups), for
  // the keys row i % 8 + 8 * (i / 16) from column 8 * (i / 8 % 2) (the B fragments of two key groups)
  const int arow = lane % 16 * DP + lane / 16 * 8, krow = (lane % 8 + lane / 16 * 8) * DP + lane / 8 % 2 * 8;
  const unsigned short* qt = qs + r0 * DP + arow;  // the warp's m-tile mt at qt + mt * 16 * DP
  unsigned int qa[QREG ? KS : 1][MT][4];  // the warp's query rows as A fragments: every k-step's, or the current one
  if constexpr (QREG)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) kf_ldmatrix_x4(qa[kk][mt], qt + mt * 16 * DP + kk * 16);
  float acc[MT][DT][4], rmax[MT][2], rsum[MT][2];  // per m-tile, rows g and g + 8: the output, running max and sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    rmax[mt][0] = rmax[mt][1] = -INFINITY;
    rsum[mt][0] = rsum[mt][1] = 0.0f;
#pragma unroll
    for (int j = 0; j < DT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
  }
  // softmax scores in log2 units (for exp2f); ReLU weighs with the scores themselves
  const float scale = RELU ? p.scale : p.scale * LOG2E;
  const int kend = CAUSAL ? min(p.L, q0 + BQ) : p.L;  // causal: no key after the block's last query
  for (int k0 = 0, buf = 0; k0 < kend; k0 += BK, buf ^= 1) {
    unsigned int valid[MT] = {};  // bool masks: bit j * 4 + e of m-tile mt's, its element e of key group j takes part
    // read while the tile's copies are in flight, an m-tile at a time (a loop kept rolled: two m-tiles' 64 mask
    // loads at once would take registers the accumulators hold; valid lives in local memory then, 8 bytes)
    if constexpr (MASK == 1 || MASK == 2)
#pragma unroll 1
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = q0 + r0 + mt * 16 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
            bool ok = row < p.S && col < p.L && (!CAUSAL || col <= row);
            if (ok) ok = (mask[row * p.sm[2] + col * p.sm[3]] != 0) == (MASK == 1);
            valid[mt] |= (unsigned int)ok << (j * 4 + e);
          }
    kf_attn_cp_wait<0>();  // this thread's copies of the tile
    // every thread's copies landed, and every thread is done with the other buffers (the previous tile)
    bool any = true;
    if constexpr (MASK == 1 || MASK == 2) {
      unsigned int mine = 0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mine |= valid[mt];
      any = __syncthreads_or(mine != 0);
    } else {
      __syncthreads();
    }
    if (k0 + BK < kend) {  // the next tile's copies, while this one is computed
      kf_attn_copy_rows<BK, D, THREADS>(ks + (buf ^ 1) * BK * DP, K + (k0 + BK) * p.sk[2], p.sk[2], p.L - k0 - BK);
      kf_attn_copy_rows<BK, D, THREADS>(vs + (buf ^ 1) * BK * DP, V + (k0 + BK) * p.sv[2], p.sv[2], p.L - k0 - BK);
      kf_attn_cp_commit();
    }
    // nothing to do: a bool mask drops the tile for every query of the block, or the warp's rows are all past S or
    // (causal) all before the tile's first key
    if (!any || q0 + r0 >= p.S || (CAUSAL && k0 > q0 + r0 + ROWS - 1)) continue;
    const unsigned short* kt = ks + buf * BK * DP + krow;
    const unsigned short* vt = vs + buf * BK * DP + arow;
    float score[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) score[mt][j][0] = score[mt][j][1] = score[mt][j][2] = score[mt][j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if constexpr (!QREG)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) kf_ldmatrix_x4(qa[0][mt], qt + mt * 16 * DP + kk * 16);
      const unsigned int (&qk)[MT][4] = qa[QREG ? kk : 0];
#pragma unroll
      for (int j = 0; j < NT; j += 2) {  // key groups j and j + 1, for every m-tile
        unsigned int kb[4];
        kf_ldmatrix_x4(kb, kt + j * 8 * DP + kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          kf_mma_bf16_16816(score[mt][j], qk[mt], kb[0], kb[1]);
          kf_mma_bf16_16816(score[mt][j + 1], qk[mt], kb[2], kb[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {  // each m-tile's rows: scale, mask, maximum, online softmax
      float (&s)[NT][4] = score[mt];
      float (&o)[DT][4] = acc[mt];
      float (&m)[2] = rmax[mt];
      float (&l)[2] = rsum[mt];
      const int rt = q0 + r0 + mt * 16;  // the m-tile's first row
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= scale;
      // per element only where needed: a mask, keys past L, the causal diagonal across the m-tile's rows
      if (MASK != 0 || k0 + BK > p.L || (CAUSAL && k0 + BK - 1 > rt))
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = rt + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
            bool ok = col < p.L && (!CAUSAL || col <= row);  // rows past S are never written
            if constexpr (MASK == 1 || MASK == 2) ok = valid[mt] >> (j * 4 + e) & 1u;
            if constexpr (MASK == 3)
              if (ok && row < p.S)
                s[j][e] += kf_bf16_float(mask[row * p.sm[2] + col * p.sm[3]]) * (RELU ? 1.0f : LOG2E);
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
""" + _indented(_ONLINE_SOFTMAX_EXP2) + r"""    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {  // the scores' C fragments are the probabilities' A fragments
      unsigned int a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) kf_attn_probs(score[mt], kk, a[mt]);
#pragma unroll
      for (int j = 0; j < DT; j += 2) {  // dim groups j and j + 1, for every m-tile
        unsigned int vb[4];
        kf_ldmatrix_x4_trans(vb, vt + kk * 16 * DP + j * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          kf_mma_bf16_16816(acc[mt][j], a[mt], vb[0], vb[1]);
          kf_mma_bf16_16816(acc[mt][j + 1], a[mt], vb[2], vb[3]);
        }
      }
    }
  }
  unsigned short* out = (unsigned short*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = q0 + r0 + mt * 16 + g + half * 8;
      const float sum = rsum[mt][half];
      if (row >= p.S) continue;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        float y[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = acc[mt][j][half * 2 + e];
          y[e] = RELU ? x : sum > 0.0f ? x / sum : EMPTY_NAN ? NAN : 0.0f;
        }
        unsigned short* dst = out + row * p.so[2] + (j * 8 + 2 * t) * p.so[3];
        if (pairs) {  // the two columns side by side: one 32-bit store
          *reinterpret_cast<unsigned int*>(dst) = kf_bf16x2(y[0], y[1]);
        } else {
          dst[0] = kf_float_bf16(y[0]);
          dst[p.so[3]] = kf_float_bf16(y[1]);
        }
      }
    }
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, int WARPS, int ROWS>
cudaError_t kf_attention_fa2(const kf_attn_params& p, int batch, cudaStream_t stream) {
  constexpr auto kernel = kf_attention_fa2_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, WARPS, ROWS>;
  constexpr int BQ = WARPS * ROWS, threads = WARPS * 32, bytes = (BQ + 4 * 64) * (D + 8) * 2;
  const cudaError_t opted = kf_attn_opt_in<kernel>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + BQ - 1) / BQ;
  const bool pairs =
      p.so[3] == 1 && p.so[0] % 2 == 0 && p.so[1] % 2 == 0 && p.so[2] % 2 == 0 && (uintptr_t)p.out % 4 == 0;
  kernel<<<(unsigned int)(tiles * (long long)batch * p.heads), threads, bytes, stream>>>(p, tiles, pairs);
  return cudaGetLastError();
}

// WARPS > 0: the flash kernel's blocks, WARPS warps of ROWS query rows, where the bases are aligned
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, int WARPS, int ROWS>
cudaError_t kf_attention_tc(const kf_attn_params& p, int batch, cudaStream_t stream) {
  if constexpr (WARPS > 0)  // the plan's strides suit the flash kernel: it runs where the bases are aligned too
    if (kf_attn_vectorised(p, 2, true))
      return kf_attention_fa2<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, WARPS, ROWS>(p, batch, stream);
  constexpr auto kernel = kf_attention_tc_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU>;
  constexpr int bytes_per_element = 2;
  constexpr int bytes = ((64 + 64) * (D + 8) + D * (64 + 8)) * 2;
  const cudaError_t opted = kf_attn_opt_in<kernel>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + 63) / 64;
  const bool vec = kf_attn_vectorised(p, bytes_per_element);
  kernel<<<(unsigned int)(tiles * (long long)batch * p.heads), 128, bytes, stream>>>(p, tiles, vec);
  return cudaGetLastError();
}
// ---- fp32 on tensor cores: TF32 (the tf32 policy) or 3xTF32 (SPLIT: big and small parts, three products, the
// arithmetic of torch's own fp32 SDPA kernel on sm_80+) with mma.sync m16n8k8 ----
__device__ __forceinline__ unsigned int kf_tf32(float x) {  // cvt.rna.tf32.f32: 10 mantissa bits, ties away
  const unsigned int u = __float_as_uint(x);
  return (u & 0x7f800000u) == 0x7f800000u ? u : (u + 0x1000u) & 0xffffe000u;
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

template <bool SPLIT>
__device__ __forceinline__ void kf_mma_f32(float (&d)[4], const float (&a)[4], float b0, float b1) {
  unsigned int big[4], bb0 = kf_tf32(b0), bb1 = kf_tf32(b1);
#pragma unroll
  for (int i = 0; i < 4; ++i) big[i] = kf_tf32(a[i]);
  if (SPLIT) {  // the small products first, then the big one: a * b ~ as * bb + ab * bs + ab * bb
    unsigned int small[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) small[i] = kf_tf32(a[i] - __uint_as_float(big[i]));
    kf_mma_tf32_1688(d, small, bb0, bb1);
    kf_mma_tf32_1688(d, big, kf_tf32(b0 - __uint_as_float(bb0)), kf_tf32(b1 - __uint_as_float(bb1)));
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
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk) {
      const float* row = qs + (r0 + g) * DP + kk * 8 + t;
      const float a[4] = {row[0], row[8 * DP], row[4], row[8 * DP + 4]};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* key = ks + (j * 8 + g) * DP + kk * 8 + t;
        kf_mma_f32<SPLIT>(s[j], a, key[0], key[4]);
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = q0 + r0 + g + (e >> 1) * 8, col = k0 + j * 8 + 2 * t + (e & 1);
        float x = s[j][e] * p.scale;
        if constexpr (MASK == 3)
          if (row < p.S && col < p.L) x += mask[row * p.sm[2] + col * p.sm[3]];
        s[j][e] = (valid >> (j * 4 + e) & 1u) ? x : -INFINITY;
        if (RELU) s[j][e] = s[j][e] > 0.0f || s[j][e] != s[j][e] ? s[j][e] : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
""" + _ONLINE_SOFTMAX + r"""#pragma unroll
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
        kf_mma_f32<SPLIT>(o[j], a, value[0], value[4]);
      }
    }
  }
  float* out = (float*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int j = 0; j < DT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = q0 + r0 + g + (e >> 1) * 8, d = j * 8 + 2 * t + (e & 1);
      const float sum = l[e >> 1];
      if (row < p.S)
        out[row * p.so[2] + d * p.so[3]] = RELU ? o[j][e] : sum > 0.0f ? o[j][e] / sum : EMPTY_NAN ? NAN : 0.0f;
    }
}

template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU, bool SPLIT>
cudaError_t kf_attention_tf32(const kf_attn_params& p, int batch, cudaStream_t stream) {
  constexpr auto kernel = kf_attention_tf32_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, RELU, SPLIT>;
  constexpr int bytes_per_element = 4;
  constexpr int bytes = ((64 + 64) * (D + 4) + D * (64 + 4)) * 4;
  const cudaError_t opted = kf_attn_opt_in<kernel>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + 63) / 64;
  const bool vec = kf_attn_vectorised(p, bytes_per_element);
  kernel<<<(unsigned int)(tiles * (long long)batch * p.heads), 128, bytes, stream>>>(p, tiles, vec);
  return cudaGetLastError();
}
"""
