"""Random valid models as problem-file text, seeded by (seed, index): a failure is reproducible as a file.

A `ModelSpec` lists inputs (shape, memory layout, special values) and ops (a kind from `kernelfuse.fuzz.ops`, the
values it reads, size-independent parameters). `materialize` replays the ops on small real CPU tensors in the
model's dtype, which both gives every value's shape and proves eager runs it; `render` writes the problem file.
The generator only keeps ops that materialize, so every spec it returns is a model eager can run.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernelfuse.fuzz.kind import Invalid, Kind, Params, Shape
from kernelfuse.fuzz.ops import KINDS, STEP_FUNCTIONS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = (1, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16)
MAX_NUMEL = 6144  # per value: every model checks on the CPU in milliseconds
MAX_OPS = 8
MAX_OUTPUTS = 3
LAYOUTS = ("contiguous", "contiguous", "contiguous", "transposed", "sliced", "permuted")
SPECIALS = ("", "", "", "", "", "", "", "nan", "inf", "large")


@dataclass(frozen=True)
class InputSpec:
    shape: Shape
    layout: str = "contiguous"  # "transposed" (last two dims), "sliced" (every other of the last), "permuted"
    special: str = ""  # "nan" | "inf" (both signs) | "large" (near the dtype's range): in some elements


@dataclass(frozen=True)
class OpSpec:
    kind: str
    args: tuple[int, ...]  # value indices: the inputs first, then one value per op
    params: tuple[tuple[str, object], ...]

    @property
    def param_dict(self) -> Params:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}


@dataclass(frozen=True)
class ModelSpec:
    seed: int
    index: int
    dtype: str
    training: bool
    inputs: tuple[InputSpec, ...]
    ops: tuple[OpSpec, ...]
    outputs: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"fuzz_s{self.seed}_i{self.index}"


@dataclass
class Materialized:
    """A spec replayed on real tensors: each value's shape, each op's constructor lines and forward expression."""

    shapes: list[Shape] = field(default_factory=list)
    inits: list[list[str]] = field(default_factory=list)
    exprs: list[str] = field(default_factory=list)


def generate(seed: int, index: int) -> ModelSpec:
    """The model number `index` of the run seeded `seed`: the same pair always gives the same model."""
    rng = random.Random(f"kernelfuse-fuzz:{seed}:{index}")
    dtype = rng.choices(list(DTYPES), weights=(6, 2, 2))[0]
    base = ModelSpec(seed, index, dtype, rng.random() < 0.5, _draw_inputs(rng), (), ())
    state = _Replay(base)
    ops: list[OpSpec] = []
    want = rng.randint(1, MAX_OPS)
    for _ in range(want * 6):
        if len(ops) == want:
            break
        op = _draw_op(rng, state.values)
        if state.try_add(op):
            ops.append(op)
    return replace(base, ops=tuple(ops), outputs=leaves(len(base.inputs), ops))


def leaves(n_inputs: int, ops: list[OpSpec] | tuple[OpSpec, ...]) -> tuple[int, ...]:
    """The outputs: the newest values no op reads (at most MAX_OUTPUTS), so that every op's value is used."""
    read = {a for op in ops for a in op.args}
    found = [i for i in range(n_inputs, n_inputs + len(ops)) if i not in read]
    return tuple(reversed(found[-MAX_OUTPUTS:])) or (n_inputs - 1,)


def _draw_inputs(rng: random.Random) -> tuple[InputSpec, ...]:
    inputs = []
    for _ in range(rng.choices((1, 2, 3), weights=(6, 3, 1))[0]):
        rank = rng.choices((1, 2, 3, 4, 5), weights=(1, 4, 4, 4, 2))[0]
        shape: list[int] = []
        for _ in range(rank):
            shape.append(rng.choice([s for s in SIZES if math.prod(shape) * s <= 1024] or [1]))
        if inputs and rng.random() < 0.5:  # broadcasts against the first input: fewer dims, some of them 1
            first = inputs[0].shape
            shape = [1 if rng.random() < 0.4 else s for s in first[rng.randrange(len(first) + 1):]]
        layout = rng.choice(LAYOUTS)
        if len(shape) < 2 and (layout != "sliced" or not shape):
            layout = "contiguous"
        if len(shape) < 3 and layout == "permuted":
            layout = "transposed"
        inputs.append(InputSpec(tuple(shape), layout, rng.choice(SPECIALS)))
    return tuple(inputs)


def _draw_op(rng: random.Random, values: list[torch.Tensor]) -> OpSpec:
    kind = rng.choices(list(KINDS.values()), weights=[k.weight for k in KINDS.values()])[0]
    # mostly a chain from the newest value; sometimes an older one (a fork: that value gets a second reader)
    first = len(values) - 1 if rng.random() < 0.7 else rng.randrange(len(values))
    args = (first,) + tuple(rng.randrange(len(values)) for _ in range(kind.arity - 1))
    params = kind.draw(rng, [tuple(values[a].shape) for a in args])
    return OpSpec(kind.name, args, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


class _Replay:
    """Runs a spec's ops one at a time on real tensors (CPU, the model's dtype), as the rendered file would."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.module = nn.Module()
        self.module.train(spec.training)
        gen = torch.Generator().manual_seed(0)
        self.values: list[torch.Tensor] = [_make_input(i, self.dtype, gen) for i in spec.inputs]
        self.done = Materialized(shapes=[tuple(v.shape) for v in self.values])

    def try_add(self, op: OpSpec) -> bool:
        """Run `op` on the values so far; keep it (True) if eager runs it and its result stays small and real."""
        if any(a >= len(self.values) for a in op.args):
            return False
        kind: Kind = KINDS[op.kind]
        shapes = [tuple(self.values[a].shape) for a in op.args]
        if not kind.min_rank <= len(shapes[0]) <= kind.max_rank:
            return False
        m = f"m{len(self.values)}"
        try:
            inits, expr = kind.render(op.param_dict, shapes)
        except Invalid:
            return False
        inits = [line.replace("{m}", m) for line in inits]
        expr = expr.replace("{m}", m)
        if self.dtype != torch.float32 and any(f in expr for f in STEP_FUNCTIONS):
            return False
        names = {f"a{i}": f"_v[{a}]" for i, a in enumerate(op.args)}
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scope = {"torch": torch, "nn": nn, "F": F, "self": self.module, "_v": self.values}
                for line in inits:
                    exec(line, scope)  # noqa: S102 - our own rendered constructor line
                self.module.to(self.dtype)
                self.module.train(self.spec.training)
                out = eval(expr.format(**names), scope)  # noqa: S307 - our own rendered expression
        except Exception:  # noqa: BLE001 - eager refuses these shapes or this dtype: not a valid op here
            for name in list(self.module._modules) + list(self.module._parameters) + list(self.module._buffers):
                if name == m or name.startswith(m + "_"):
                    delattr(self.module, name)
            return False
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() > MAX_NUMEL \
                or out.numel() == 0:
            return False
        self.values.append(out)
        self.done.shapes.append(tuple(out.shape))
        self.done.inits.append(inits)
        self.done.exprs.append(expr.format(**{f"a{i}": _value_name(self.spec, a) for i, a in enumerate(op.args)}))
        return True


def materialize(spec: ModelSpec) -> Materialized:
    """Every op's constructor lines and forward expression at the spec's shapes; Invalid if one no longer fits
    (a shrunk dim, a dropped producer) or its value would not be used."""
    replay = _Replay(spec)
    for op in spec.ops:
        if not replay.try_add(op):
            raise Invalid(f"op {op.kind} does not fit its operands")
    n = len(spec.inputs) + len(spec.ops)
    if not spec.outputs or any(not 0 <= o < n for o in spec.outputs):
        raise Invalid("no such output")
    return replay.done


def _value_name(spec: ModelSpec, index: int) -> str:
    return f"x{index}" if index < len(spec.inputs) else f"v{index}"


def _make_input(spec: InputSpec, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    scope = {"torch": torch, "_g": gen}
    lines = _input_lines(spec, dtype, "t", "generator=_g, ")
    exec("\n".join(lines), scope)  # noqa: S102 - the same lines the rendered get_inputs runs
    return scope["t"]


def _input_lines(spec: InputSpec, dtype: torch.dtype, name: str, gen: str = "") -> list[str]:
    """Lines that make input `name` as described: drawn in a base layout, special values written, then viewed."""
    shape = list(spec.shape)
    view = ""
    if spec.layout == "transposed":
        shape[-1], shape[-2] = shape[-2], shape[-1]
        view = ".transpose(-1, -2)"
    elif spec.layout == "sliced":
        shape[-1] *= 2
        view = "[..., ::2]"
    elif spec.layout == "permuted":
        shape = shape[1:] + shape[:1]
        view = f".permute({len(shape) - 1}, " + ", ".join(str(i) for i in range(len(shape) - 1)) + ")"
    lines = [f"{name} = torch.randn({tuple(shape)!r}, {gen}dtype={dtype})"]
    if spec.special == "nan":
        lines.append(f"{name}.view(-1)[::7] = float('nan')")
    elif spec.special == "inf":
        lines += [f"{name}.view(-1)[::9] = float('inf')", f"{name}.view(-1)[4::11] = float('-inf')"]
    elif spec.special == "large":
        # large, but squares stay finite in float32: past that eager's own answer depends on its kernel (CPU batch
        # norm of the same values gives another answer for a transposed layout)
        lines.append(f"{name}.view(-1)[::5] *= {1e4 if dtype in (torch.float16, torch.bfloat16) else 1e15}")
    if view:
        lines.append(f"{name} = {name}{view}")
    return lines


def render(spec: ModelSpec, header: str = "") -> str:
    """The problem file of `spec` (Model, get_inputs, get_init_inputs), with `header` as extra docstring lines."""
    done = materialize(spec)
    dtype = DTYPES[spec.dtype]
    inits = [line for lines in done.inits for line in lines]
    if spec.dtype != "float32":
        inits.append(f"self.to({dtype})")
    if not spec.training:
        inits.append("self.eval()")
    args = ", ".join(_value_name(spec, i) for i in range(len(spec.inputs)))
    body = [f"v{len(spec.inputs) + i} = {e}" for i, e in enumerate(done.exprs)]
    outs = ", ".join(_value_name(spec, o) for o in spec.outputs)
    made = [line for i, s in enumerate(spec.inputs) for line in _input_lines(s, dtype, f"x{i}")]
    doc = f'"""kernelfuse fuzz model: seed {spec.seed}, index {spec.index} ({spec.dtype}, ' \
          f'{"training" if spec.training else "eval"} mode).{header}\n"""'
    return "\n".join([
        doc, "", "import torch", "import torch.nn as nn", "import torch.nn.functional as F", "", "",
        "class Model(nn.Module):", "    def __init__(self):", "        super().__init__()",
        *(f"        {line}" for line in inits), "",
        f"    def forward(self, {args}):", *(f"        {line}" for line in body), f"        return {outs}", "", "",
        "def get_inputs():", *(f"    {line}" for line in made), f"    return [{args}]", "", "",
        "def get_init_inputs():", "    return []", "",
    ])
