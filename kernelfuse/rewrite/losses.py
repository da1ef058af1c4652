"""Elementwise losses written out as the pointwise ops and the reduction ATen's CUDA kernels compute.

`F.mse_loss`, `F.smooth_l1_loss` and `F.huber_loss` reach the graph as one ATen node each, which no kernel
family knows; written out, the per-element loss joins the reduction's prologue (one kernel that reads both
inputs once). The expressions are ATen's CUDA formulas (PointwiseOpsKernel.cu, BinaryMiscOpsKernels.cu) in the
same order of operations, so the elements are bit-identical, except that smooth L1's division by beta becomes a
product with 1/beta rounded to float, as every division by a scalar does here (`div_by_scalar_to_mul`): up to
one ulp apart where beta is not a power of two. The reduction is ATen's `mean()`/`sum()` of the elementwise loss,
as `apply_loss_reduction` does (its summation order is the reduction kernel's own).
"""

from __future__ import annotations

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement, scalar

LOSSES = frozenset({"mse_loss.default", "smooth_l1_loss.default", "huber_loss.default"})
REDUCTIONS = {0: None, 1: "mean.default", 2: "sum.default"}  # at::Reduction: None, Mean, Sum


def losses_as_pointwise(graph: Graph, node: Node) -> Replacement | None:
    """mse_loss(x, y) = (x - y)^2; smooth_l1_loss(x, y, beta) = z < beta ? 0.5 z z / beta : z - 0.5 beta and
    huber_loss(x, y, delta) = z < delta ? 0.5 z z : delta (z - 0.5 delta), z = |x - y| (beta 0: z); then mean,
    sum or nothing as `reduction` says. ATen's formulas in the same operation order (0.5 * beta is exact in
    float); float tensors only."""
    if node.op not in LOSSES or len(node.args) < 2 or not all(isinstance(a, Ref) for a in node.args[:2]):
        return None
    x, y = node.args[0], node.args[1]
    if any(graph[r].meta is None or graph[r].meta.dtype not in FLOATS for r in (x, y)):
        return None
    reduction = node.args[2] if len(node.args) > 2 else 1
    param = scalar(node.args[3]) if len(node.args) > 3 else 1.0
    if reduction not in REDUCTIONS or param is None or param < 0:
        return None
    b = Builder(graph, node)
    d = b.add("sub.Tensor", x, y)
    if node.op == "mse_loss.default":
        loss = b.add("mul.Tensor", d, d)
    else:
        z = b.add("abs.default", d)
        loss = z if param == 0 else _piecewise(b, z, param, huber=node.op == "huber_loss.default")
    if REDUCTIONS[reduction] is not None:
        loss = b.add(REDUCTIONS[reduction], loss)
    return b.done(loss, f"{node.op.split('.')[0]} written out as pointwise ops"
                  + (f" and {REDUCTIONS[reduction].split('.')[0]}" if REDUCTIONS[reduction] else ""))


def _piecewise(b: Builder, z: Ref, param: float, huber: bool) -> Ref:
    near = b.add("lt.Scalar", z, param)
    square = b.add("mul.Tensor", b.add("mul.Tensor", z, 0.5), z)
    if not huber:
        square = b.add("div.Tensor", square, param)
    linear = b.add("sub.Tensor", z, 0.5 * param)
    if huber:
        linear = b.add("mul.Tensor", linear, param)  # delta * (z - 0.5 delta): a product commutes exactly
    return b.add("where.self", near, square, linear)
