"""The device helpers of the implicit-GEMM convolution (kernelfuse.codegen.conv_igemm): one k8 step of a warp's
tiles on TF32 tensor cores, split into three products where the convolution keeps fp32 accuracy."""

IGEMM_PRELUDE = r"""
// Implicit-GEMM convolutions (kernelfuse.codegen.conv_igemm), on codegen.tensorcore's helpers.
// *p = v where ok, as one predicated store: a plain `if` lets the compiler sink the value's loads and math into
// the branch, which serialises an unrolled epilogue's elements (kernelfuse.codegen.conv_geometry.tile_stores)
template <typename T> __device__ __forceinline__ void kf_store_if(T* p, T v, bool ok) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q st.b32 [%0], %1;\n}\n"
                 :: "l"(p), "r"(*reinterpret_cast<const unsigned*>(&v)), "r"((int)ok));
  } else if constexpr (sizeof(T) == 2) {
    asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q st.b16 [%0], %1;\n}\n"
                 :: "l"(p), "h"(*reinterpret_cast<const unsigned short*>(&v)), "r"((int)ok));
  } else if (ok) {
    *p = v;
  }
#else
  if (ok) *p = v;
#endif
}

// One k8 step of a warp's MF x NF tiles of m16n8 (rows wm.., columns wn..), operands from shared memory stored
// k-major (A[k][m], B[k][n]) as fp32 and rounded to TF32 as they enter the tensor cores. SPLIT (where eager's
// convolution computes in full fp32): each operand as kf_tf32_split's big and small TF32 parts, and three
// products (small x big, big x small, big x big) give fp32 accuracy (3xTF32). In the CPU emulation each lane
// computes the same accumulator elements with scalar FMAs on the same TF32 parts, in the same three passes, so
// tiling and epilogue are the ones the GPU runs.
template <int MF, int NF, bool SPLIT>
__device__ __forceinline__ void kf_igemm_k8(float (&acc)[MF][NF][4], const float* A, int lda, const float* B,
                                            int ldb, int wm, int wn) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__)
  unsigned int a[MF][4], b[NF][2], a_lo[SPLIT ? MF : 1][4], b_lo[SPLIT ? NF : 1][2];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float v = A[(t + (r >> 1) * 4) * lda + wm + i * 16 + g + (r & 1) * 8];
      if constexpr (SPLIT)
        kf_tf32_split(v, a[i][r], a_lo[i][r]);
      else
        a[i][r] = __float_as_uint(kf_round_tf32(v));
    }
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float v = B[(t + r * 4) * ldb + wn + j * 8 + g];
      if constexpr (SPLIT)
        kf_tf32_split(v, b[j][r], b_lo[j][r]);
      else
        b[j][r] = __float_as_uint(kf_round_tf32(v));
    }
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j) {
      if constexpr (SPLIT) {
        kf_mma_tf32(acc[i][j], a_lo[i], b[j]);
        kf_mma_tf32(acc[i][j], a[i], b_lo[j]);
      }
      kf_mma_tf32(acc[i][j], a[i], b[j]);
    }
#else
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = wm + i * 16 + g + (e >> 1) * 8, n = wn + j * 8 + 2 * t + (e & 1);
        float s = acc[i][j][e];
        for (int pass = SPLIT ? 0 : 2; pass < 3; ++pass)
          for (int k = 0; k < 8; ++k) {
            float hx, hy, lx = 0.0f, ly = 0.0f;  // SPLIT: kf_tf32_split's parts; else the TF32 roundings
            if (SPLIT) {
              kf_tf32_split_values(A[k * lda + m], hx, lx);
              kf_tf32_split_values(B[k * ldb + n], hy, ly);
            } else {
              hx = kf_round_tf32(A[k * lda + m]);
              hy = kf_round_tf32(B[k * ldb + n]);
            }
            s = fmaf(pass == 0 ? lx : hx, pass == 1 ? ly : hy, s);
          }
        acc[i][j][e] = s;
      }
#endif
}
"""
