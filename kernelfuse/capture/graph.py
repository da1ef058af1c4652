"""The captured graph: a flat, printable list of ATen-level nodes with tensor metadata.

It is deliberately tiny (after tinygrad's UOp): a node is (name, op, args, meta). Tensor arguments are `Ref`s to
earlier nodes; everything else in `args` is a Python constant. Graph inputs are nodes whose op is `"input"`
(forward arguments) or `"param"` / `"buffer"` (module state, `target` is the attribute path such as
`"gemm.weight"`). A tensor forward makes from literals (`torch.tensor([1., 2.])`, `torch.empty(0)`) is a
`"constant"` node: its values are in `args`, written into the emitted file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache, cached_property

import torch

from kernelfuse.capture.signature import CallSpec, plain_call


@dataclass(frozen=True)
class Ref:
    """A use of an earlier node's value."""

    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


Arg = Ref | int | float | bool | str | None | tuple | torch.dtype | torch.device | torch.layout | torch.memory_format


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and strides of a value, read off fake tensors during capture."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.shape)

    @property
    def is_dense_contiguous(self) -> bool:
        """Contiguous as torch's `is_contiguous()` sees it: the strides of size-1 dimensions do not matter."""
        expected = contiguous_strides(self.shape)
        return self.numel == 0 or all(d == 1 or s == e for d, s, e in zip(self.shape, self.stride, expected,
                                                                            strict=True))

    @property
    def is_dense_permutation(self) -> bool:
        """Every element once, in some order of the dimensions (contiguous, channels-last, a transpose's): each
        dimension's stride is the product of the sizes of the faster-moving ones, no gap, no overlap."""
        expected = 1
        for d in sorted((d for d in range(len(self.shape)) if self.shape[d] != 1), key=lambda d: self.stride[d]):
            if self.stride[d] != expected:
                return False
            expected *= self.shape[d]
        return True

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        layout = "" if self.is_contiguous else f" stride={list(self.stride)}"
        return f"{dtype}{list(self.shape)}{layout}"


@dataclass(frozen=True)
class Node:
    name: str
    op: str  # "input" | "param" | "buffer" | "constant" | an ATen op as "packet.overload", e.g. "addmm.default"
    args: tuple[Arg, ...] = ()
    meta: TensorMeta | None = None
    target: str | int | None = None  # param/buffer attribute path, or the forward argument's position

    @cached_property
    def refs(self) -> tuple[Ref, ...]:
        return tuple(_iter_refs(self.args))

    @cached_property
    def positional(self) -> tuple[Arg, ...]:
        """The arguments passed by position (keyword arguments are recorded as ("kw", name, value) after them)."""
        return tuple(a for a in self.args if not _is_keyword(a))

    @cached_property
    def keywords(self) -> dict[str, Arg]:
        """The arguments passed by keyword, by name."""
        return {a[1]: a[2] for a in self.args if _is_keyword(a)}  # type: ignore[index,misc]

    def __str__(self) -> str:
        if self.op in ("input", "param", "buffer"):
            return f"%{self.name} = {self.op}({self.target!r}) : {self.meta}"
        args = ", ".join(_fmt(a) for a in self.args)
        return f"%{self.name} = {self.op}({args}) : {self.meta}"


@dataclass(frozen=True)
class Graph:
    """The forward as traced; `training` is the module mode it was traced in (BatchNorm, Dropout and any op eager
    switches on `module.training` were recorded in that mode only, so the fused forward serves only that mode),
    `modes` each submodule's."""

    nodes: tuple[Node, ...]
    outputs: tuple[Ref, ...]
    training: bool = True
    # every module's mode at trace time, in `model.modules()` order ("1" training, "0" eval); "" where not known (a
    # graph built by hand: all in `training`). A wrapper may hold an eval-mode model: the modes are then mixed
    modes: str = ""
    # how forward is called and what it returns (None: a graph built by hand, positional tensors in and out)
    call: CallSpec | None = field(default=None, compare=False, hash=False, repr=False)
    # the dtype of CUDA autocast the forward was traced under (the bf16 policy; its casts are nodes), or None
    autocast: torch.dtype | None = None
    # the module's buffers at capture time by attribute path (the live tensors, not copies), so that the planner may
    # read a constant's value (kernelfuse.plan.attention: a mask that is causal); None where not known (a graph built
    # by hand). The emitted file never relies on them without checking them again at run time
    state_values: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, hash=False, repr=False)
    _index: dict[str, Node] = field(default_factory=dict, compare=False, repr=False)
    _users: dict[str, list[Node]] = field(default_factory=dict, compare=False, repr=False)
    _first: dict[tuple, Node] = field(default_factory=dict, compare=False, repr=False)
    _position: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({n.name: n for n in self.nodes})

    def rebuilt(self, nodes: Iterable[Node], outputs: Iterable[Ref] | None = None) -> Graph:
        """This graph over other nodes (and outputs), every other field (training flag, modes, call, autocast,
        buffer values) carried over: the one way a pass builds a new graph, so a field added here reaches every
        pass. The private indexes (by name, by reader) start empty, rebuilt for the new nodes."""
        caches = {f.name: f.default_factory() for f in fields(self)  # type: ignore[misc]
                  if f.name.startswith("_") and f.default_factory is not MISSING}
        return replace(self, nodes=tuple(nodes), outputs=self.outputs if outputs is None else tuple(outputs),
                       **caches)

    @property
    def mixed_modes(self) -> bool:
        """Were some modules traced in training mode and others in eval mode?"""
        return "0" in self.modes and "1" in self.modes

    def __getitem__(self, name: str | Ref) -> Node:
        return self._index[name.name if isinstance(name, Ref) else name]

    def users(self, name: str) -> list[Node]:
        """Nodes that read `name` (graph outputs are not nodes: see `is_output`). Indexed on first use: the
        planner asks for every node, and an unrolled RNN has thousands."""
        if not self._users and self.nodes:
            for n in self.nodes:
                for reader in dict.fromkeys(r.name for r in n.refs):
                    self._users.setdefault(reader, []).append(n)
            self._users.setdefault("", [])  # marks the index as built even when no node reads another
        return list(self._users.get(name, []))

    def position(self, name: str) -> int:
        """The node's index in graph order. Indexed on first use: the scheduler sorts and scans chains by it for
        every seed (a dict built per call made planning Llama's 700 nodes twice as slow)."""
        if not self._position:
            self._position.update({n.name: i for i, n in enumerate(self.nodes)})
        return self._position[name]

    def first_equal(self, node: Node) -> Node:
        """The first node of the graph with `node`'s op, arguments and metadata (`node` itself when none precedes
        it). Indexed on first use: common-subexpression elimination asks for every node, and a scan per node made
        the rewrite stage quadratic (minutes on a 256-step hand-written RNN)."""
        if not self._first and self.nodes:
            for n in self.nodes:
                try:
                    self._first.setdefault((n.op, n.args, n.meta), n)
                except TypeError:  # an unhashable argument: such a node is found by the scan below
                    continue
        try:
            return self._first.get((node.op, node.args, node.meta), node)
        except TypeError:
            return next(n for n in self.nodes if n.op == node.op and n.args == node.args and n.meta == node.meta)

    def is_output(self, name: str) -> bool:
        return any(r.name == name for r in self.outputs)

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "input"]

    @property
    def call_spec(self) -> CallSpec:
        """`call`, or for a graph built without a capture: positional tensors in, a tensor or a tuple out."""
        if self.call is not None:
            return self.call
        return plain_call(len(self.inputs), len(self.outputs))

    @property
    def state(self) -> list[Node]:
        return [n for n in self.nodes if n.op in ("param", "buffer")]

    def __str__(self) -> str:
        lines = [str(n) for n in self.nodes]
        lines.append("return " + ", ".join(str(r) for r in self.outputs))
        return "\n".join(lines)


@cache
def aten_overload(op: str) -> torch._ops.OpOverload | None:
    """The ATen overload a node's op name spells (`"add.Tensor"`); None for "input", "getitem" and the like."""
    packet, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload, None) if overload else None


IMPURE_MARKERS = ("empty", "batch_norm")  # ops whose schema does not say they write or draw


def pure(node: Node) -> bool:
    """No side effect and a deterministic value: can be dropped when unused, merged when computed twice."""
    return _pure_op(node.op)


@cache
def _pure_op(op: str) -> bool:
    """`pure` by op name (it depends on nothing else; every splice asks it for every node)."""
    if op == "getitem":
        return True
    if op in ("input", "param", "buffer") or any(m in op for m in IMPURE_MARKERS):
        return False
    fn = aten_overload(op)
    return fn is not None and not fn._schema.is_mutable and torch.Tag.nondeterministic_seeded not in fn.tags


def _is_keyword(arg: object) -> bool:
    return isinstance(arg, tuple) and len(arg) == 3 and arg[0] == "kw"


def schema_args(node: Node) -> dict[str, object]:
    """An ATen node's arguments by schema name, defaults filled in (keyword ones never taken for positional)."""
    schema = aten_overload(node.op)._schema.arguments  # type: ignore[union-attr]
    args: dict[str, object] = {a.name: a.default_value for a in schema if a.has_default_value()}
    args.update(zip((a.name for a in schema), node.positional, strict=False))
    args.update(node.keywords)
    return args


def draws_random_numbers(graph: Graph) -> bool:
    """Whether any op of the graph draws random numbers: ATen tags such ops nondeterministic_seeded, but dropout
    (and the recurrent ops' dropout between layers) with probability 0 or outside training draws none."""
    for node in graph.nodes:
        op = aten_overload(node.op)
        if op is None or torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        args = schema_args(node)
        probability = next((args[k] for k in ("p", "dropout", "dropout_p") if k in args), None)
        if isinstance(probability, (int, float)) and (probability == 0 or args.get("train") is False):
            continue
        return True
    return False


def constant_value(node: Node, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor a `"constant"` node holds: its flat values (`args[0]`) in its shape and dtype."""
    values = node.args[0]
    assert node.meta is not None and isinstance(values, tuple)
    return torch.tensor(values, dtype=node.meta.dtype, device=device).reshape(node.meta.shape)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _iter_refs(args: tuple) -> list[Ref]:
    out: list[Ref] = []
    for a in args:
        if isinstance(a, Ref):
            out.append(a)
        elif isinstance(a, tuple):
            out.extend(_iter_refs(a))
    return out


def _fmt(a: Arg) -> str:
    if isinstance(a, tuple):
        return "[" + ", ".join(_fmt(x) for x in a) + "]"
    return str(a) if isinstance(a, Ref) else repr(a)
