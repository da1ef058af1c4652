"""The fuzzer's op vocabulary: each kind draws size-independent parameters and renders them against the shapes it
is given, so a shrunk model (smaller dims, ops dropped) re-renders the same ops at the new sizes.

`render` returns the constructor lines (`{m}` is the op's attribute prefix) and the forward expression (`{a0}`,
`{a1}`: the operands); it raises `Invalid` where the shapes do not fit (the generator then draws another op).
Only ops eager runs on the CPU in every dtype are kept: the generator executes each one as it draws it.
What a kind is: kernelfuse.fuzz.kind; the layer kinds (norms, linear, attention, convolution, pooling):
kernelfuse.fuzz.layers; the growing concatenation (a DenseNet block's): kernelfuse.fuzz.catchain; a small CNN
body (convolutions reading each other's outputs): kernelfuse.fuzz.cnnstack.
"""

from __future__ import annotations

import math
import random

from kernelfuse.fuzz.catchain import draw_cat_chain, render_cat_chain
from kernelfuse.fuzz.cnnstack import draw_cnn_stack, render_cnn_stack
from kernelfuse.fuzz.kind import Invalid, Kind, Params, Shape
from kernelfuse.fuzz.layers import (
    draw_attention,
    draw_conv,
    draw_linear,
    draw_norm,
    draw_pool,
    render_attention,
    render_conv,
    render_linear,
    render_matmul_pair,
    render_norm,
    render_pool,
)

UNARY = (
    "torch.relu({a0})", "torch.sigmoid({a0})", "torch.tanh({a0})", "F.silu({a0})", "F.gelu({a0})",
    "F.gelu({a0}, approximate='tanh')", "F.softplus({a0})", "F.mish({a0})", "F.leaky_relu({a0}, 0.1)",
    "F.elu({a0})", "F.selu({a0})", "F.celu({a0}, 0.5)", "F.hardsigmoid({a0})", "F.hardswish({a0})",
    "F.hardtanh({a0}, -0.5, 0.5)", "torch.clamp({a0}, -1.0, 2.0)", "torch.clamp_min({a0}, 0.25)",
    "torch.clamp_max({a0}, 0.5)", "torch.exp({a0})", "torch.expm1({a0})", "torch.log({a0})", "torch.log1p({a0})",
    "torch.sqrt({a0})", "torch.rsqrt({a0})", "torch.reciprocal({a0})", "torch.abs({a0})", "-{a0}",
    "torch.sign({a0})", "torch.floor({a0})", "torch.ceil({a0})", "torch.round({a0})", "torch.trunc({a0})",
    "torch.sin({a0})", "torch.cos({a0})", "torch.erf({a0})", "{a0} * 2.5", "{a0} + 1.0", "{a0} / 3.0",
    "{a0} ** 2", "{a0} ** 0.5", "{a0} - 0.5", "1.0 - {a0}", "torch.where({a0} > 0, {a0}, {a0} * 0.01)",
    "{a0}.masked_fill({a0} < -1.0, 0.0)", "torch.exp2({a0})", "torch.log2({a0})", "torch.pow({a0}, 3)",
    "F.threshold({a0}, 0.1, -1.0)", "torch.remainder({a0}, 0.7)", "torch.fmod({a0}, 0.7)", "{a0} // 0.5",
    "F.relu6({a0})", "F.logsigmoid({a0})", "torch.square({a0})", "2.0 ** {a0}", "torch.nan_to_num({a0})",
    "{a0}.float()", "torch.clamp({a0}, min=-2.0)", "{a0} * 1e-3 + 60000.0",
    "({a0}.float() * 1.5).to({a0}.dtype)",  # in fp16/bf16: a cast each way inside one kernel
    # in fp16/bf16: a half-precision source meeting an fp32 operand, written as fp32 (GPT-2's residual under
    # autocast), in either order
    "{a0} + {a0}.float() * 0.5", "{a0}.float() - {a0}",
    # autocast's pattern around a norm or softmax in fp32: its kernel stores the cast back to fp16/bf16 itself
    "torch.softmax({a0}.float(), -1).to({a0}.dtype)", "F.layer_norm({a0}.float(), {a0}.shape[-1:]).to({a0}.dtype)",
    # a cat with an operand that adds nothing (a KV cache's first call): the rewrite cat_without_empties
    "torch.cat([{a0}[:0], {a0}], 0)", "torch.cat([{a0}.new_zeros(0), {a0}], -1)",
)
# Step functions: in fp16/bf16 a one-ulp difference in their input (a norm's reduction order) moves the output by
# a whole step, so a differential check cannot judge them there; the generator keeps them to fp32 models.
STEP_FUNCTIONS = ("torch.floor(", "torch.ceil(", "torch.round(", "torch.trunc(", "torch.sign(", " // ",
                  "torch.remainder(", "torch.fmod(")
BINARY = ("{a0} + {b}", "{a0} - {b}", "{a0} * {b}", "{a0} / {b}", "torch.maximum({a0}, {b})",
          "torch.minimum({a0}, {b})", "torch.where({a0} > {b}, {a0}, {b})", "torch.pow(torch.abs({a0}), {b})",
          "torch.add({a0}, {b}, alpha=0.5)", "torch.sub({b}, {a0}, alpha=2)")
REDUCTIONS = ("sum", "mean", "amax", "amin", "prod", "max", "min", "logsumexp", "var", "std", "norm")
ONE_DIM = ("prod", "max", "min")


def _dim(p: Params, key: str, rank: int) -> int:
    if rank == 0:
        raise Invalid("a 0-d tensor has no dim")
    return int(p[key]) % rank


def _broadcast_shape(p: Params, shape: Shape) -> Shape:
    """The operand's shape: `shape` with some leading dims dropped and some dims made 1 (a scalar if none left)."""
    kept = shape[min(int(p["drop"]), len(shape)):]
    mask = p["mask"]
    return tuple(1 if mask[i % len(mask)] else s for i, s in enumerate(kept))


def _fmt(shape: Shape) -> str:
    return "(" + "".join(f"{s}, " for s in shape).rstrip(" ") + ")"


def _draw_unary(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.randrange(len(UNARY))}


def _render_unary(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    return [], UNARY[int(p["fn"]) % len(UNARY)]


def _draw_binary(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.randrange(len(BINARY)), "src": rng.choice(("param", "param", "scalar", "buffer")),
            "drop": rng.choice((0, 0, 0, 1, 2)), "mask": [rng.random() < 0.4 for _ in range(5)],
            "swap": rng.random() < 0.2}


def _render_binary(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    fn = BINARY[int(p["fn"]) % len(BINARY)]
    if p["src"] == "scalar":
        return [], fn.replace("{b}", "0.75")
    shape = _broadcast_shape(p, shapes[0])
    init = (f"self.{{m}} = nn.Parameter(torch.randn({_fmt(shape)}))" if p["src"] == "param" else
            f"self.register_buffer('{{m}}', torch.rand({_fmt(shape)}) + 0.5)")
    expr = fn.replace("{b}", "self.{m}")
    if p["swap"]:  # the operand first: the broadcast one decides nothing, the output still has {a0}'s shape
        expr = expr.replace("{a0}", "{T}").replace("self.{m}", "{a0}").replace("{T}", "self.{m}")
    return [init], expr


def _draw_pair(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.randrange(len(BINARY))}


def _render_pair(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    """Two model values (a value read twice downstream of a fork); shapes must broadcast."""
    a, b = shapes
    out = _broadcast(a, b)
    if math.prod(out) > 4 * max(math.prod(a), math.prod(b)):
        raise Invalid("broadcast too large")
    return [], BINARY[int(p["fn"]) % len(BINARY)].replace("{b}", "{a1}")


def _broadcast(a: Shape, b: Shape) -> Shape:
    out = []
    for x, y in zip(reversed((1,) * (len(b) - len(a)) + a), reversed((1,) * (len(a) - len(b)) + b), strict=True):
        if x != y and 1 not in (x, y):
            raise Invalid("shapes do not broadcast")
        out.append(max(x, y))
    return tuple(reversed(out))


def _draw_reduce(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.randrange(len(REDUCTIONS)), "dims": [rng.randrange(6) for _ in range(rng.choice((1, 1, 2, 3)))],
            "keepdim": rng.random() < 0.4, "all": rng.random() < 0.1}


def _render_reduce(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    fn = REDUCTIONS[int(p["fn"]) % len(REDUCTIONS)]
    rank = len(shapes[0])
    keep = bool(p["keepdim"])
    if p["all"] and fn in ("sum", "mean", "amax", "amin", "prod"):
        return [], f"torch.{fn}({{a0}})"
    dims = sorted({_dim({"d": d}, "d", rank) for d in p["dims"]})  # type: ignore[arg-type]
    if fn in ("var", "std") and math.prod(shapes[0][d] for d in dims) < 2:
        raise Invalid("variance of one element (torch warns: no degrees of freedom)")
    if fn in ONE_DIM:
        call = f"torch.{fn}({{a0}}, dim={dims[0]}, keepdim={keep})"
        return [], call + ("[0]" if fn in ("max", "min") else "")
    if fn == "norm":
        return [], f"torch.linalg.vector_norm({{a0}}, dim={tuple(dims)}, keepdim={keep})"
    return [], f"torch.{fn}({{a0}}, dim={tuple(dims)}, keepdim={keep})"


def _draw_dim_op(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.choice(("torch.softmax", "torch.log_softmax", "F.softmax", "torch.cumsum")),
            "d": rng.randrange(6)}


def _render_dim_op(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    return [], f"{p['fn']}({{a0}}, dim={_dim(p, 'd', len(shapes[0]))})"


def _draw_view(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.choice(("flatten", "unflatten", "permute", "transpose", "contiguous", "unsqueeze", "squeeze",
                              "slice", "reshape", "chunk", "expand", "narrow")),
            "d": rng.randrange(6), "e": rng.randrange(6), "perm": rng.random(), "start": rng.randrange(3),
            "step": rng.choice((1, 1, 2))}


def _render_view(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    shape = shapes[0]
    rank, fn = len(shape), p["fn"]
    if fn == "contiguous":
        return [], "{a0}.contiguous()"
    if fn == "unsqueeze":
        return [], f"{{a0}}.unsqueeze({int(p['d']) % (rank + 1)})"
    if fn == "reshape":
        return [], "{a0}.reshape(-1)" if rank < 2 else f"{{a0}}.reshape({shape[0]}, -1)"
    d = _dim(p, "d", rank)
    if fn == "flatten":
        return [], f"torch.flatten({{a0}}, {d})"
    if fn == "squeeze":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if not ones:
            raise Invalid("no size-1 dim")
        return [], f"{{a0}}.squeeze({ones[int(p['d']) % len(ones)]})"
    if fn == "expand":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if not ones:
            raise Invalid("no size-1 dim")
        target = list(shape)
        target[ones[0]] = 3
        return [], f"{{a0}}.expand({_fmt(tuple(target))})"
    if fn == "unflatten":
        s = shape[d]
        f = next((f for f in (2, 3, 5) if s % f == 0 and s > f), None)
        if f is None:
            raise Invalid("prime dim")
        return [], f"{{a0}}.unflatten({d}, ({f}, {s // f}))"
    if fn == "permute":
        order = list(range(rank))
        random.Random(float(p["perm"])).shuffle(order)  # type: ignore[arg-type]
        return [], f"{{a0}}.permute({_fmt(tuple(order))})"
    e = _dim(p, "e", rank)
    if fn == "transpose":
        return [], f"{{a0}}.transpose({d}, {e})"
    if fn in ("slice", "narrow"):
        start, step = min(int(p["start"]), shape[d] - 1), int(p["step"])
        if fn == "narrow":
            return [], f"{{a0}}.narrow({d}, {start}, {shape[d] - start})"
        index = ", ".join([":"] * d + [f"{start}::{step}"])
        return [], f"{{a0}}[{index}]"
    if shape[d] < 2:
        raise Invalid("chunk of a size-1 dim")
    return [], f"torch.chunk({{a0}}, 2, dim={d})[{int(p['e']) % 2}]"


def _draw_cat(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"d": rng.randrange(6), "self": rng.random() < 0.5, "stack": rng.random() < 0.2}


def _render_cat(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    a, b = shapes
    rank = len(a)
    fn = "stack" if p["stack"] else "cat"
    if p["self"]:
        d = int(p["d"]) % (rank + 1) if p["stack"] else _dim(p, "d", rank)
        if not p["stack"] and int(p["d"]) >= 3 and a[d] >= 2:  # rotary's rotate_half: the halves swapped, one negated
            h = a[d] // 2
            return [], f"torch.cat([-{{a0}}.narrow({d}, {h}, {a[d] - h}), {{a0}}.narrow({d}, 0, {h})], dim={d})"
        return [], f"torch.{fn}([{{a0}}, {{a0}} * 0.5], dim={d})"
    if len(a) != len(b):
        raise Invalid("cat of different ranks")
    d = _dim(p, "d", rank)
    if p["stack"]:
        if a != b:
            raise Invalid("stack of different shapes")
    elif any(x != y for i, (x, y) in enumerate(zip(a, b, strict=True)) if i != d):
        raise Invalid("cat of different shapes")
    return [], f"torch.{fn}([{{a0}}, {{a1}}], dim={d})"


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("unary", 1, 6.0, _draw_unary, _render_unary),
    Kind("binary", 1, 4.0, _draw_binary, _render_binary),
    Kind("pair", 2, 2.0, _draw_pair, _render_pair),
    Kind("reduce", 1, 2.0, _draw_reduce, _render_reduce, min_rank=1),
    Kind("dim_op", 1, 1.5, _draw_dim_op, _render_dim_op, min_rank=1),
    Kind("norm", 1, 2.0, draw_norm, render_norm, min_rank=1),
    Kind("linear", 1, 2.0, draw_linear, render_linear, min_rank=1),
    Kind("matmul_pair", 2, 0.5, lambda rng, s: {"fn": rng.random() < 0.5}, render_matmul_pair, min_rank=2),
    Kind("attention", 1, 1.0, draw_attention, render_attention, min_rank=2, max_rank=3),
    Kind("conv", 1, 2.0, draw_conv, render_conv, min_rank=3),
    Kind("pool", 1, 1.5, draw_pool, render_pool, min_rank=3),
    Kind("view", 1, 3.0, _draw_view, _render_view),
    Kind("cat", 2, 1.0, _draw_cat, _render_cat, min_rank=1),
    Kind("cat_chain", 1, 0.75, draw_cat_chain, render_cat_chain, min_rank=2),
    Kind("cnn_stack", 1, 2.0, draw_cnn_stack, render_cnn_stack, min_rank=4, max_rank=5),
)}
