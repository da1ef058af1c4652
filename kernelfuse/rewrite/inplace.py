"""In-place ops on fresh, single-reader values become their out-of-place twins, so the planner can fuse them.

Models written with `nn.ReLU(inplace=True)`, `out += identity` or `F.relu6(x, inplace=True)` trace to
`relu_.default`, `add_.Tensor`, `hardtanh_.default`: ops the planner never fuses and that make `drop_identities`
keep the graph as traced. When nothing else can observe the mutation, `op_(x, *args)` and `op(x, *args)` give the
same value, and only the out-of-place form is a pure op the planner can put in a kernel. The rule runs first so
`drop_identities` sees the functional graph; an update of a buffer (batch norm's `num_batches_tracked += 1` in
training mode) stays in place, so that pass still keeps such a graph as traced.
"""

from __future__ import annotations

import functools

from kernelfuse.capture import Graph, Node, aten_overload
from kernelfuse.capture.graph import pure
from kernelfuse.rewrite.engine import Builder, Replacement, single_use


def inplace_to_functional(graph: Graph, node: Node) -> Replacement | None:
    """op_(x, *args) becomes op(x, *args) when nothing else can see x's storage: exact (the same ATen arithmetic
    on the same values). The twin is derived from the name (`relu_.default` -> `relu.default`, `add_.Tensor` ->
    `add.Tensor`): it must exist in torch.ops.aten, be pure (no random or batch-norm twins) and the in-place
    schema must write its first argument only. x must be fresh: computed by an ATen op whose schema returns no
    alias (not an input, parameter, buffer or constant, not a view, reshape, slice or select, not the result of
    another in-place op; a getitem of a multi-output op such as batch norm is fresh, of a split or unbind is a
    view). x must have this node as its only reader, reading it once, and be no graph output. make_fx points every
    later read of a mutated tensor at the in-place node's output, so with one reader no node sees x's old or new
    value through x itself, and a view of x taken before the mutation would be a second reader. The engine's
    check rejects a result whose dtype, shape or strides differ (`add_` of a float64 into float32)."""
    twin = functional_twin(node.op)
    if twin is None or not node.args or single_use(graph, getattr(node.args[0], "name", "")) is not node:
        return None
    if not fresh(graph, graph[node.args[0]]):
        return None
    b = Builder(graph, node)
    return b.done(b.add(twin, *node.args), f"{node.op} on a fresh single-reader value is {twin}")


@functools.cache
def functional_twin(op: str) -> str | None:
    """The pure out-of-place overload of an in-place ATen overload that writes only its first argument."""
    packet, _, overload = op.partition(".")
    if not packet.endswith("_") or packet.startswith("_") or not overload:
        return None
    inplace = aten_overload(op)
    twin = f"{packet[:-1]}.{overload}"
    if inplace is None or aten_overload(twin) is None or not pure(Node("", twin)):
        return None
    writes = [a.alias_info is not None and a.alias_info.is_write for a in inplace._schema.arguments]
    return twin if writes[:1] == [True] and not any(writes[1:]) else None


def fresh(graph: Graph, node: Node) -> bool:
    """`node`'s value is new storage: an ATen op (or one result of a multi-output one) that returns no alias."""
    if node.op == "getitem":
        node = graph[node.args[0]]  # type: ignore[index]
    fn = aten_overload(node.op)
    return fn is not None and all(r.alias_info is None for r in fn._schema.returns)
