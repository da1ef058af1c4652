"""A group norm read only through pointwise ops by a reduction over other dims (level-2 92: GroupNorm -> tanh ->
hardswish -> + x -> logsumexp over the channels) as its statistics apart and its normalisation written out.

As one norm kernel it reads its input, writes the normalised tensor, and the reduction reads that tensor again.
Apart, a statistics kernel reads the input and writes two values a row (kernelfuse.ops.reductions' `moments`),
and the normalisation `x * a + b` (a = 1/std * weight, b = bias - mean * a per sample and channel, the fused
parameters ATen's group norm computes) joins the pointwise chain in the reduction's prologue: the normalised
tensor never reaches memory. torch.compile splits a group norm the same way.
"""

from __future__ import annotations

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.ops.pointwise import POINTWISE_BY_ATEN
from kernelfuse.ops.reductions import REDUCTION_BY_ATEN
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement

PLAIN_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "logsumexp"})
MAX_CHAIN = 32  # pointwise ops followed from the norm's output to the reduction


def group_norm_statistics_apart(graph: Graph, node: Node) -> Replacement | None:
    """A group norm's output read, through pointwise ops each read once, by a sum/mean/max/min/prod/logsumexp
    becomes x * a + b with a and b from the norm's mean and 1/std (stacked: one statistics kernel writes both);
    fp32 (and fp64) with weight and bias only (ATen rounds a half-precision norm's statistics to its type)."""
    if node.op != "getitem" or node.args[1] != 0:
        return None
    norm = graph[node.args[0]]  # type: ignore[index]
    if norm.op != "native_group_norm.default":
        return None
    x, weight, bias, n, c, _, groups, eps = norm.args[:8]
    if not all(isinstance(r, Ref) for r in (x, weight, bias)) or not _feeds_a_reduction(graph, node.name):
        return None
    meta = graph[x].meta  # type: ignore[index]
    if meta is None or meta.dtype not in FLOATS or not meta.is_contiguous or c % groups:  # type: ignore[operator]
        return None
    cg = c // groups  # type: ignore[operator]
    b = Builder(graph, node)
    stats = b.add("native_group_norm.default", *norm.args)
    stacked = b.add("stack.default", (b.add("getitem", stats, 1), b.add("getitem", stats, 2)), -1)
    mean, rstd = (b.add("unsqueeze.default", b.add("select.int", stacked, 2, i), 2) for i in (0, 1))
    scale = b.add("mul.Tensor", rstd, b.add("view.default", weight, [groups, cg]))
    shift = b.add("sub.Tensor", b.add("view.default", bias, [groups, cg]), b.add("mul.Tensor", mean, scale))
    per_channel = [n, c] + [1] * (len(meta.shape) - 2)
    y = b.add("add.Tensor", b.add("mul.Tensor", x, b.add("view.default", scale, per_channel)),
              b.add("view.default", shift, per_channel))
    return b.done(y, "group norm's statistics apart, x * a + b into the reduction that reads it")


def _feeds_a_reduction(graph: Graph, value: str) -> bool:
    """Does `value` reach a plain reduction through pointwise ops, each the only reader of the one before?"""
    for _ in range(MAX_CHAIN):
        users = graph.users(value)
        if graph.is_output(value) or len(users) != 1:
            return False
        user = users[0]
        if user.op in REDUCTION_BY_ATEN:
            return REDUCTION_BY_ATEN[user.op].kind in PLAIN_REDUCTIONS
        if user.op not in POINTWISE_BY_ATEN:
            return False
        value = user.name
    return False
