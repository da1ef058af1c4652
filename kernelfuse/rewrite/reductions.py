"""Rules that make reductions cheaper: over size-1 dims, before affine scalar ops, and after a Linear.

Each rule holds in real arithmetic; where fp32 rounding can differ (the order of a sum changes) the docstring
says so, and the judge checks the result within the precision policy's tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement, scalar, single_use

LIST_REDUCTIONS = frozenset({"sum.dim_IntList", "mean.dim", "amax.default", "amin.default", "logsumexp.default"})
INDEXED_REDUCTIONS = frozenset({"max.dim", "min.dim"})  # (values, indices), read through getitem
LINEAR_REDUCTIONS = frozenset({"sum.dim_IntList", "mean.dim"})


@dataclass(frozen=True)
class Reduction:
    """A reduction node read as (input, reduced dims, keepdim); dims are non-negative and sorted."""

    x: Ref
    dims: tuple[int, ...]
    keepdim: bool


def as_reduction(graph: Graph, node: Node) -> Reduction | None:
    """`node` as a reduction over listed dims of a float tensor, or None (kwargs such as dtype, reduce-all)."""
    if node.op not in LIST_REDUCTIONS | INDEXED_REDUCTIONS or len(node.args) < 2:
        return None
    x, dims = node.args[0], node.args[1]
    if not isinstance(x, Ref) or node.keywords:
        return None
    meta = graph[x].meta
    dims = (dims,) if isinstance(dims, int) else dims
    if meta is None or meta.dtype not in FLOATS or not isinstance(dims, tuple) or not dims:
        return None
    rank = max(len(meta.shape), 1)
    keepdim = bool(node.args[2]) if len(node.args) > 2 else False
    return Reduction(x, tuple(sorted(d % rank for d in dims)), keepdim)


def unused_indices(graph: Graph, multi: Node, values: Node) -> bool:
    """Every reader of a (values, indices) op other than `values` is an unused getitem of the indices."""
    return all(u is values or (u.op == "getitem" and u.args[1] == 1 and not graph.users(u.name)
                               and not graph.is_output(u.name)) for u in graph.users(multi.name))


def size1_reductions(graph: Graph, node: Node) -> Replacement | None:
    """A reduction or normalisation over dims that all have size 1 does nothing to the values.

    sum, mean, amax, amin, logsumexp and max/min (values; the indices must be unused, they would be zeros) over
    size-1 dims return x itself (a view without those dims when keepdim is false): exact for every float value,
    including NaN and +-Inf (logsumexp of one element is that element: ATen replaces an infinite max by 0).
    softmax over a size-1 dim is 1 where x is finite and NaN where x is +-Inf or NaN: written `(x - x) + 1`,
    which is exactly that; log_softmax is `x - x` (0, or NaN at non-finite x). Float dtypes only (an integer
    sum would promote); no dtype argument.
    """
    if node.op in ("_softmax.default", "_log_softmax.default"):
        x, dim, half_to_float = node.args[:3]
        meta = graph[x].meta if isinstance(x, Ref) else None
        if meta is None or meta.dtype not in FLOATS or half_to_float or meta.shape[dim] != 1:
            return None
        b = Builder(graph, node)
        zero = b.add("sub.Tensor", x, x)
        if node.op == "_log_softmax.default":
            return b.done(zero, "log_softmax over a size-1 dim is x - x")
        return b.done(b.add("add.Tensor", zero, 1.0), "softmax over a size-1 dim is (x - x) + 1")
    values = node
    if node.op == "getitem" and node.args[1] == 0 and graph[node.args[0]].op in INDEXED_REDUCTIONS:
        node = graph[node.args[0]]
        if not unused_indices(graph, node, values):
            return None
    elif node.op not in LIST_REDUCTIONS:
        return None
    r = as_reduction(graph, node)
    if r is None or any(graph[r.x].meta.shape[d] != 1 for d in r.dims):
        return None
    b = Builder(graph, values)
    what = f"{node.op.split('.')[0]} over size-1 dims {list(r.dims)}"
    if r.keepdim:
        return b.done(r.x, f"{what} is the identity")
    return b.done(b.add("view.default", r.x, values.meta.shape), f"{what} is a view")


AFFINE_OPS = frozenset({"mul.Tensor", "div.Tensor", "add.Tensor", "sub.Tensor"})


AVG_POOLS = {"avg_pool2d.default": 2, "avg_pool3d.default": 3}  # op -> pooled trailing dims


def broadcasts_into(graph: Graph, operand: object, out: TensorMeta) -> TensorMeta | None:
    """The operand's metadata when it is a tensor of `out`'s dtype that broadcasts into `out` without growing it."""
    meta = graph[operand].meta if isinstance(operand, Ref) else None
    if meta is None or meta.dtype != out.dtype or len(meta.shape) > len(out.shape):
        return None
    offset = len(out.shape) - len(meta.shape)
    return meta if all(d in (1, out.shape[i + offset]) for i, d in enumerate(meta.shape)) else None


def constant_along(graph: Graph, operand: object, out: TensorMeta, dims: tuple[int, ...]) -> bool:
    """`operand` is a tensor that broadcasts into `out` without growing it and has size 1 (or no dim) at every
    dim in `dims`: the same value for every element a reduction over `dims` combines."""
    meta = broadcasts_into(graph, operand, out)
    if meta is None:
        return False
    offset = len(out.shape) - len(meta.shape)
    return all(d < offset or meta.shape[d - offset] == 1 for d in dims)


def reduce_before_affine(graph: Graph, node: Node) -> Replacement | None:
    """sum/mean of (x * c), (x / c), (x + c) or (x - c) moves the op after the reduction, which then runs on the
    smaller tensor and may meet a Linear (see `reduce_linear_output`: `mean(x @ W.T + b - s, 1)` becomes a
    matrix-vector product). c is a finite Python scalar, or a tensor that broadcasts into x without growing it:
    for * and / one constant along the reduced dims (a per-channel scale before a spatial mean or an average
    pooling), for + and - any such tensor (a per-feature vector subtracted before a mean over the features).

    sum(x*c) = sum(x)*c and mean(x*c) = mean(x)*c, division likewise (a scalar c = 0 is left alone: x*0 is NaN
    at Inf and 0 elsewhere); avg_pool(x*c) = avg_pool(x)*c (zero padding scales to zero); sum(x+c) = sum(x) +
    sum(c broadcast), which is n*c for a scalar and, for a tensor, its own sum over the reduced dims it has
    times the sizes of the reduced dims it is broadcast along; mean(x+c) = mean(x) + mean(c) over the reduced
    dims c has (not for pooling: padding would count c); subtraction likewise. Without keepdim the reduced
    dims are dropped from c too, so it broadcasts against the reduced value as it did against x (its dims
    are a suffix of x's). Exact in real arithmetic; in fp32 the rounding moves (one rounding of the scalar
    step instead of n), NaN/Inf propagate the same way for finite x (an Inf in x meeting an Inf in c at
    another position can differ), and an intermediate sum that overflows can differ. The op must be the
    reduction's only reader, keep x's dtype (no promotion) and not broadcast x.
    """
    if node.op in AVG_POOLS:
        x_meta = graph[node.args[0]].meta
        if x_meta is None or x_meta.dtype not in FLOATS:
            return None
        rank = len(x_meta.shape)
        dims, keeps_rank, source = tuple(range(rank - AVG_POOLS[node.op], rank)), True, node.args[0]
    elif node.op in LINEAR_REDUCTIONS and (r := as_reduction(graph, node)) is not None:
        dims, keeps_rank, source = r.dims, r.keepdim, r.x
    else:
        return None
    inner = graph[source]
    if inner.op not in AFFINE_OPS or len(inner.args) != 2 or single_use(graph, inner.name) is not node:
        return None
    a, c = inner.args
    if inner.op in ("mul.Tensor", "add.Tensor") and (not isinstance(a, Ref) or graph[a].meta != inner.meta):
        a, c = c, a
    if not isinstance(a, Ref) or graph[a].meta != inner.meta:
        return None
    value = scalar(c)
    scaling = inner.op in ("mul.Tensor", "div.Tensor")
    b = Builder(graph, node)
    if value is None:
        if scaling and not constant_along(graph, c, inner.meta, dims):
            return None
        if not scaling and (node.op in AVG_POOLS or broadcasts_into(graph, c, inner.meta) is None):
            return None
    elif not math.isfinite(value) or (scaling and value == 0) or (node.op in AVG_POOLS and not scaling):
        return None
    elif not scaling and node.op == "sum.dim_IntList":
        value *= math.prod(inner.meta.shape[d] for d in dims)
    reduced = b.add(node.op, a, *node.args[1:])
    if value is None:
        c = _reduced_operand(b, node.op, c, inner.meta, dims, keeps_rank, summed=not scaling)
    out = b.add(inner.op, reduced, c if value is None else value)
    what, op = node.op.split(".")[0], inner.op.split(".")[0]
    return b.done(out, f"{what}({op}(x, c)) = {op}({what}(x), {f'{what}(c)' if value is None else repr(value)})")


def _reduced_operand(b: Builder, op: str, c: Ref, out: TensorMeta, dims: tuple[int, ...], keepdim: bool,
                     summed: bool) -> Ref:
    """The tensor operand c of an affine op, as it enters after the reduction `op` over `dims` of `out`:
    reduced itself over those dims where it has them (`summed`: an added c; a scaling c has size 1 there), a
    sum multiplied by the number of times c repeats along the reduced dims it is broadcast over, and those dims
    dropped without keepdim."""
    shape = b.meta(c).shape
    offset = len(out.shape) - len(shape)
    own = tuple(d - offset for d in dims if d >= offset and shape[d - offset] != 1)
    if summed and own:
        c = b.add(op, c, own, True)
    repeats = math.prod(out.shape[d] for d in dims if d < offset or shape[d - offset] == 1)
    if summed and op == "sum.dim_IntList" and repeats != 1:
        c = b.add("mul.Tensor", c, float(repeats))
    if not keepdim:
        c = b.add("view.default", c, tuple(s for i, s in enumerate(b.meta(c).shape) if i + offset not in dims))
    return c


def reduce_linear_output(graph: Graph, node: Node) -> Replacement | None:
    """sum/mean over the output features of a matrix product is a matrix-vector product with the weight reduced
    first: sum_j (x @ B)[i, j] = x @ B.sum(1), and for addmm(bias, x, B) plus bias.sum(-1) (mean likewise with
    means). The reduced weight depends on the parameters only: the emitted file computes it once per weight
    version and caches it on the module (kernelfuse.emit.hoist; recomputed when a weight changes).

    Conditions: 2-d mm/addmm without beta/alpha, reduction over dim 1 only, the product has no other reader
    (else the GEMM still runs and nothing is saved), the bias's last dim is the feature dim (a bias broadcast
    along the features would need n * b), float32/float64. Exact in real arithmetic; in floating point the sum
    is reassociated (weights summed first), so the reduced weight and the small product are accumulated in
    float64 (`_narrow_product`) and the result is rounded once.
    For finite inputs only: an Inf in x meets weights of both signs in different columns (NaN in the original
    sum) but their sum in one product here.
    """
    if node.op not in LINEAR_REDUCTIONS:
        return None
    r = as_reduction(graph, node)
    if r is None or r.dims != (1,) or len(graph[r.x].meta.shape) != 2:
        return None
    mm = graph[r.x]
    if mm.op not in ("mm.default", "addmm.default") or single_use(graph, mm.name) is not node:
        return None
    if len(mm.args) != (2 if mm.op == "mm.default" else 3) or not all(isinstance(a, Ref) for a in mm.args):
        return None
    *bias, x, weight = mm.args
    features = mm.meta.shape[1]
    if bias and (not graph[bias[0]].meta.shape or graph[bias[0]].meta.shape[-1] != features):
        return None
    b = Builder(graph, node)
    wide = ("kw", "dtype", torch.float64)
    w = b.add(node.op, weight, (1,), False, wide)  # a vector: the product is cuBLAS's gemv, not an N=1 gemm
    bias_reduced = b.add(node.op, bias[0], (-1,), False, wide) if bias else None
    out = b.add("view.default", _narrow_product(b, bias_reduced, x, w, node.meta.dtype), node.meta.shape)
    kind = node.op.split(".")[0]
    return b.done(out, f"{kind} over {features} output features of {mm.op.split('.')[0]} = x @ weight.{kind}(1)"
                       f"{f' + bias.{kind}()' if bias else ''} ({features}x fewer multiply-adds)")


def _narrow_product(b: Builder, bias: Ref | None, x: Ref, weight: Ref, dtype: torch.dtype) -> Ref:
    """x @ weight (+ bias) for a pre-reduced float64 weight (a matrix, or a vector: then mv/addmv), computed in
    float64 and rounded to `dtype` once.

    The small product is cheap in any precision, and the wider accumulation keeps the result at least as
    accurate as the eager GEMM-then-reduce it replaces (the judge's float64 rule): summed in the input dtype,
    the reassociated sums would lose a few bits against eager's.
    """
    wide = b.add("to.dtype", x, torch.float64)
    vector = len(b.meta(weight).shape) == 1
    plain, biased = ("mv.default", "addmv.default") if vector else ("mm.default", "addmm.default")
    out = b.add(biased, bias, wide, weight) if bias is not None else b.add(plain, wide, weight)
    return b.add("to.dtype", out, dtype)


SIZE1_VIEWS = frozenset({"unsqueeze.default", "view.default", "reshape.default", "_unsafe_view.default"})


def avg_pool_linear_output(graph: Graph, node: Node) -> Replacement | None:
    """Average pooling over the output features of a matrix product is a smaller matrix product with the weight
    columns averaged in groups: mean_{f in group j} (x @ B + b)[i, f] = x @ mean_group_j(B) + mean_group_j(b).

    Matches avg_pool2d over a Linear's output viewed as [N, 1, ..., 1, F] (only size-1 dims added), with a
    kernel and stride of [1, k], no padding, floor mode and no divisor override (every window full, so
    count_include_pad does not matter); trailing features that fill no window are dropped, as the pool drops
    them. The product and the views have no other reader. The averaged weight is computed in float64 (see
    `_narrow_product`), once per weight version in the emitted file (kernelfuse.emit.hoist). Float32/float64.
    Exact in real arithmetic; the sum is reassociated (weights averaged first), like `reduce_linear_output`, and
    the same finite-inputs caveat applies.
    """
    if node.op != "avg_pool2d.default" or len(node.args) < 2 or node.meta is None:
        return None
    kernel, stride = node.args[1], (node.args[2] if len(node.args) > 2 else ())
    rest = tuple(node.args[3:]) + (0, False, True, None)[len(node.args[3:]):]
    padding, ceil_mode, _, divisor = rest[:4]
    if tuple(kernel) != (1, kernel[-1]) or tuple(stride) not in ((), tuple(kernel)) or ceil_mode \
            or divisor is not None or padding not in (0, (0, 0), (0,)):
        return None
    k = kernel[-1]
    src = graph[node.args[0]]
    while src.op in SIZE1_VIEWS and single_use(graph, src.name) is not None:
        src = graph[src.args[0]]
    mm = src
    if mm.op not in ("mm.default", "addmm.default") or mm.meta is None or len(mm.meta.shape) != 2:
        return None
    n, features = mm.meta.shape
    pooled = graph[node.args[0]].meta.shape
    if pooled[0] != n or pooled[-1] != features or any(d != 1 for d in pooled[1:-1]) or mm.meta.dtype not in FLOATS:
        return None
    if single_use(graph, mm.name) is None or not all(isinstance(a, Ref) for a in mm.args) \
            or len(mm.args) != (2 if mm.op == "mm.default" else 3):
        return None
    *bias, x, weight = mm.args
    if bias and graph[bias[0]].meta.shape != (features,):
        return None
    groups = features // k
    b = Builder(graph, node)
    rows = graph[weight].meta.shape[0]
    whole = groups * k == features
    w = b.add("view.default", weight if whole else b.add("slice.Tensor", weight, 1, 0, groups * k), (rows, groups, k))
    wide = ("kw", "dtype", torch.float64)
    w = b.add("mean.dim", w, (2,), False, wide)
    bias_reduced = None
    if bias:
        bb = bias[0] if whole else b.add("slice.Tensor", bias[0], 0, 0, groups * k)
        bias_reduced = b.add("mean.dim", b.add("view.default", bb, (groups, k)), (1,), False, wide)
    out = b.add("view.default", _narrow_product(b, bias_reduced, x, w, node.meta.dtype), node.meta.shape)
    return b.done(out, f"avg_pool by {k} over {features} output features of {mm.op.split('.')[0]} = x @ the weight "
                       f"averaged in groups of {k} ({k}x fewer multiply-adds)")
