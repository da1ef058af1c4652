"""The attention kernels' shared CUDA (kernelfuse.codegen.attention instantiates the templates per step): the
parameter block, masks, tile loop and online softmax, and the fp32 FMA kernel. The tensor-core kernels that build on
them are kernelfuse.codegen.attention_mma (the first bf16 and the TF32 / 3xTF32 ones) and
kernelfuse.codegen.attention_flash. Kept apart from the launcher and binding code, as kernelfuse.codegen.reduce_prelude
is from the row kernels."""

# The online-softmax step both tensor-core kernels (bf16 and TF32) take after scoring a key tile: the row
# maximum and sum across the 4 lanes that share a row, the running output rescaled by the correction.
ONLINE_SOFTMAX = r"""
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

# 3xTF32's products of a key tile go to a fresh accumulator, added to the output with round-to-nearest: the tensor
# cores' fp32 accumulation truncates, so an output carried through every tile's products drifts toward zero (the
# GEMM's finding at stop 41; here twice eager's error on Llama's attention). Up to head dim 128 (registers).
FRESH_START = r"""    constexpr bool FRESH = SPLIT && D <= 128;
    float pv[FRESH ? DT : 1][4];  // this tile's products (FRESH), added to o below
#pragma unroll
    for (int j = 0; j < (FRESH ? DT : 0); ++j) pv[j][0] = pv[j][1] = pv[j][2] = pv[j][3] = 0.0f;
"""
# Likewise the scores over head dims 72 to 128: each 32 columns of d (four k-steps, twelve truncating additions under
# 3xTF32) in a fresh accumulator, added to the scores with round-to-nearest. Not at 64 and below, where the register
# cost (168 -> 215 at head dim 64: two blocks an SM instead of three) outweighs the error gained.
SCORE_CHUNKS = r"""    constexpr bool CHUNKED = SPLIT && D > 64 && D <= 128;
    float sc[CHUNKED ? NT : 1][4];  // this chunk's products (CHUNKED)
#pragma unroll
    for (int j = 0; j < (CHUNKED ? NT : 0); ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
"""
SCORE_CHUNK_END = r"""      if (CHUNKED && (kk % 4 == 3 || kk == DT - 1)) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          s[j][0] += sc[j][0]; s[j][1] += sc[j][1]; s[j][2] += sc[j][2]; s[j][3] += sc[j][3];
          sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        }
      }
"""
FRESH_END = r"""#pragma unroll
    for (int j = 0; j < (FRESH ? DT : 0); ++j) {
      o[j][0] += pv[j][0]; o[j][1] += pv[j][1]; o[j][2] += pv[j][2]; o[j][3] += pv[j][3];
    }
"""


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
  // a second additive mask (MASK 3 only), periodic over the batch: batch b adds window b % windows (0: none), its
  // strides over (window, head, row, col)
  const void* wmask; long long sw[4]; int windows;
  float cap_in, cap_out;  // Gemma 2's soft cap of the scaled scores (cap_out 0: none)
};

// A scaled score through the soft cap, as eager computes it: x * (1 / cap), tanh, * cap
__device__ __forceinline__ float kf_attn_softcap(const kf_attn_params& p, float x) {
  return p.cap_out != 0.0f ? tanhf(x * p.cap_in) * p.cap_out : x;
}

// An additive mask's element as a float: fp32, fp16, bf16 (raw bits in the tensor-core kernels: unsigned short)
__device__ __forceinline__ float kf_attn_mask_value(float x) { return x; }
__device__ __forceinline__ float kf_attn_mask_value(unsigned short x) { return __uint_as_float((unsigned int)x << 16); }
__device__ __forceinline__ float kf_attn_mask_value(__half x) { return kf_load(x); }
__device__ __forceinline__ float kf_attn_mask_value(__nv_bfloat16 x) { return kf_load(x); }

// The window mask's term of (row, col) for batch b (only where p.windows)
template <typename M>
__device__ __forceinline__ float kf_attn_window(const kf_attn_params& p, int b, int h, int row, int col) {
  return kf_attn_mask_value(((const M*)p.wmask)[(b % p.windows) * p.sw[0] + h * p.sw[1] + row * p.sw[2] +
                                                col * p.sw[3]]);
}

// The additive terms of (row, col): the mask's (`mask` at the batch's and head's base), and the window mask's
template <typename M>
__device__ __forceinline__ float kf_attn_additive(const kf_attn_params& p, const M* mask, int b, int h, int row,
                                                  int col) {
  float x = kf_attn_mask_value(mask[row * p.sm[2] + col * p.sm[3]]);
  if (p.windows) x += kf_attn_window<M>(p, b, h, row, col);
  return x;
}

// The tensor-core kernels' launch: KERNEL(p, tiles, flag) over every (batch, head) and `bq`-query tile, after its
// shared-memory opt-in
template <auto KERNEL>
cudaError_t kf_attn_launch(const kf_attn_params& p, int batch, int bq, int threads, int bytes, bool flag,
                           cudaStream_t stream) {
  const cudaError_t opted = kf_opt_in<KERNEL>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + bq - 1) / bq;
  KERNEL<<<(unsigned int)(tiles * (long long)batch * p.heads), threads, bytes, stream>>>(p, tiles, flag);
  return cudaGetLastError();
}

// Can the output take two columns (2 t, 2 t + 1) in one store of 2 x `size` bytes?
inline bool kf_attn_pairs(const kf_attn_params& p, int size) {
  return p.so[3] == 1 && p.so[0] % 2 == 0 && p.so[1] % 2 == 0 && p.so[2] % 2 == 0 && (uintptr_t)p.out % (2 * size) == 0;
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
        float x = kf_attn_softcap(p, s[r][c] * p.scale);
        if constexpr (MASK == 3)
          if (row < p.S && k0 + c0 + c < p.L) x += kf_attn_additive(p, mask, b, h, row, k0 + c0 + c);
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
            kf_store<T>(RELU ? o[r][j] : l[r] != 0.0f ? o[r][j] / l[r] : EMPTY_NAN ? NAN : 0.0f);
    }
  }
}

template <typename T, typename M, int D, int BQ, int BK, int MASK, bool CAUSAL, bool EMPTY_NAN, bool RELU>
cudaError_t kf_attention(const kf_attn_params& p, int batch, cudaStream_t stream) {
  constexpr auto kernel = kf_attention_kernel<T, M, D, BQ, BK, MASK, CAUSAL, EMPTY_NAN, RELU>;
  const int bytes = kf_attn_tile<D, BQ, BK>::FLOATS * (int)sizeof(float);
  const cudaError_t opted = kf_opt_in<kernel>(bytes);
  if (opted != cudaSuccess) return opted;
  const int tiles = (p.S + BQ - 1) / BQ;
  kernel<<<(unsigned int)(tiles * (long long)batch * p.heads), 128, bytes, stream>>>(p, tiles);
  return cudaGetLastError();
}"""  # the emitted file continues with attention_mma's text on the next line
