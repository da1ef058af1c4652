"""Concatenations that extend one another share one buffer: each writes only its new operands.

A DenseNet block concatenates its growing feature list after every layer: `cat([x, f1])`, `cat([x, f1, f2])`,
... (or the nested form `cat([cat([x, f1]), f2])`). Eager copies every earlier feature again each time, a cost
quadratic in the depth (10 x 224 x 224 x 224 fp32 at the end of a 6-layer block: 1.7 GB moved by the six cats,
0.85-0.98 ms on an H200, as much as three of its convolutions). Every concatenation of such a chain is the
first part, along the concatenated dim, of the last one; so the last one's buffer is allocated where the first
runs, each step copies its new operands into their slice, and each earlier value is a view of the buffer's first
part, with the buffer's strides. Kernels read those views through their strides, as the graph now records them.

A chain is only formed where that is invisible: the viewed concatenations are no output, nothing reads them
through a view, no op writes them or their operands (an in-place update between two concatenations would reach
only eager's later copy), and they are computed in every call (a weight-only one is cached by the emitted file).
"""

from __future__ import annotations

from dataclasses import replace

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.capture.graph import pure
from kernelfuse.ops import ANCHOR_OPS
from kernelfuse.plan.aliasing import alias_closure, may_alias, weight_only, written_args
from kernelfuse.plan.ir import CatInto


def shared_cat_buffers(graph: Graph) -> tuple[Graph, dict[str, CatInto]]:
    """`graph` with the strides of every concatenation that lives in a later one's buffer changed to the view's,
    and where each concatenation of a chain writes (see the module's docstring); `graph` itself and nothing where
    no chain qualifies."""
    flat = {n.name: ops for n in graph.nodes if (ops := _flat_operands(graph, n)) is not None}
    if len(flat) < 2:
        return graph, {}
    blocked = _mutated(graph) | weight_only(graph)
    outputs = {r.name for r in graph.outputs}
    successor: dict[str, str] = {}
    taken: set[str] = set()
    order = list(flat)  # graph order: a concatenation's candidates precede it
    for i, name in enumerate(order):
        node, ops = graph[name], flat[name]
        if name in blocked or any(r.name in blocked for r in ops):
            continue
        before = [p for p in order[:i] if p not in taken and _extends(node, graph[p], ops, flat[p])
                  and _viewable(graph, p, outputs, blocked)]
        if before:
            prev = max(before, key=lambda p: len(flat[p]))
            successor[prev] = name
            taken.add(prev)
    heads = [p for p in successor if p not in successor.values()]
    if not heads:
        return graph, {}
    into: dict[str, CatInto] = {}
    metas: dict[str, TensorMeta] = {}
    for head in heads:
        chain = [head]
        while chain[-1] in successor:
            chain.append(successor[chain[-1]])
        last = graph[chain[-1]]
        dim = _dim(last)
        held = 0
        for i, name in enumerate(chain):
            ops = flat[name]
            copies, offset = [], 0
            for j, ref in enumerate(ops):
                if j >= held:
                    copies.append((ref, offset))
                offset += graph[ref].meta.shape[dim]  # type: ignore[union-attr]
            held = len(ops)
            into[name] = CatInto(last.name, dim, tuple(copies), first=i == 0)
            if name != last.name:
                meta = graph[name].meta
                metas[name] = replace(meta, stride=last.meta.stride)  # type: ignore[arg-type,union-attr]
    nodes = tuple(replace(n, meta=metas[n.name]) if n.name in metas else n for n in graph.nodes)
    return graph.rebuilt(nodes), into


def looked_through(graph: Graph, into: dict[str, CatInto]) -> set[str]:
    """The concatenations nested in the operands of the shared-buffer ones, which their copies look through to the
    tensors they concatenate (`_flat_operands`): those tensors must be in memory, so no kernel may compute them
    inside the nested concatenation's select (kernelfuse.plan.catselect)."""
    found: set[str] = set()
    stack = list(into)
    while stack:
        node = graph[stack.pop()]
        for a in node.args[0] if node.args and isinstance(node.args[0], tuple) else ():
            src = graph[a] if isinstance(a, Ref) else None
            if src is not None and src.op == "cat.default" and src.meta is not None and _dim(src) == _dim(node) \
                    and src.name not in found:
                found.add(src.name)
                stack.append(src.name)
    return found


def _flat_operands(graph: Graph, node: Node) -> tuple[Ref, ...] | None:
    """A concatenation's operands, an operand that is itself a concatenation along the same dim replaced by its own
    (recursively); None where the node is no concatenation of same-dtype, same-rank tensors with known shapes."""
    if node.op != "cat.default" or node.meta is None or not node.args or not isinstance(node.args[0], tuple):
        return None
    out: list[Ref] = []
    for a in node.args[0]:
        src = graph[a] if isinstance(a, Ref) else None
        if src is None or src.meta is None or src.meta.dtype != node.meta.dtype \
                or len(src.meta.shape) != len(node.meta.shape):
            return None
        inner = _flat_operands(graph, src) if src.op == "cat.default" and _dim(src) == _dim(node) else None
        out.extend(inner if inner is not None else [a])
    return tuple(out) if len(out) > 1 else None


def _dim(node: Node) -> int:
    dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else 0
    return dim % len(node.meta.shape)  # type: ignore[union-attr]


def _extends(node: Node, prev: Node, ops: tuple[Ref, ...], prev_ops: tuple[Ref, ...]) -> bool:
    """`prev` holds the first operands of `node`, along the same dim: the first part of `node`'s value."""
    return _dim(prev) == _dim(node) and len(prev_ops) < len(ops) and ops[:len(prev_ops)] == prev_ops \
        and prev.meta.dtype == node.meta.dtype  # type: ignore[union-attr]


def _viewable(graph: Graph, name: str, outputs: set[str], blocked: set[str]) -> bool:
    """May `name`'s value be a view of a later buffer: no output, not written, no reader that views it (a view's
    strides were worked out for the dense value) or multiplies it on cuBLAS (a kernel that wants it dense)?"""
    if name in outputs or name in blocked:
        return False
    return all(not may_alias(r) and ANCHOR_OPS.get(r.op) != "matmul" for r in graph.users(name))


def _mutated(graph: Graph) -> set[str]:
    """Every value an op writes, and every value sharing its storage, back through views and forward into them."""
    written = alias_closure(graph, (r.name for n in graph.nodes if not pure(n) and n.op not in ("input", "param",
                                                                                                  "buffer")
                                    for r in written_args(n)))
    for node in graph.nodes:  # graph order: a view of a written value, then views of that view
        if may_alias(node) and any(r.name in written for r in node.refs):
            written.add(node.name)
    return written
