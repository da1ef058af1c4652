"""The CUDA device helpers every row, split and pool kernel shares (kernelfuse.codegen.reduce renders the kernels):
NaN-propagating max/min, the row-wide combine of one value or a tuple of partial statistics (warp shuffles, then
the block's warps in a fixed order), the one-pass online softmax statistics and Welford's mean and squared
deviations with Chan's merge."""

REDUCE_PRELUDE = r"""
struct kf_sum_op { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct kf_prod_op { __device__ __forceinline__ float operator()(float a, float b) const { return a * b; } };
// NaN-propagating max/min: one max.NaN/min.NaN instruction on sm_80+ (the comparisons otherwise: four)
struct kf_max_op { __device__ __forceinline__ float operator()(float a, float b) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return (a != a || b != b) ? NAN : fmaxf(a, b);
#endif
} };
struct kf_min_op { __device__ __forceinline__ float operator()(float a, float b) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return (a != a || b != b) ? NAN : fminf(a, b);
#endif
} };
// log(exp(a) + exp(b)) as ATen's logcumsumexp combines: NaN propagates, equal infinities return a
struct kf_logaddexp_op { __device__ __forceinline__ float operator()(float a, float b) const {
  const float lo = b != b ? b : (b < a ? b : a), hi = b != b ? b : (a < b ? b : a);
  return (lo != hi || isfinite(lo)) ? hi + log1pf(expf(lo - hi)) : a; } };

// Combine `v` across the TPR threads of a row (TPR 1: the thread owns the row; up to 32: that many neighbouring
// lanes of a warp, a row to each aligned group of them; else the block).
template <int TPR, typename Op>
__device__ __forceinline__ float kf_row_reduce(float v, Op op) {
  if (TPR == 1) return v;
#pragma unroll
  for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (TPR <= 32) return v;
  __shared__ float kf_smem[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with kf_smem
  if (lane == 0) kf_smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {  // one thread combines the warps' results, in a fixed order
    float w = kf_smem[0];
#pragma unroll
    for (int j = 1; j < TPR / 32; ++j) w = op(w, kf_smem[j]);
    kf_smem[0] = w;
  }
  __syncthreads();
  return kf_smem[0];
}
// A row's (max m, sum s of exp(x - m)) in one pass: a new max rescales the sum so far ("online" softmax). An
// element equal to -inf adds 0 (exp(-inf - -inf) would be NaN); +inf or NaN make s NaN, as ATen's two passes do.
__device__ __forceinline__ void kf_online_add(float& m, float& s, float x) {
  const float mn = kf_max_op()(m, x);
  if (mn != m) { s *= expf(m - mn); m = mn; }
  s += (x == -INFINITY) ? 0.0f : expf(x - m);
}
__device__ __forceinline__ void kf_online_merge(float& m, float& s, float m2, float s2) {
  const float mn = kf_max_op()(m, m2);
  const float a = (m == mn) ? s : s * expf(m - mn);
  const float b = (m2 == mn) ? s2 : s2 * expf(m2 - mn);
  m = mn;
  s = a + b;
}
// Welford: a row's count n, mean and sum m2 of squared deviations in one pass (ATen's CUDA norms use it too);
// two partial rows merge by Chan's formula.
__device__ __forceinline__ void kf_welford_add(float& n, float& mean, float& m2, float x) {
  n += 1.0f;
  const float d = x - mean;
  mean += d / n;
  m2 += d * (x - mean);
}
__device__ __forceinline__ void kf_welford_merge(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  const float total = n + nb;
  if (total == 0.0f) return;
  const float d = meanb - mean, wb = nb / total;
  mean += d * wb;
  m2 += m2b + d * d * n * wb;
  n = total;
}
// four elements at once: their own mean and m2 merged by Chan's formula, one division for the four (a division per
// element made a long row's pass issue-bound: 1.3 TB/s on an H200 for a batch norm's statistics)
__device__ __forceinline__ void kf_welford_add4(float& n, float& mean, float& m2, float a, float b, float c, float d) {
  const float mb = ((a + b) + (c + d)) * 0.25f;
  const float da = a - mb, db = b - mb, dc = c - mb, dd = d - mb;
  kf_welford_merge(n, mean, m2, 4.0f, mb, (da * da + db * db) + (dc * dc + dd * dd));
}
// kf_row_reduce for a tuple of partial statistics: each lane's (a, b, c) merged with MERGE in a fixed order.
template <int TPR, typename Merge>
__device__ __forceinline__ void kf_row_reduce3(float& a, float& b, float& c, Merge merge) {
  if (TPR == 1) return;
#pragma unroll
  for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) {
    const float a2 = __shfl_xor_sync(0xffffffffu, a, o), b2 = __shfl_xor_sync(0xffffffffu, b, o),
                c2 = __shfl_xor_sync(0xffffffffu, c, o);
    merge(a, b, c, a2, b2, c2);
  }
  if (TPR <= 32) return;
  __shared__ float kf_smem3[3][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { kf_smem3[0][warp] = a; kf_smem3[1][warp] = b; kf_smem3[2][warp] = c; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float wa = kf_smem3[0][0], wb = kf_smem3[1][0], wc = kf_smem3[2][0];
#pragma unroll
    for (int j = 1; j < TPR / 32; ++j) merge(wa, wb, wc, kf_smem3[0][j], kf_smem3[1][j], kf_smem3[2][j]);
    kf_smem3[0][0] = wa; kf_smem3[1][0] = wb; kf_smem3[2][0] = wc;
  }
  __syncthreads();
  a = kf_smem3[0][0]; b = kf_smem3[1][0]; c = kf_smem3[2][0];
}
struct kf_online_merge3 {
  __device__ __forceinline__ void operator()(float& m, float& s, float&, float m2, float s2, float) const {
    kf_online_merge(m, s, m2, s2);
  }
};
struct kf_welford_merge3 {
  __device__ __forceinline__ void operator()(float& n, float& mean, float& m2, float nb, float meanb,
                                             float m2b) const {
    kf_welford_merge(n, mean, m2, nb, meanb, m2b);
  }
};
template <int TPR>
__device__ __forceinline__ void kf_row_reduce_online(float& m, float& s) {
  float unused = 0.0f;
  kf_row_reduce3<TPR>(m, s, unused, kf_online_merge3());
}
template <int TPR>
__device__ __forceinline__ void kf_row_reduce_welford(float& n, float& mean, float& m2) {
  kf_row_reduce3<TPR>(n, mean, m2, kf_welford_merge3());
}
"""
