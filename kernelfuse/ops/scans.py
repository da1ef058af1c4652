"""The scan table: cumsum, cumprod, cummax/cummin (values), logcumsumexp along one dim, each a ReduceSpec whose
kind names the combine op (kernelfuse.codegen.scan renders them).

Two forms eager spells with more ops are recognised here so that one kernel computes them:
- reverse: `flip(x, [d]) -> scan(d) -> flip([d])` is the scan from the row's end (the flips are absorbed);
- exclusive: `cat([identity of shape 1 along d, scan(narrow(x, d, 0, n - 1))], d)` is each element's scan of
  the elements before it (the identity, 0 for a sum and 1 for a product, first).
`scan_reference` computes any of them with torch ops: the CPU interpreter's semantics of a scan kernel.
"""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.ops.reductions import REDUCTION_BY_ATEN, Parse, ReduceSpec, ReductionOp

# kind -> (CUDA combine functor, identity): the identity combined with x is exactly x
SCAN_COMBINE = {"cumsum": ("kf_sum_op", "0.0f"), "cumprod": ("kf_prod_op", "1.0f"),
                "cummax": ("kf_max_op", "(-INFINITY)"), "cummin": ("kf_min_op", "INFINITY"),
                "logcumsumexp": ("kf_logaddexp_op", "(-INFINITY)")}
SCAN_KINDS = frozenset(SCAN_COMBINE)
IDENTITY = {"cumsum": 0.0, "cumprod": 1.0}  # the kinds with an exclusive form in eager's graphs
ONE_ROW_MAX = 16384  # a single row longer than this stays ATen's scan (CUB's decoupled look-back over the GPU)
FILLS = {"zeros_like.default": 0.0, "zeros.default": 0.0, "new_zeros.default": 0.0, "ones_like.default": 1.0,
         "ones.default": 1.0, "new_ones.default": 1.0}


def _scan(kind: str, out_index: int | None = None) -> Parse:
    """A scan along its dim argument of a float tensor; a reverse or exclusive form around it is absorbed."""

    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = node.args[0]
        if not isinstance(src, Ref) or graph[src].meta is None:
            return "scan input is not a tensor"
        meta = graph[src].meta
        if meta.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not meta.shape or meta.numel == 0:
            return f"scan of a {meta.dtype} tensor of shape {list(meta.shape)}"
        if node.keywords.get("dtype") is not None:
            return "scan with a dtype argument"
        dim = int(node.args[1]) % len(meta.shape)  # type: ignore[call-overload]
        spec = ReduceSpec(kind, src, meta.shape, (dim,), meta.stride, out_index=out_index)
        if meta.shape[dim] == 1:
            return "a scan over a size-1 dim is a copy of its input: nothing to compute"
        if spec.rows == 1 and spec.row_size > ONE_ROW_MAX:
            return (f"library at the floor: one row of {spec.row_size} is ATen's single-pass device scan; a block "
                    "per row would run on one multiprocessor")
        return _reverse(graph, node, spec) or _exclusive(graph, node, spec) or spec

    return parse


def _only_reader(graph: Graph, name: str) -> Node | None:
    users = graph.users(name)
    return users[0] if len(users) == 1 and not graph.is_output(name) else None


def _reverse(graph: Graph, node: Node, spec: ReduceSpec) -> ReduceSpec | None:
    """flip(x, [d]) -> scan(d) -> flip([d]): the scan of x from the row's end."""
    dim = spec.reduced[0]
    flip_in, back = graph[spec.source], _only_reader(graph, node.name)
    if spec.out_index is not None or back is None or not _flips(flip_in, dim, len(spec.space)) \
            or not _flips(back, dim, len(spec.space)) or _only_reader(graph, flip_in.name) is not node:
        return None
    meta = graph[flip_in.args[0]].meta  # type: ignore[index]
    return ReduceSpec(spec.kind, flip_in.args[0], meta.shape, (dim,), meta.stride, reverse=True,  # type: ignore[arg-type]
                      result=back.name, absorbs=(flip_in.name,))


def _flips(node: Node, dim: int, rank: int) -> bool:
    return node.op == "flip.default" and len(node.args) >= 2 and isinstance(node.args[0], Ref) \
        and [int(d) % rank for d in node.args[1]] == [dim]  # type: ignore[union-attr]


def _exclusive(graph: Graph, node: Node, spec: ReduceSpec) -> ReduceSpec | None:
    """cat([identity (size 1 along d), scan(narrow(x, d, 0, n - 1))], d): the exclusive scan of x."""
    dim, rank = spec.reduced[0], len(spec.space)
    narrow, cat = graph[spec.source], _only_reader(graph, node.name)
    if spec.kind not in IDENTITY or spec.out_index is not None or cat is None or cat.op != "cat.default" \
            or narrow.op != "slice.Tensor" or not isinstance(narrow.args[0], Ref):
        return None
    x = graph[narrow.args[0]].meta
    n = x.shape[dim] if x is not None and len(x.shape) == rank else -1
    slice_args = [*narrow.args[1:4], *([1] if len(narrow.args) < 5 else narrow.args[4:5])]
    if len(slice_args) != 4 or int(slice_args[0]) % rank != dim or slice_args[1:] != [0, n - 1, 1]:  # type: ignore[call-overload]
        return None
    parts = cat.args[0]
    cat_dim = int(cat.args[1]) % rank if len(cat.args) > 1 else 0  # type: ignore[call-overload]
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] != Ref(node.name) or cat_dim != dim:
        return None
    fill = graph[parts[0]] if isinstance(parts[0], Ref) else None
    if fill is None or FILLS.get(fill.op) != IDENTITY[spec.kind] or _only_reader(graph, fill.name) is not cat \
            or fill.meta is None or fill.meta.shape != x.shape[:dim] + (1,) + x.shape[dim + 1:]:
        return None
    return ReduceSpec(spec.kind, narrow.args[0], x.shape, (dim,), x.stride, exclusive=True, result=cat.name,
                      absorbs=(fill.name,))


def scan_reference(spec: ReduceSpec, x: torch.Tensor) -> torch.Tensor:
    """The scan `spec` describes, with torch ops (reverse and exclusive forms as eager computes them)."""
    dim = spec.reduced[0]
    if spec.reverse:
        x = x.flip(dim)
    if spec.kind in ("cummax", "cummin"):
        y = getattr(torch, spec.kind)(x, dim).values
    else:
        y = getattr(torch, spec.kind)(x, dim)
    if spec.exclusive:
        first = torch.full_like(y.narrow(dim, 0, 1), IDENTITY[spec.kind])
        y = torch.cat([first, y.narrow(dim, 0, y.shape[dim] - 1)], dim)
    return y.flip(dim) if spec.reverse else y


SCAN_OPS: tuple[ReductionOp, ...] = (
    ReductionOp("cumsum.default", "cumsum", _scan("cumsum")),
    ReductionOp("cumprod.default", "cumprod", _scan("cumprod")),
    ReductionOp("cummax.default", "cummax", _scan("cummax", out_index=0)),
    ReductionOp("cummin.default", "cummin", _scan("cummin", out_index=0)),
    ReductionOp("logcumsumexp.default", "logcumsumexp", _scan("logcumsumexp")),
)

# every op a generated kernel computes beyond the pointwise table: reductions, norms, pooling and scans
GENERATED_BY_ATEN: dict[str, ReductionOp] = {**REDUCTION_BY_ATEN, **{row.aten: row for row in SCAN_OPS}}
