"""The pointwise op table: one row per ATen op — its IR name, its CUDA expression and its torch reference.

Adding a pointwise op is one row here plus a test (tests/test_ops_table.py checks every row's CUDA expression
against its torch reference on the CPU through the plan interpreter, and compiles it with nvcc).

CUDA expressions are written over float "opmath" values `{0}`, `{1}` (operands) and `{p0}`, `{p1}` (constant
parameters, rendered as float literals). They follow ATen's CUDA formulas so results match eager bit-for-bit or
within rounding: precise libm calls (expf, erff, tanhf, log1pf), NaN propagated where ATen propagates it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Device helpers the expressions call; emitted once at the top of every translation unit that uses the table.
CUDA_PRELUDE = r"""
__device__ __forceinline__ float kf_relu(float x) { return x != x ? x : fmaxf(x, 0.0f); }
__device__ __forceinline__ float kf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float kf_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float kf_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f)); }
__device__ __forceinline__ float kf_gelu_tanh(float x) {
  const float k = 0.79788456080286535588f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float kf_softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}
__device__ __forceinline__ float kf_max(float a, float b) { return (a != a || b != b) ? NAN : fmaxf(a, b); }
__device__ __forceinline__ float kf_min(float a, float b) { return (a != a || b != b) ? NAN : fminf(a, b); }
__device__ __forceinline__ float kf_clamp(float x, float lo, float hi) { return x != x ? x : fminf(fmaxf(x, lo), hi); }
"""


@dataclass(frozen=True)
class PointwiseOp:
    """One ATen overload that the epilogue compiler can fuse.

    `operands` are the positions of tensor-or-scalar arguments; `params` are (position, default) of constant
    arguments that become float literals. `cuda` is the expression template; `torch_fn(*operands, *params)` is
    the reference the CPU interpreter runs.
    """

    aten: str
    ir: str
    operands: tuple[int, ...]
    cuda: str
    torch_fn: Callable[..., torch.Tensor]
    params: tuple[tuple[int, object], ...] = ()


def _row(aten: str, ir: str, cuda: str, fn: Callable, operands=(0,), params=()) -> PointwiseOp:
    return PointwiseOp(aten, ir, tuple(operands), cuda, fn, tuple(params))


POINTWISE_OPS: tuple[PointwiseOp, ...] = (
    # unary activations
    _row("relu.default", "relu", "kf_relu({0})", torch.relu),
    _row("sigmoid.default", "sigmoid", "kf_sigmoid({0})", torch.sigmoid),
    _row("tanh.default", "tanh", "tanhf({0})", torch.tanh),
    _row("silu.default", "silu", "kf_silu({0})", torch.nn.functional.silu),
    _row("exp.default", "exp", "expf({0})", torch.exp),
    _row("log.default", "log", "logf({0})", torch.log),
    _row("neg.default", "neg", "(-{0})", torch.neg),
    _row("abs.default", "abs", "fabsf({0})", torch.abs),
    _row("sqrt.default", "sqrt", "sqrtf({0})", torch.sqrt),
    _row("rsqrt.default", "rsqrt", "rsqrtf({0})", torch.rsqrt),
    _row("gelu.default", "gelu", "GELU", lambda x, approximate: torch.nn.functional.gelu(x, approximate=approximate),
         params=(("approximate", "none"),)),  # keyword-only in the ATen schema
    _row("softplus.default", "softplus", "kf_softplus({0}, {p0}, {p1})",
         lambda x, beta, threshold: torch.nn.functional.softplus(x, beta, threshold), params=((1, 1.0), (2, 20.0))),
    _row("leaky_relu.default", "leaky_relu", "({0} > 0.0f ? {0} : {0} * {p0})",
         lambda x, slope: torch.nn.functional.leaky_relu(x, slope), params=((1, 0.01),)),
    _row("hardtanh.default", "hardtanh", "kf_clamp({0}, {p0}, {p1})",
         lambda x, lo, hi: torch.nn.functional.hardtanh(x, lo, hi), params=((1, -1.0), (2, 1.0))),
    _row("clamp.default", "clamp", "kf_clamp({0}, {p0}, {p1})", lambda x, lo, hi: torch.clamp(x, lo, hi),
         params=((1, -math.inf), (2, math.inf))),
    # binary arithmetic: operands may be tensors or Python scalars
    _row("add.Tensor", "add", "({0} + {p0} * {1})", lambda a, b, alpha: torch.add(a, b, alpha=alpha),
         operands=(0, 1), params=(("alpha", 1.0),)),
    _row("sub.Tensor", "sub", "({0} - {p0} * {1})", lambda a, b, alpha: torch.sub(a, b, alpha=alpha),
         operands=(0, 1), params=(("alpha", 1.0),)),
    _row("mul.Tensor", "mul", "({0} * {1})", torch.mul, operands=(0, 1)),
    _row("div.Tensor", "div", "({0} / {1})", torch.div, operands=(0, 1)),
    _row("maximum.default", "maximum", "kf_max({0}, {1})", torch.maximum, operands=(0, 1)),
    _row("minimum.default", "minimum", "kf_min({0}, {1})", torch.minimum, operands=(0, 1)),
)

POINTWISE_BY_ATEN: dict[str, PointwiseOp] = {row.aten: row for row in POINTWISE_OPS}


def render_cuda(op: PointwiseOp, operands: list[str], params: list[object]) -> str:
    """The C expression for one application of `op` to operand expressions and constant params."""
    if op.ir == "gelu":
        return f"kf_gelu_tanh({operands[0]})" if params[0] == "tanh" else f"kf_gelu_erf({operands[0]})"
    text = op.cuda.replace("{p0} * ", "") if op.ir in ("add", "sub") and float(params[0]) == 1.0 else op.cuda  # type: ignore[arg-type]
    for i, p in enumerate(params):
        text = text.replace(f"{{p{i}}}", float_literal(float(p)))  # type: ignore[arg-type]
    for i, o in enumerate(operands):
        text = text.replace(f"{{{i}}}", o)
    return text


def float_literal(value: float) -> str:
    """A float (fp32) literal: ATen converts Python scalars to the float opmath type before use."""
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    f32 = torch.tensor(value, dtype=torch.float32).item()
    text = repr(f32)
    if "e" not in text and "." not in text:
        text += ".0"
    return f"{text}f" if not text.startswith("-") else f"({text}f)"
