"""`linalg_vector_norm` as the reduction ATen's norm kernel computes, so that the scheduler fuses it like any sum
(L2-normalising a row, `x / torch.norm(x, dim=1, keepdim=True)`, becomes one reduce-then-broadcast kernel;
a Frobenius norm a split sum and a pointwise kernel) instead of a torch call.
"""

from __future__ import annotations

import math

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement


def vector_norm_as_reduction(graph: Graph, node: Node) -> Replacement | None:
    """linalg_vector_norm(x, ord, dim, keepdim) for ord 2, 1, inf and -inf is sqrt(sum(x * x)), sum(|x|),
    amax(|x|) and amin(|x|) over the same dims (none given: all), as ATen's CUDA norm kernels accumulate it
    (in the input's float type, no rescaling, NaN propagating); the sum's order may differ, as any two
    reductions' do. No dtype argument; other orders keep the torch call."""
    if node.op != "linalg_vector_norm.default" or not isinstance(node.args[0], Ref):
        return None
    if node.keywords:
        return None
    x = node.args[0]
    meta = graph[x].meta
    if meta is None or meta.dtype not in FLOATS or not meta.shape:
        return None
    rank = len(meta.shape)
    order = node.args[1] if len(node.args) > 1 else 2
    dims = node.args[2] if len(node.args) > 2 else None
    keepdim = bool(node.args[3]) if len(node.args) > 3 else False
    dims = list(range(rank)) if dims is None or dims == () or dims == [] else \
        [dims] if isinstance(dims, int) else list(dims)  # type: ignore[arg-type]
    b = Builder(graph, node)
    if order == 2:
        total = b.add("sum.dim_IntList", b.add("mul.Tensor", x, x), dims, keepdim)
        return b.done(b.add("sqrt.default", total), "2-norm as sqrt(sum(x * x))")
    if order == 1:
        return b.done(b.add("sum.dim_IntList", b.add("abs.default", x), dims, keepdim), "1-norm as sum(|x|)")
    if isinstance(order, float) and math.isinf(order):
        reduce = "amax.default" if order > 0 else "amin.default"
        return b.done(b.add(reduce, b.add("abs.default", x), dims, keepdim), f"{order}-norm as {reduce[:4]}(|x|)")
    return None
