"""CUDA device helpers the pointwise table's expressions call, one entry per helper (name -> source).

Each is self-contained (calls libm only, never another helper), so `prelude_for(rows)` can emit exactly the
helpers a kernel's rows name. They restate ATen's CUDA formulas (aten/src/ATen/native/cuda/Activation*.cu,
BinaryRemainderKernel.cu, BinaryDivFloorKernel.cu, BinaryMiscOpsKernels.cu) over float opmath values, keeping
its NaN behaviour: `std::max(a, b)` there is `a < b ? b : a`, which returns a NaN `a`; fmaxf would drop it. The
exception is mish, computed through an exact identity with fewer transcendentals (see its entry).
"""

from __future__ import annotations

HELPERS: dict[str, str] = {
    "kf_relu": "__device__ __forceinline__ float kf_relu(float x) { return x != x ? x : fmaxf(x, 0.0f); }",
    "kf_sigmoid": "__device__ __forceinline__ float kf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }",
    "kf_silu": "__device__ __forceinline__ float kf_silu(float x) { return x / (1.0f + expf(-x)); }",
    "kf_gelu_erf": "__device__ __forceinline__ float kf_gelu_erf(float x) "
                   "{ return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f)); }",
    "kf_gelu_tanh": r"""__device__ __forceinline__ float kf_gelu_tanh(float x) {
  const float k = 0.79788456080286535588f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}""",
    "kf_softplus": r"""__device__ __forceinline__ float kf_softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}""",
    # mish: x * tanh(softplus(x)) without softplus's threshold, as ActivationMishKernel.cu computes it, but through
    # the identity tanh(log1p(e)) = n / (n + 2), n = e (e + 2), e = exp(x): one expf and one division where ATen's
    # expf, log1pf and tanhf take 2.6x the instructions (PTX of mish(mish(x)), sm_90: 62 against 163), which counts
    # where a chain of them makes an epilogue pass compute-bound. Above 20 the ratio is 1 in float (e^2 would
    # overflow past 44): x itself, as ATen's tanhf gives. Max error against float64 over [-100, 100] equals
    # ATen's formula's (6.9e-7 at 9.01; relative 2.9e-7 against 2.2e-7); NaN and +-inf as ATen's.
    "kf_mish": r"""__device__ __forceinline__ float kf_mish(float x) {
  if (x > 20.0f) return x;
  const float e = expf(x), n = e * (e + 2.0f);
  return x * (n / (n + 2.0f));
}""",
    # elu (selu is elu with its constants) and celu: ATen passes negcoef = alpha * scale, poscoef = scale,
    # negiptcoef = input_scale
    "kf_elu": r"""__device__ __forceinline__ float kf_elu(float x, float negcoef, float poscoef, float negiptcoef) {
  return x > 0.0f ? x * poscoef : expm1f(x * negiptcoef) * negcoef;
}""",
    # relu6(x + 3) / 6 with std::min/std::max semantics (a NaN input stays NaN); 1/6 rounded to float as ATen does
    "kf_hardsigmoid": r"""__device__ __forceinline__ float kf_hardsigmoid(float x) {
  float t = x + 3.0f;
  t = t < 0.0f ? 0.0f : t;
  t = 6.0f < t ? 6.0f : t;
  return t * (1.0f / 6.0f);
}""",
    "kf_hardswish": r"""__device__ __forceinline__ float kf_hardswish(float x) {
  float t = x + 3.0f;
  t = t < 0.0f ? 0.0f : t;
  t = 6.0f < t ? 6.0f : t;
  return x * t * (1.0f / 6.0f);
}""",
    "kf_max": "__device__ __forceinline__ float kf_max(float a, float b) "
              "{ return (a != a || b != b) ? NAN : fmaxf(a, b); }",
    "kf_min": "__device__ __forceinline__ float kf_min(float a, float b) "
              "{ return (a != a || b != b) ? NAN : fminf(a, b); }",
    "kf_clamp": "__device__ __forceinline__ float kf_clamp(float x, float lo, float hi) "
                "{ return x != x ? x : fminf(fmaxf(x, lo), hi); }",
    # Python's modulo: the result takes the divisor's sign
    "kf_remainder": r"""__device__ __forceinline__ float kf_remainder(float a, float b) {
  float mod = fmodf(a, b);
  if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) mod += b;
  return mod;
}""",
    # floor division as c10's div_floor_floating: exact for the quotients that floorf(a / b) rounds wrongly
    "kf_div_floor": r"""__device__ __forceinline__ float kf_div_floor(float a, float b) {
  if (b == 0.0f) return a / b;
  const float mod = fmodf(a, b);
  float div = (a - mod) / b;
  if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) div -= 1.0f;
  if (div == 0.0f) return copysignf(0.0f, a / b);
  float floordiv = floorf(div);
  if (div - floordiv > 0.5f) floordiv += 1.0f;
  return floordiv;
}""",
    "kf_xlogy": r"""__device__ __forceinline__ float kf_xlogy(float x, float y) {
  if (y != y) return NAN;
  if (x == 0.0f) return 0.0f;
  return x * logf(y);
}""",
}
