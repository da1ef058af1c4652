"""The pointwise op table: one row per ATen op — its IR name, its CUDA expression and its torch reference.

Adding a pointwise op is one row here plus a test (tests/test_ops_table_fusion.py checks every row against its
torch reference on the CPU through the plan interpreter and compiles it with nvcc; tests/test_ops_table_expressions.py
checks every row's CUDA expression element by element on the host and, on a GPU, against ATen's own kernel).

CUDA expressions are written over float "opmath" values `{0}`, `{1}` (operands) and `{p0}`, `{p1}` (constant
parameters, rendered as float literals). They follow ATen's CUDA formulas so results match eager bit-for-bit or
within rounding: precise libm calls (expf, erff, tanhf, log1pf), NaN propagated where ATen propagates it. A row
whose expression depends on a parameter's value (gelu's approximation, pow's exponent, elu's folded constants)
renders through its `render` function. Device helpers the expressions call live in pointwise_helpers.HELPERS;
each row names the ones it uses, so `prelude_for(rows)` emits only those.

Bool values (comparison results, where/masked_fill conditions) are carried as float 1.0f / 0.0f. Such rows say so
(`result="bool"`, `bool_args`). The scheduler fuses a comparison only as an in-kernel condition: computed from
float values in the same kernel as the where/masked_fill that reads it, never loaded from or stored to a bool
tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernelfuse.ops.pointwise_helpers import HELPERS

aten = torch.ops.aten


@dataclass(frozen=True)
class PointwiseOp:
    """One ATen overload that the epilogue compiler can fuse.

    `operands` are the positions of tensor-or-scalar arguments; `params` are (position, default) of constant
    arguments that become float literals. `cuda` is the expression template; `torch_fn(*operands, *params)` is
    the reference the CPU interpreter runs. `helpers` are the device functions of pointwise_helpers the
    expression calls; `render(operands, params)` replaces the template where the expression depends on a
    parameter's value; `result` is "bool" for comparisons; `bool_args` are the operand positions read as bool;
    `keywords`, where given, are the keyword arguments a call must have, exactly (a cast that also moves the
    tensor to a device or a layout is no pointwise op).
    """

    aten: str
    ir: str
    operands: tuple[int, ...]
    cuda: str
    torch_fn: Callable[..., torch.Tensor]
    params: tuple[tuple[int | str, object], ...] = ()
    helpers: tuple[str, ...] = ()
    render: Callable[[list[str], list[object]], str] | None = None
    result: str = "float"
    bool_args: tuple[int, ...] = ()
    keywords: tuple[str, ...] | None = None


def _row(aten_name: str, ir: str, cuda: str, fn: Callable, operands=(0,), params=(), helpers=(), render=None,
         result: str = "float", bool_args=(), keywords=None) -> PointwiseOp:
    return PointwiseOp(aten_name, ir, tuple(operands), cuda, fn, tuple(params), tuple(helpers), render, result,
                       tuple(bool_args), keywords)


def _f32(value: object) -> float:
    """A Python scalar as ATen's `Scalar.to<float>()` sees it."""
    return torch.tensor(float(value), dtype=torch.float32).item()  # type: ignore[arg-type]


def _alpha(sign: str) -> Callable[[list[str], list[object]], str]:
    """add/sub: `a + alpha * b`, written `a + b` when alpha is 1 (the product is exact, so this is the same)."""
    def render(ops: list[str], params: list[object]) -> str:
        alpha = float(params[0])  # type: ignore[arg-type]
        return f"({ops[0]} {sign} {ops[1]})" if alpha == 1.0 else f"({ops[0]} {sign} {float_literal(alpha)} * {ops[1]})"
    return render


def _gelu(ops: list[str], params: list[object]) -> str:
    return f"kf_gelu_tanh({ops[0]})" if params[0] == "tanh" else f"kf_gelu_erf({ops[0]})"


def _elu_call(x: str, alpha: object, scale: object, input_scale: object) -> str:
    """ATen folds alpha * scale in float before the kernel runs; so does this. (selu reaches the graph as elu.)"""
    negcoef = (torch.tensor(_f32(alpha)) * torch.tensor(_f32(scale))).item()
    return f"kf_elu({x}, {float_literal(negcoef)}, {float_literal(scale)}, {float_literal(input_scale)})"  # type: ignore[arg-type]


def _pow_scalar(ops: list[str], params: list[object]) -> str:
    """PowKernel.cu special-cases these exponents (sqrt, products, reciprocals); any other one is powf."""
    x, e = ops[0], _f32(params[0])
    special = {0.5: f"sqrtf({x})", 2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})", -0.5: f"(1.0f / sqrtf({x}))",
               -1.0: f"(1.0f / {x})", -2.0: f"(1.0f / ({x} * {x}))"}
    return special.get(e, f"powf({x}, {float_literal(e)})")


def _div_scalar(ops: list[str], params: list[object]) -> str:
    """A division by a scalar is a product with its reciprocal, rounded to float (BinaryDivTrueKernel.cu)."""
    inverse = (torch.tensor(1.0) / torch.tensor(_f32(params[0]))).item()
    return f"({ops[0]} * {float_literal(inverse)})"


def _div_mode(ops: list[str], params: list[object]) -> str:
    a, b = ops
    return {"trunc": f"truncf({a} / {b})", "floor": f"kf_div_floor({a}, {b})"}.get(str(params[0]), f"({a} / {b})")


def _compare(symbol: str, fn: Callable) -> tuple:
    return (f"(({{0}} {symbol} {{1}}) ? 1.0f : 0.0f)", fn)


POINTWISE_OPS: tuple[PointwiseOp, ...] = (
    # ---- activations
    _row("relu.default", "relu", "kf_relu({0})", torch.relu, helpers=("kf_relu",)),
    _row("sigmoid.default", "sigmoid", "kf_sigmoid({0})", torch.sigmoid, helpers=("kf_sigmoid",)),
    _row("tanh.default", "tanh", "tanhf({0})", torch.tanh),
    _row("silu.default", "silu", "kf_silu({0})", torch.nn.functional.silu, helpers=("kf_silu",)),
    _row("gelu.default", "gelu", "kf_gelu_erf({0})",
         lambda x, approximate: torch.nn.functional.gelu(x, approximate=approximate),
         params=(("approximate", "none"),), helpers=("kf_gelu_erf", "kf_gelu_tanh"), render=_gelu),  # keyword-only
    _row("softplus.default", "softplus", "kf_softplus({0}, {p0}, {p1})",
         lambda x, beta, threshold: torch.nn.functional.softplus(x, beta, threshold), params=((1, 1.0), (2, 20.0)),
         helpers=("kf_softplus",)),
    _row("mish.default", "mish", "kf_mish({0})", aten.mish.default, helpers=("kf_mish",)),
    _row("leaky_relu.default", "leaky_relu", "({0} > 0.0f ? {0} : {0} * {p0})",
         lambda x, slope: torch.nn.functional.leaky_relu(x, slope), params=((1, 0.01),)),
    _row("elu.default", "elu", "kf_elu({0}, {p0} * {p1}, {p1}, {p2})", aten.elu.default,
         params=((1, 1.0), (2, 1.0), (3, 1.0)), helpers=("kf_elu",), render=lambda o, p: _elu_call(o[0], *p)),
    _row("celu.default", "celu", "kf_elu({0}, {p0}, 1, 1 / {p0})", aten.celu.default, params=((1, 1.0),),
         helpers=("kf_elu",), render=lambda o, p: _elu_call(o[0], p[0], 1.0, 1.0 / float(p[0]))),  # type: ignore[arg-type]
    _row("hardsigmoid.default", "hardsigmoid", "kf_hardsigmoid({0})", aten.hardsigmoid.default,
         helpers=("kf_hardsigmoid",)),
    _row("hardswish.default", "hardswish", "kf_hardswish({0})", aten.hardswish.default, helpers=("kf_hardswish",)),
    _row("threshold.default", "threshold", "({0} <= {p0} ? {p1} : {0})", aten.threshold.default,
         params=((1, 0.0), (2, 0.0))),
    # ---- clamps
    _row("hardtanh.default", "hardtanh", "kf_clamp({0}, {p0}, {p1})",
         lambda x, lo, hi: torch.nn.functional.hardtanh(x, lo, hi), params=((1, -1.0), (2, 1.0)),
         helpers=("kf_clamp",)),
    _row("clamp.default", "clamp", "kf_clamp({0}, {p0}, {p1})", lambda x, lo, hi: torch.clamp(x, lo, hi),
         params=((1, -math.inf), (2, math.inf)), helpers=("kf_clamp",)),
    _row("clamp_min.default", "clamp_min", "kf_clamp({0}, {p0}, INFINITY)", aten.clamp_min.default,
         params=((1, -math.inf),), helpers=("kf_clamp",)),
    _row("clamp_max.default", "clamp_max", "kf_clamp({0}, (-INFINITY), {p0})", aten.clamp_max.default,
         params=((1, math.inf),), helpers=("kf_clamp",)),
    # ---- unary math (precise libm)
    _row("exp.default", "exp", "expf({0})", torch.exp),
    _row("exp2.default", "exp2", "exp2f({0})", torch.exp2),
    _row("expm1.default", "expm1", "expm1f({0})", torch.expm1),
    _row("log.default", "log", "logf({0})", torch.log),
    _row("log1p.default", "log1p", "log1pf({0})", torch.log1p),
    _row("log2.default", "log2", "log2f({0})", torch.log2),
    _row("log10.default", "log10", "log10f({0})", torch.log10),
    _row("sin.default", "sin", "sinf({0})", torch.sin),
    _row("cos.default", "cos", "cosf({0})", torch.cos),
    _row("erf.default", "erf", "erff({0})", torch.erf),
    _row("erfinv.default", "erfinv", "erfinvf({0})", torch.erfinv),
    _row("neg.default", "neg", "(-{0})", torch.neg),
    _row("abs.default", "abs", "fabsf({0})", torch.abs),
    _row("sqrt.default", "sqrt", "sqrtf({0})", torch.sqrt),
    _row("rsqrt.default", "rsqrt", "rsqrtf({0})", torch.rsqrt),
    _row("reciprocal.default", "reciprocal", "(1.0f / {0})", torch.reciprocal),
    _row("sign.default", "sign", "((float)((0.0f < {0}) - ({0} < 0.0f)))", torch.sign),  # sign(NaN) is 0 on CUDA
    _row("floor.default", "floor", "floorf({0})", torch.floor),
    _row("ceil.default", "ceil", "ceilf({0})", torch.ceil),
    _row("round.default", "round", "nearbyintf({0})", torch.round),  # half to even
    _row("trunc.default", "trunc", "truncf({0})", torch.trunc),
    _row("clone.default", "clone", "{0}", lambda x: x.clone()),  # layout is the plan's business, not the value's
    # a cast between float dtypes (autocast's, `.float()`): the value itself; the statement's dtype rounds it
    _row("_to_copy.default", "cast", "{0}", lambda x, dtype: x.to(dtype), params=(("dtype", None),),
         render=lambda ops, params: ops[0], keywords=("dtype",)),
    _row("pow.Tensor_Scalar", "pow", "powf({0}, {p0})", aten.pow.Tensor_Scalar, params=((1, 1.0),),
         render=_pow_scalar),
    # ---- binary arithmetic: operands may be tensors or Python scalars
    _row("add.Tensor", "add", "({0} + {p0} * {1})", lambda a, b, alpha: torch.add(a, b, alpha=alpha),
         operands=(0, 1), params=(("alpha", 1.0),), render=_alpha("+")),
    _row("sub.Tensor", "sub", "({0} - {p0} * {1})", lambda a, b, alpha: torch.sub(a, b, alpha=alpha),
         operands=(0, 1), params=(("alpha", 1.0),), render=_alpha("-")),
    _row("mul.Tensor", "mul", "({0} * {1})", torch.mul, operands=(0, 1)),
    _row("div.Tensor", "div", "({0} / {1})", torch.div, operands=(0, 1)),
    _row("add.Scalar", "add", "({0} + {p0} * {1})", aten.add.Scalar, operands=(0, 1), params=((2, 1.0),),
         render=_alpha("+")),
    _row("sub.Scalar", "sub", "({0} - {p0} * {1})", aten.sub.Scalar, operands=(0, 1), params=((2, 1.0),),
         render=_alpha("-")),
    _row("rsub.Scalar", "rsub", "({1} - {p0} * {0})", aten.rsub.Scalar, operands=(0, 1), params=((2, 1.0),),
         render=lambda o, p: _alpha("-")([o[1], o[0]], p)),
    _row("mul.Scalar", "mul", "({0} * {1})", aten.mul.Scalar, operands=(0, 1)),
    _row("div.Scalar", "div", "({0} * (1 / {p0}))", aten.div.Scalar, params=((1, 1.0),), render=_div_scalar),
    _row("div.Tensor_mode", "div_mode", "({0} / {1}) rounded by {p0}",
         lambda a, b, mode: torch.div(a, b, rounding_mode=mode), operands=(0, 1), params=(("rounding_mode", None),),
         helpers=("kf_div_floor",), render=_div_mode),
    _row("floor_divide.default", "floor_divide", "kf_div_floor({0}, {1})", torch.floor_divide, operands=(0, 1),
         helpers=("kf_div_floor",)),
    _row("remainder.Tensor", "remainder", "kf_remainder({0}, {1})", torch.remainder, operands=(0, 1),
         helpers=("kf_remainder",)),
    _row("remainder.Scalar", "remainder", "kf_remainder({0}, {1})", aten.remainder.Scalar, operands=(0, 1),
         helpers=("kf_remainder",)),
    _row("fmod.Tensor", "fmod", "fmodf({0}, {1})", torch.fmod, operands=(0, 1)),
    _row("fmod.Scalar", "fmod", "fmodf({0}, {1})", aten.fmod.Scalar, operands=(0, 1)),
    _row("pow.Tensor_Tensor", "pow", "powf({0}, {1})", aten.pow.Tensor_Tensor, operands=(0, 1)),
    _row("xlogy.Tensor", "xlogy", "kf_xlogy({0}, {1})", torch.xlogy, operands=(0, 1), helpers=("kf_xlogy",)),
    _row("maximum.default", "maximum", "kf_max({0}, {1})", torch.maximum, operands=(0, 1), helpers=("kf_max",)),
    _row("minimum.default", "minimum", "kf_min({0}, {1})", torch.minimum, operands=(0, 1), helpers=("kf_min",)),
    # ---- bool results and conditions (carried as 1.0f / 0.0f; see the module docstring)
    *(_row(f"{name}.{overload}", name, *_compare(symbol, getattr(getattr(aten, name), overload)), operands=(0, 1),
           result="bool")
      for name, symbol in (("gt", ">"), ("lt", "<"), ("ge", ">="), ("le", "<="), ("eq", "=="), ("ne", "!="))
      for overload in ("Tensor", "Scalar")),
    _row("where.self", "where", "({0} != 0.0f ? {1} : {2})", aten.where.self, operands=(0, 1, 2), bool_args=(0,)),
    _row("masked_fill.Scalar", "masked_fill", "({1} != 0.0f ? {p0} : {0})", aten.masked_fill.Scalar,
         operands=(0, 1), params=((2, 0.0),), bool_args=(1,)),
)

POINTWISE_BY_ATEN: dict[str, PointwiseOp] = {row.aten: row for row in POINTWISE_OPS}


def prelude_for(rows: Iterable[PointwiseOp]) -> str:
    """The device helpers `rows` call, each once, in HELPERS order: what a kernel file needs, nothing more."""
    wanted = {name for row in rows for name in row.helpers}
    return "\n".join(source for name, source in HELPERS.items() if name in wanted) + "\n"


# Every helper, for translation units that do not pick (kept for callers that emit the whole table's prelude).
CUDA_PRELUDE = "\n" + prelude_for(POINTWISE_OPS)


def render_cuda(op: PointwiseOp, operands: list[str], params: list[object]) -> str:
    """The C expression for one application of `op` to operand expressions and constant params."""
    if op.render is not None:
        return op.render(operands, params)
    text = op.cuda
    for i, p in enumerate(params):
        text = text.replace(f"{{p{i}}}", float_literal(float(p)))  # type: ignore[arg-type]
    for i, o in enumerate(operands):
        text = text.replace(f"{{{i}}}", o)
    return text


def float_literal(value: float) -> str:
    """A float (fp32) literal: ATen converts Python scalars to the float opmath type before use."""
    f32 = _f32(value)  # past float's range it rounds to an infinity, as ATen's conversion does
    if math.isnan(f32):
        return "NAN"
    if math.isinf(f32):
        return "INFINITY" if f32 > 0 else "(-INFINITY)"
    text = repr(f32)
    if "e" not in text and "." not in text:
        text += ".0"
    return f"{text}f" if not text.startswith("-") else f"({text}f)"
