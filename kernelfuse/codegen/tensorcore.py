"""What both tensor-core anchor kernels share (the implicit-GEMM convolutions of kernelfuse.codegen.conv_igemm and
conv_tc, the GEMM of kernelfuse.codegen.gemm_tc): TF32 rounding, asynchronous copies global -> shared, and the
m16n8k8 TF32 product. Each has a CPU path, so the tests' emulation runs the kernels built on them."""

from __future__ import annotations

# 3xTF32's operand split, shared by the GEMM, the implicit-GEMM convolution and the attention kernels (guarded: a file
# holding several of them defines it once). Measured on the d128 fp32 attention (stop 54): 1.40 -> 0.84 ms, the
# error 1.68e-6 -> 2.28e-6 against torch's efficient SDPA's 1.76e-6.
TF32_SPLIT = r"""#ifndef KF_TF32_SPLIT
#define KF_TF32_SPLIT
// 3xTF32's parts of an fp32 operand: x itself is the big part (the tensor cores read a TF32 operand's top 19 bits:
// they truncate it), the remainder under that truncation (exact) the small part, rounded to nearest through its bits
// (ties away, as cvt.rna). Four instructions where two cvt.rna take about ten on sm_90 (each a compare, an add, a
// mask and a select): the split was most of a 3xTF32 loop's issue slots. A NaN or infinity travels in the big part.
__device__ __forceinline__ void kf_tf32_split(float x, unsigned int& big, unsigned int& small) {
  big = __float_as_uint(x);
  const float rest = x - __uint_as_float(big & 0xffffe000u);
  small = (__float_as_uint(rest) + 0x1000u) & 0xffffe000u;
}
// the same parts as the values the tensor cores multiply (the CPU emulation's scalar products)
__device__ __forceinline__ void kf_tf32_split_values(float x, float& big, float& small) {
  unsigned int b, s;
  kf_tf32_split(x, b, s);
  big = __uint_as_float(b & 0xffffe000u);
  small = __uint_as_float(s);
}
#endif
"""

TENSORCORE_PRELUDE = TF32_SPLIT + r"""
// Tensor-core helpers (kernelfuse.codegen.tensorcore).
// TF32 rounding as the tensor cores' operand conversion does it: nearest, ties away from zero. The host form is
// what ptxas makes of cvt.rna.tf32.f32 (13.0, sm_80 and sm_90a SASS): half a TF32 ulp added where |x| < inf, then
// the low 13 bits cleared, NaNs too (a NaN whose payload is all in those bits becomes an infinity); a finite value
// from 0x7f7ff000 up rounds to infinity, as any value past the largest TF32 one by half its ulp or more.
__device__ __forceinline__ float kf_round_tf32(float x) {
#if defined(__CUDA_ARCH__)
  unsigned int r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
#else
  unsigned int u;
  __builtin_memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) < 0x7f800000u) u += 0x1000u;
  u &= 0xffffe000u;
  float r;
  __builtin_memcpy(&r, &u, 4);
  return r;
#endif
}

// 4-byte asynchronous copy global -> shared, zero-filled where !pred (src is then not read); in the CPU
// emulation a plain copy, and commit/wait do nothing (each copy is complete when it returns).
__device__ __forceinline__ void kf_cp_async4(float* dst, const float* src, bool pred) {
#if defined(__CUDA_ARCH__)
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(src), "r"(pred ? 4 : 0));
#else
  *dst = pred ? *src : 0.0f;
#endif
}
#ifndef KF_DYNAMIC_SHARED
#define KF_DYNAMIC_SHARED(name) extern __shared__ __align__(16) float name[]
#endif
// 16 bytes global -> shared, zeros where !in (src is then not read); in the CPU emulation a plain copy
__device__ __forceinline__ void kf_gemm_cp16(float* dst, const float* src, bool in) {
#if defined(__CUDA_ARCH__)
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(in ? 16 : 0));
#else
  for (int q = 0; q < 4; ++q) dst[q] = in ? src[q] : 0.0f;
#endif
}

__device__ __forceinline__ void kf_cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;");
#endif
}
// wait until at most N committed groups (the stages in flight) are still copying
template <int N> __device__ __forceinline__ void kf_cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// One m16n8k8 TF32 multiply-add on the tensor cores (fp32 accumulate).
__device__ __forceinline__ void kf_mma_tf32(float (&c)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

"""
