"""A concatenation of pointwise branches inside a flat pointwise kernel, never stored (Llama's rotary embedding:
`x * cos + cat((-x2, x1), -1) * sin` in one kernel, not a `neg` kernel, a torch `cat` and a multiply-add kernel).

The kernel evaluates every branch at every element of the concatenation's shape. A branch reads each tensor
through a Window: at the element's index along the cat dim less the branch's offset, clamped into the branch (a
valid address wherever the element lies, so no branch is needed around the load; the other branches' arithmetic
is a few wasted instructions, the round trip of the concatenation through memory is saved). A `cat_select`
statement then picks, by the element's index along the dim, the branch that holds it.

Who does what: the scheduler (kernelfuse.plan.joins.cat_group) pulls a concatenation and its branches' private
pointwise producers into a chain; kernelfuse.plan.program writes the windows (`branch_windows`); the plan
interpreter (`windowed`, `selected`) and kernelfuse.codegen.common evaluate them.
"""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.plan.ir import Program, Window

CAT = "cat.default"
SELECT = "cat_select"  # Statement.op; params: (dim, branch sizes along it, the concatenation's shape)


def cat_operands(graph: Graph, node: Node) -> tuple[int, tuple[Ref, ...]] | None:
    """(dim, operands) of a concatenation a kernel may select from: two or more tensors of its dtype and rank,
    none empty along the dim (the rewrite drops those); None otherwise."""
    if node.op != CAT or node.meta is None or not node.positional:
        return None
    tensors, shape = node.positional[0], node.meta.shape
    dim = node.positional[1] if len(node.positional) > 1 else node.keywords.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or not all(isinstance(t, Ref) for t in tensors) \
            or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return None
    dim %= len(shape)
    for ref in tensors:
        meta = graph[ref].meta
        if meta is None or meta.dtype != node.meta.dtype or len(meta.shape) != len(shape) or meta.shape[dim] == 0 \
                or any(a != b for d, (a, b) in enumerate(zip(meta.shape, shape, strict=True)) if d != dim):
            return None
    if sum(graph[ref].meta.shape[dim] for ref in tensors) != shape[dim]:  # type: ignore[union-attr]
        return None
    return dim, tuple(tensors)  # type: ignore[arg-type]


def cat_windows(graph: Graph, node: Node) -> list[tuple[Ref, Window]]:
    """Each operand of a concatenation (cat_operands accepted it) with the window its branch reads through."""
    dim, refs = cat_operands(graph, node)  # type: ignore[misc]
    out, offset = [], 0
    for ref in refs:
        size = graph[ref].meta.shape[dim]  # type: ignore[union-attr]
        out.append((ref, Window(dim, offset, size, tuple(node.meta.shape))))  # type: ignore[union-attr]
        offset += size
    return out


def branch_windows(graph: Graph, members: list[Node]) -> dict[str, Window] | None:
    """The window of every member computed inside a concatenation's branch, by name: the members its operand
    depends on through other members. None where one would sit in two branches, or has not its branch's shape."""
    inside = {m.name: m for m in members}
    found: dict[str, Window] = {}
    for cat in members:
        if cat.op != CAT:
            continue
        if cat_operands(graph, cat) is None:
            return None
        for ref, window in cat_windows(graph, cat):
            stack = [ref.name]
            while stack:
                name = stack.pop()
                if name not in inside:
                    continue
                if found.get(name, window) != window or inside[name].meta.shape != window.branch_shape:
                    return None
                if name not in found:
                    found[name] = window
                    stack.extend(r.name for r in inside[name].refs)
    return found


def selects(program: Program) -> bool:
    """Does the program select from a concatenation (its flat index must then run over the output row-major)?"""
    return any(st.op == SELECT for st in program.statements)


def windowed(value: torch.Tensor, window: Window) -> torch.Tensor:
    """A tensor read through a window, as the kernel reads it: over the concatenation's shape (broadcast dims
    kept at 1), each index along the dim clamped into the branch."""
    value = value.reshape((1,) * (len(window.shape) - value.dim()) + tuple(value.shape))
    if value.shape[window.dim] == 1:
        return value
    index = (torch.arange(window.shape[window.dim], device=value.device) - window.offset).clamp(0, window.size - 1)
    return value.index_select(window.dim, index)


def selected(values: list[torch.Tensor], params: tuple[object, ...]) -> torch.Tensor:
    """A `cat_select` statement: each branch's value (over the concatenation's shape) where the element's index
    along the dim falls in that branch."""
    dim, sizes, shape = params
    parts, offset = [], 0
    for value, size in zip(values, sizes, strict=True):  # type: ignore[call-overload]
        parts.append(torch.broadcast_to(value, shape).narrow(dim, offset, size))  # type: ignore[arg-type]
        offset += size
    return torch.cat(parts, dim)  # type: ignore[arg-type]
