"""The machinery every local rewrite rule shares: build replacement nodes, splice them in, record the firing.

A local rule is a function `match(graph, node) -> Replacement | None`. It never edits the graph: it returns new
nodes (built with a `Builder`, which infers each node's shape, dtype and strides by running the ATen op on
meta tensors, so a node the interpreter could not run is never created) and the value that replaces `node`.
The driver checks the replacement keeps the node's shape, dtype and strides and does not make an output alias an
input, a parameter or another output, splices it in before `node`, and removes the nodes it left dead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.capture.graph import pure
from kernelfuse.ops import VIEW_OPS
from kernelfuse.plan.interpret import call_aten

# Ops that must not be merged or dropped although their schema says no argument is written: uninitialised
# values, and batch norm, which updates its running statistics in training mode.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Values that share storage with an input, a parameter or another value: an output must not become one of them.
ALIASING_OPS = VIEW_OPS | {"input", "param", "buffer"}
MAX_FIRINGS = 1000  # per rule and graph: every rule shrinks the work, this only guards against a rule that loops
FLOATS = (torch.float32, torch.float64)  # dtypes the algebraic rules accept (reassociation in half types: no)


@dataclass(frozen=True)
class RuleFiring:
    """One application of a rule: the graph nodes it replaced and what it did."""

    rule: str
    nodes: tuple[str, ...]
    note: str

    def __str__(self) -> str:
        return f"{self.rule}({', '.join(self.nodes)}): {self.note}"


@dataclass(frozen=True)
class Replacement:
    """New nodes to insert before the matched node, and the value (new or existing) that takes its place."""

    nodes: tuple[Node, ...]
    value: Ref
    note: str


class NoMatch(Exception):
    """Raised by a Builder when an op cannot run on the given shapes: the rule simply does not fire."""


class Builder:
    """Collects the new nodes of one replacement, each with its metadata inferred on meta tensors."""

    def __init__(self, graph: Graph, at: Node) -> None:
        self.graph, self.at = graph, at
        self.nodes: list[Node] = []
        self._values: dict[str, object] = {}
        self._taken = {n.name for n in graph.nodes}

    def add(self, op: str, *args: object) -> Ref:
        """A new node `op(*args)` (tensor arguments as Refs); raises NoMatch if ATen rejects the shapes."""
        base = op.split(".")[0].strip("_")
        name, i = base, 1
        while name in self._taken:
            name, i = f"{base}_{i}", i + 1
        node = Node(name, op, tuple(args))
        env = {r.name: self._value(r) for r in node.refs}
        try:
            value = call_aten(node, env)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            raise NoMatch(str(err)) from None
        self._taken.add(name)
        self._values[name] = value
        self.nodes.append(dataclasses.replace(node, meta=_meta(value)))
        return Ref(name)

    def meta(self, ref: Ref) -> TensorMeta:
        value = self._value(ref)
        if not isinstance(value, torch.Tensor):
            raise NoMatch(f"%{ref.name} is a {type(value).__name__}, not a tensor: no tensor metadata")
        return _meta(value)  # type: ignore[return-value]

    def done(self, value: Ref, note: str) -> Replacement:
        return Replacement(tuple(self.nodes), value, note)

    def _value(self, ref: Ref) -> object:
        if ref.name in self._values:
            return self._values[ref.name]
        node = self.graph[ref]
        if node.meta is None and node.op not in ("getitem", "constant", "input", "param", "buffer"):
            try:  # a multi-output op (a norm's output and statistics): its values again, on meta tensors
                value = call_aten(node, {r.name: self._value(r) for r in node.refs})
            except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as err:
                raise NoMatch(str(err)) from None
            self._values[ref.name] = value
            return value
        if node.meta is None:
            raise NoMatch(f"{ref} has no tensor metadata")
        m = node.meta
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


Match = Callable[[Graph, Node], "Replacement | None"]


def run_local(name: str, match: Match, graph: Graph) -> tuple[Graph, tuple[RuleFiring, ...]]:
    """Apply `match` at the first node where it fires, again and again until it fires nowhere."""
    fired: list[RuleFiring] = []
    for _ in range(MAX_FIRINGS):
        for node in graph.nodes:
            try:
                rep = match(graph, node)
            except NoMatch:
                rep = None
            if rep is not None and safe(graph, node, rep):
                graph = splice(graph, node, rep)
                fired.append(RuleFiring(name, (node.name,), rep.note))
                break
        else:
            break
    return graph, tuple(fired)


def safe(graph: Graph, node: Node, rep: Replacement) -> bool:
    """The replacement has the node's shape and dtype (and strides where a dim has more than one element), and
    an output does not start to share storage with an input, a parameter or another output."""
    new = {n.name: n for n in rep.nodes}
    value = new.get(rep.value.name) or graph[rep.value]
    a, b = value.meta, node.meta
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if any(d > 1 and s != t for d, s, t in zip(a.shape, a.stride, b.stride, strict=True)):
        return False
    if graph.is_output(node.name) and rep.value.name not in new:
        return value.op not in ALIASING_OPS and not graph.is_output(value.name)
    return True


def splice(graph: Graph, node: Node, rep: Replacement) -> Graph:
    """Insert `rep.nodes` before `node`, point every use of `node` at `rep.value`, drop what became dead."""
    rename = {node.name: rep.value}
    nodes: list[Node] = []
    for n in graph.nodes:
        if n is node:
            nodes.extend(rep.nodes)
        else:
            nodes.append(rewire(n, rename))
    outputs = tuple(rename.get(r.name, r) for r in graph.outputs)
    return drop_dead(rebuild(graph, nodes, outputs))


def drop_dead(graph: Graph) -> Graph:
    """The graph without the pure nodes no output or impure node depends on (a pool's unused indices, squeezed:
    a reader that is itself dead must not keep them alive), and without the allocations nothing reads (batch
    norm's reserve buffer under autocast: an `empty` per norm, left in the forward once the norm is a kernel)."""
    live = _live(graph)
    return rebuild(graph, [n for n in graph.nodes if n.name in live or not (pure(n) or _allocation(n.op))],
                   graph.outputs)


def _allocation(op: str) -> bool:
    """An uninitialised allocation: impure (two are never merged), yet without effect when nothing reads it."""
    return op.split(".")[0] in ALLOCATIONS


def rebuild(graph: Graph, nodes: list[Node] | tuple[Node, ...], outputs: tuple[Ref, ...]) -> Graph:
    """A graph with other nodes and outputs and everything else unchanged (Graph.rebuilt)."""
    return graph.rebuilt(nodes, outputs)


def rewire(node: Node, rename: dict[str, Ref]) -> Node:
    """`node` with its uses of renamed values pointed at their replacements (`node` itself when it uses none:
    a splice then copies only the readers of the value it replaced)."""
    if not any(r.name in rename for r in node.refs):
        return node

    def sub(a: object) -> object:
        if isinstance(a, Ref):
            return rename.get(a.name, a)
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        return a

    return dataclasses.replace(node, args=tuple(sub(a) for a in node.args))


def scalar(a: object) -> float | None:
    """A Python number argument as a float (bools and tensors are not scalars here)."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    return None


def single_use(graph: Graph, name: str) -> Node | None:
    """The only node reading `name`, if exactly one does (reading it once) and it is no graph output."""
    users = graph.users(name)
    if len(users) != 1 or graph.is_output(name) or sum(r.name == name for r in users[0].refs) != 1:
        return None
    return users[0]


def _live(graph: Graph) -> set[str]:
    """Nodes the outputs or an impure node (a state update, a random draw; not an allocation) depend on."""
    live = {r.name for r in graph.outputs} | {n.name for n in graph.nodes if not (pure(n) or _allocation(n.op))}
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(r.name for r in node.refs)
    return live


def _meta(value: object) -> TensorMeta | None:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(d) for d in value.shape), value.dtype, tuple(int(s) for s in value.stride()))
    return None
