"""max/min reductions and max pooling commute with non-decreasing pointwise ops: run the op on the reduced values.

For f non-decreasing, max_i f(x_i) = f(max_i x_i) and min_i f(x_i) = f(min_i x_i), ties included, because f of
the largest element is at least f of every element and is attained. Applying f after the reduction touches
k times fewer elements (k the reduced size: the whole row, or the pooling window).
"""

from __future__ import annotations

import math

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement, scalar, single_use
from kernelfuse.rewrite.reductions import INDEXED_REDUCTIONS, as_reduction, constant_along, unused_indices

POOLS = {"max_pool2d_with_indices.default": 2, "max_pool3d_with_indices.default": 3}  # op -> pooled trailing dims
ORDER_REDUCTIONS = frozenset({"amax.default", "amin.default"})


def _window_of_padding_only(pool: Node) -> bool:
    """Can a pooling window hold padding alone? Eager's max over it is -inf, and f(-inf) need not be (relu: 0).
    With dilation 1 every window reaches the input (torch keeps padding at most half the kernel); a dilated,
    padded one can step over it (a 1x1 input, kernel 2, dilation 2, padding 1)."""
    args = list(pool.args) + [None] * 6
    padding, dilation = args[3] or (0,), args[4] or (1,)
    return any(p > 0 for p in padding) and any(d > 1 for d in dilation)


def _non_decreasing(graph: Graph, f: Node, dims: tuple[int, ...], keeps_rank: bool) -> Ref | None:
    """The input x when f(x) is a non-decreasing function of x alone along `dims`, else None.

    Non-decreasing for every float including +-Inf, and NaN in gives NaN out (so a NaN the reduction propagates
    comes out the same): relu, sigmoid, tanh, hardtanh (min <= max), clamp / clamp_min / clamp_max with scalar
    bounds, leaky_relu with slope >= 0, x * c and x / c for finite c > 0, x + c and x - c for a finite scalar c
    or a tensor c that is constant along the reduced dims (size 1 or absent there; only when the reduction
    keeps the rank, else the operand would broadcast against other dims). NOT gelu, silu, mish, hardswish, or
    anything of unknown sign such as a multiplication by a parameter: those are not monotonic.
    """
    if f.keywords or not f.args:
        return None
    x, rest = f.args[0], f.args[1:]
    if f.op in ("mul.Tensor", "add.Tensor") and not isinstance(x, Ref) and rest and isinstance(rest[0], Ref):
        x, rest = rest[0], (x,)
    if not isinstance(x, Ref) or graph[x].meta is None or graph[x].meta != f.meta or f.meta.dtype not in FLOATS:
        return None
    c = scalar(rest[0]) if rest else None
    if f.op in ("relu.default", "sigmoid.default", "tanh.default") and not rest:
        return x
    if f.op == "hardtanh.default":
        lo, hi = (list(rest) + [-1.0, 1.0][len(rest):])[:2]
        return x if scalar(lo) is not None and scalar(hi) is not None and lo <= hi else None
    if f.op in ("clamp.default", "clamp_min.default", "clamp_max.default"):
        return x if all(a is None or scalar(a) is not None for a in rest) else None
    if f.op == "leaky_relu.default":
        return x if not rest or (c is not None and c >= 0) else None
    if f.op in ("mul.Tensor", "div.Tensor"):
        return x if c is not None and math.isfinite(c) and c > 0 else None
    if f.op in ("add.Tensor", "sub.Tensor") and len(rest) == 1:
        if c is not None:
            return x if math.isfinite(c) else None
        return x if keeps_rank and constant_along(graph, rest[0], f.meta, dims) else None
    return None


def reduce_before_monotonic(graph: Graph, node: Node) -> Replacement | None:
    """amax/amin(f(x)) = f(amax/amin(x)), max/min.dim values and max pooling likewise, for f non-decreasing.

    The indices of max/min.dim and of max pooling must be unused (for a merely non-decreasing f, such as relu
    or clamp, argmax may differ on ties). f must have no reader besides the reduction. Exact, NaN and +-Inf
    included (see `_non_decreasing`).
    """
    values = node
    if node.op == "getitem" and node.args[1] == 0:
        node = graph[node.args[0]]
        if node.op not in INDEXED_REDUCTIONS and node.op not in POOLS or not unused_indices(graph, node, values):
            return None
    elif node.op not in ORDER_REDUCTIONS:
        return None
    if node.op in POOLS:
        if _window_of_padding_only(node):
            return None
        inner = graph[node.args[0]]
        rank = len(inner.meta.shape) if inner.meta is not None else 0
        dims, keeps_rank = tuple(range(rank - POOLS[node.op], rank)), True
    else:
        r = as_reduction(graph, node)
        if r is None:
            return None
        inner = graph[r.x]
        dims, keeps_rank = r.dims, r.keepdim
    if single_use(graph, inner.name) is not node:
        return None
    x = _non_decreasing(graph, inner, dims, keeps_rank)
    if x is None:
        return None
    b = Builder(graph, values)
    reduced = b.add(node.op, x, *node.args[1:])
    if values is not node:
        reduced = b.add("getitem", reduced, 0)
    out = b.add(inner.op, *(reduced if a == x else a for a in inner.args))
    what, f = node.op.split(".")[0], inner.op.split(".")[0]
    return b.done(out, f"{what}({f}(x)) = {f}({what}(x)): {f} is non-decreasing")
