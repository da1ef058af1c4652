"""The reduction table: one row per ATen reduction, softmax or normalisation op the generated kernels compute.

A row reads the node's arguments and says how to iterate it: the `space` (the input's shape, regrouped where the
op's semantics need it, e.g. group norm's [N, G, C/G, HxW]), which of its dims are reduced, and the op's constants
and affine operands. `kind` names the CUDA algorithm (kernelfuse.codegen.reduce renders each kind):

- reducing kinds write one value per row (the kept dims): sum, mean, amax, amin, prod, logsumexp; the index kinds
  argmax and argmin write the row's int64 index of its first extreme (INDEX_KINDS);
- moments writes each row's mean and 1/std, interleaved (a group or training batch norm whose normalisation moved
  into its readers, kernelfuse.rewrite.norms: the statistics kernel reads the input once and writes two values a
  row; a batch norm's running statistics are updated as the norm kernel does);
- broadcasting kinds write the whole space, each element transformed by its row's statistics: softmax,
  log_softmax, norm (layer/group/batch norm in training mode: mean and biased variance), and affine_norm
  (batch norm in eval mode: running statistics, no reduction);
- window kinds write one value per output position of a pooling window over the trailing dims: max_pool,
  avg_pool (the `window` field holds the geometry).

A row that cannot take a node returns the reason as a string; the scheduler reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph, Node, Ref

HALF_DTYPES = (torch.float16, torch.bfloat16)

BROADCAST_KINDS = frozenset({"softmax", "log_softmax", "norm", "affine_norm"})
# kinds whose value is an int64 index into the row, not a float: nothing pointwise fuses behind them
INDEX_KINDS = frozenset({"argmax", "argmin"})


@dataclass(frozen=True)
class PoolWindow:
    """A pooling window over the trailing len(kernel) dims, as ATen's pooling ops take it."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    count_include_pad: bool = True
    divisor: int | None = None
    # adaptive pooling: output q of a dim of n inputs and m outputs pools [q * n // m, ceil((q + 1) * n / m));
    # `kernel` then holds the longest such window per dim, stride and padding are unused
    adaptive: bool = False


@dataclass(frozen=True)
class ReduceSpec:
    """How one reduction node iterates: over `space`, reducing `reduced` dims; `out_index` is the output that
    carries the value (multi-output ops: its getitem index, else None). Affine operands are graph values with
    their element strides over `space` computed by the planner; `running` holds batch norm's running mean and
    variance (updated in place in training mode)."""

    kind: str
    source: Ref
    space: tuple[int, ...]
    reduced: tuple[int, ...]
    source_strides: tuple[int, ...]
    weight: tuple[Ref, tuple[int, ...]] | None = None
    bias: tuple[Ref, tuple[int, ...]] | None = None
    running: tuple[Ref, Ref] | None = None
    eps: float = 0.0
    momentum: float = 0.0
    out_index: int | None = None
    window: PoolWindow | None = None
    # scans (kernelfuse.ops.scans): in reverse order (flip, scan, flip back) and/or exclusive (the identity first,
    # then the scan of all but the last element: eager's cat of zeros with a cumsum of a narrowed input)
    reverse: bool = False
    exclusive: bool = False
    result: str | None = None  # the node carrying the value where it is not the op's own (the cat, the flip back)
    absorbs: tuple[str, ...] = ()  # further nodes the kernel computes (the cat's zeros, the flips)
    # the dtype of the affine parameters and running statistics where it is not the source's (an eval-mode batch
    # norm under autocast: bf16 input, fp32 parameters); None: the source's
    param_dtype: torch.dtype | None = None

    @property
    def broadcast(self) -> bool:
        return self.kind in BROADCAST_KINDS

    @property
    def rows(self) -> int:
        return _prod(s for d, s in enumerate(self.space) if d not in self.reduced)

    @property
    def row_size(self) -> int:
        return _prod(self.space[d] for d in self.reduced)


Parse = Callable[[Graph, Node], "ReduceSpec | str"]


@dataclass(frozen=True)
class ReductionOp:
    aten: str
    kind: str
    parse: Parse


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _kw(node: Node, name: str, default: object = None) -> object:
    return node.keywords.get(name, default)


def _arg(node: Node, pos: int, name: str, default: object = None) -> object:
    plain = node.positional
    return plain[pos] if pos < len(plain) else _kw(node, name, default)


def _source(graph: Graph, node: Node) -> tuple[Ref, tuple[int, ...], tuple[int, ...]] | str:
    src = node.args[0]
    if not isinstance(src, Ref) or graph[src].meta is None:
        return "input is not a tensor"
    meta = graph[src].meta
    if meta.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {meta.dtype} not supported"
    if meta.numel == 0 or not meta.shape:
        return "empty or 0-d input"
    return src, meta.shape, meta.stride


def _dims(dims: object, rank: int) -> tuple[int, ...] | str:
    if dims is None or dims == () or dims == []:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    out = sorted({d % rank for d in dims})  # type: ignore[union-attr]
    return tuple(out)


def _dim_reduction(kind: str, dims_pos: int, keep_pos: int, dtype_kw: bool = False,
                   out_index: int | None = None) -> Parse:
    """sum/mean/amax/amin/logsumexp/prod/max.dim/min.dim: reduce the listed dims (none listed: all dims)."""

    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = _source(graph, node)
        if isinstance(src, str):
            return src
        ref, shape, stride = src
        if dtype_kw and _arg(node, keep_pos + 1, "dtype") is not None:
            return "reduction with a dtype argument"
        dims = _dims(_arg(node, dims_pos, "dim"), len(shape)) if dims_pos >= 0 else tuple(range(len(shape)))
        if isinstance(dims, str):
            return dims
        return ReduceSpec(kind, ref, shape, dims, stride, out_index=out_index)

    return parse


def _arg_reduction(kind: str) -> Parse:
    """argmax/argmin: the index along `dim` of the row's first extreme (NaN counts as the extreme); no dim: the
    index into the flattened tensor, one row of every element (row-major, as the kernel numbers a row's elements).
    keepdim only shapes the output."""

    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = _source(graph, node)
        if isinstance(src, str):
            return src
        ref, shape, stride = src
        dim = _arg(node, 1, "dim")
        dims = tuple(range(len(shape))) if dim is None else (int(dim) % len(shape),)  # type: ignore[call-overload]
        return ReduceSpec(kind, ref, shape, dims, stride)

    return parse


def _softmax(kind: str) -> Parse:
    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = _source(graph, node)
        if isinstance(src, str):
            return src
        ref, shape, stride = src
        if _arg(node, 2, "half_to_float", False):
            return "softmax with half_to_float"
        return ReduceSpec(kind, ref, shape, (int(node.args[1]) % len(shape),), stride)  # type: ignore[arg-type]

    return parse


def _affine(graph: Graph, arg: object, strides: tuple[int, ...], dtype: torch.dtype) -> tuple | str | None:
    if arg is None:
        return None
    if not isinstance(arg, Ref) or graph[arg].meta is None:
        return "affine argument is not a tensor"
    meta = graph[arg].meta
    if meta.dtype != dtype or not meta.is_contiguous:
        return "affine parameter of another dtype or layout"
    return arg, strides


def _layer_norm(graph: Graph, node: Node) -> ReduceSpec | str:
    src = _source(graph, node)
    if isinstance(src, str):
        return src
    ref, shape, stride = src
    normalized = tuple(node.args[1])  # type: ignore[arg-type]
    k = len(shape) - len(normalized)
    if k < 0 or tuple(shape[k:]) != normalized:
        return "normalized_shape does not match the input"
    affine_strides = (0,) * k + tuple(_contiguous(normalized))
    dtype = graph[ref].meta.dtype
    weight = _affine(graph, node.args[2], affine_strides, dtype)
    bias = _affine(graph, node.args[3], affine_strides, dtype)
    if isinstance(weight, str) or isinstance(bias, str):
        return weight if isinstance(weight, str) else bias  # type: ignore[return-value]
    return ReduceSpec("norm", ref, shape, tuple(range(k, len(shape))), stride, weight, bias,
                      eps=float(node.args[4]), out_index=0)  # type: ignore[arg-type]


def _group_norm(graph: Graph, node: Node) -> ReduceSpec | str:
    src = _source(graph, node)
    if isinstance(src, str):
        return src
    ref, shape, stride = src
    n, c, hw, groups, eps = (node.args[i] for i in (3, 4, 5, 6, 7))
    if not graph[ref].meta.is_contiguous or c % groups:  # type: ignore[operator]
        return "non-contiguous input"
    cg = c // groups  # type: ignore[operator]
    space = (n, groups, cg, hw)
    src_strides = (c * hw, cg * hw, hw, 1)  # type: ignore[operator]
    dtype = graph[ref].meta.dtype
    stacked = _stacked_statistics(graph, node)
    if stacked is not None:
        stack, absorbs = stacked
        return ReduceSpec("moments", ref, space, (2, 3), src_strides, eps=float(eps),  # type: ignore[arg-type]
                          result=stack, absorbs=absorbs)
    weight = _affine(graph, node.args[1], (0, cg, 1, 0), dtype)
    bias = _affine(graph, node.args[2], (0, cg, 1, 0), dtype)
    if isinstance(weight, str) or isinstance(bias, str):
        return weight if isinstance(weight, str) else bias  # type: ignore[return-value]
    return ReduceSpec("norm", ref, space, (2, 3), src_strides, weight, bias, eps=float(eps),  # type: ignore[arg-type]
                      out_index=0)


def _stacked_statistics(graph: Graph, node: Node) -> tuple[str, tuple[str, ...]] | None:
    """(the stack, the getitems it reads) where a norm's only readers are its mean and 1/std, stacked along a new
    last dim in that order and read by nothing else (kernelfuse.rewrite.norms's form); None otherwise."""
    readers = graph.users(node.name)
    if len(readers) != 2 or any(r.op != "getitem" for r in readers) or graph.is_output(node.name):
        return None
    items = {r.args[1]: r for r in readers}
    if set(items) != {1, 2} or any(graph.is_output(r.name) or len(graph.users(r.name)) != 1 for r in readers):
        return None
    stack = graph.users(items[1].name)[0]
    last = (-1, len(items[1].meta.shape) if items[1].meta is not None else -1)
    stacked = [Ref(items[1].name), Ref(items[2].name)]
    if stack.op != "stack.default" or list(stack.args[0]) != stacked \
            or (stack.args[1] if len(stack.args) > 1 else 0) not in last:  # type: ignore[call-overload]
        return None
    return stack.name, (items[1].name, items[2].name)


def _batch_norm(graph: Graph, node: Node) -> ReduceSpec | str:
    src = _source(graph, node)
    if isinstance(src, str):
        return src
    ref, shape, stride = src
    if node.op == "_native_batch_norm_legit_no_training.default":  # the eval-mode form autocast's capture gives
        x, w, b, rm, rv, momentum, eps = node.args[:7]
        training = False
    else:
        x, w, b, rm, rv, training, momentum, eps = node.args[:8]
    meta = graph[ref].meta
    if len(shape) < 2 or not _non_overlapping(shape, stride):
        return "batch norm over a 1-d input, or one whose elements overlap"
    n, c = shape[0], shape[1]
    hw = _prod(shape[2:])
    space, strides = (n, c, hw), (c * hw, hw, 1)
    channel, reduced = (0, 1, 0), (0, 2)
    if not meta.is_contiguous:  # channels-last, or a view of a concatenation's buffer: read through the input's
        # strides, per channel (a dense output keeps the input's layout, kernelfuse.plan.ir.GenStep.permuted_out)
        space, strides, channel = shape, stride, (0, 1) + (0,) * (len(shape) - 2)
        reduced = (0, *range(2, len(shape)))
    dtype = graph[ref].meta.dtype
    # eval mode under autocast: a half-precision input with fp32 parameters and statistics, computed in fp32 as
    # ATen and cuDNN do; each parameter is read in its own type
    params = dtype
    if not training and dtype in HALF_DTYPES:
        first = next((a for a in (rm, w, b) if isinstance(a, Ref)), None)
        params = torch.float32 if first is not None and graph[first].meta.dtype == torch.float32 else dtype
    weight = _affine(graph, w, channel, params)
    bias = _affine(graph, b, channel, params)
    if isinstance(weight, str) or isinstance(bias, str):
        return weight if isinstance(weight, str) else bias  # type: ignore[return-value]
    running = None
    if rm is not None or rv is not None:
        if not (isinstance(rm, Ref) and isinstance(rv, Ref)):
            return "only one running statistic given"
        if any(graph[r].meta.dtype != (dtype if training else params) for r in (rm, rv)):
            return "running statistics of another dtype"
        running = (rm, rv)
    stacked = _stacked_statistics(graph, node) if training else None
    if stacked is not None:  # its statistics alone (kernelfuse.rewrite.norms), the running ones updated
        return ReduceSpec("moments", ref, space, reduced, strides, running=running, eps=float(eps),
                          momentum=float(momentum), result=stacked[0], absorbs=stacked[1])
    if not training:
        if running is None:
            return "eval-mode batch norm without running statistics"
        return ReduceSpec("affine_norm", ref, space, (), strides, weight, bias, running, eps=float(eps),
                          out_index=0, param_dtype=params if params != dtype else None)
    return ReduceSpec("norm", ref, space, reduced, strides, weight, bias, running, eps=float(eps),
                      momentum=float(momentum), out_index=0)


def _non_overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """No two indices share an element: each dim, by increasing stride, steps past every offset the ones before it
    reach (dense layouts, and views of a part of one)."""
    reach = 0  # the largest offset the dims so far reach
    for step, size in sorted((t, s) for s, t in zip(shape, stride, strict=True) if s != 1):
        if step <= reach:
            return False
        reach += step * (size - 1)
    return True


def _pool(kind: str, dims: int) -> Parse:
    """max_pool{d}d_with_indices (indices unused) and avg_pool{d}d: one output per window position."""

    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = _source(graph, node)
        if isinstance(src, str):
            return src
        ref, shape, stride = src
        if len(shape) < dims + 1:
            return "pooling input without a batch or channel dim"

        def dimsof(value: object, default: tuple[int, ...]) -> tuple[int, ...]:
            if value is None or value == [] or value == ():
                return default
            values = (value,) if isinstance(value, int) else tuple(value)  # type: ignore[arg-type]
            return values * dims if len(values) == 1 else values

        kernel = dimsof(_arg(node, 1, "kernel_size"), ())
        strides = dimsof(_arg(node, 2, "stride"), kernel)
        padding = dimsof(_arg(node, 3, "padding", 0), (0,) * dims)
        if kind == "max_pool":
            dilation = dimsof(_arg(node, 4, "dilation", 1), (1,) * dims)
            return ReduceSpec(kind, ref, shape, (), stride, out_index=0,
                              window=PoolWindow(kernel, strides, padding, dilation))
        include_pad = bool(_arg(node, 5, "count_include_pad", True))
        divisor = _arg(node, 6, "divisor_override", None)
        return ReduceSpec(kind, ref, shape, (), stride, window=PoolWindow(
            kernel, strides, padding, (1,) * dims, include_pad, int(divisor) if divisor else None))

    return parse


def _adaptive_pool(kind: str, dims: int) -> Parse:
    """_adaptive_avg_pool{d}d and adaptive_max_pool{d}d (indices unused): each output pools its own window."""

    def parse(graph: Graph, node: Node) -> ReduceSpec | str:
        src = _source(graph, node)
        if isinstance(src, str):
            return src
        ref, shape, stride = src
        if len(shape) < dims + 1:
            return "pooling input without a batch or channel dim"
        sizes = tuple(int(o) for o in node.args[1])  # type: ignore[union-attr]
        longest = tuple(-(-n // m) + (1 if n % m else 0) for n, m in zip(shape[-dims:], sizes, strict=True))
        window = PoolWindow(longest, (0,) * dims, (0,) * dims, (1,) * dims, adaptive=True)
        return ReduceSpec(kind, ref, shape, (), stride, out_index=0 if kind == "max_pool" else None, window=window)

    return parse


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))


REDUCTION_OPS: tuple[ReductionOp, ...] = (
    ReductionOp("sum.dim_IntList", "sum", _dim_reduction("sum", 1, 2, dtype_kw=True)),
    ReductionOp("sum.default", "sum", _dim_reduction("sum", -1, 0)),
    ReductionOp("mean.dim", "mean", _dim_reduction("mean", 1, 2, dtype_kw=True)),
    ReductionOp("mean.default", "mean", _dim_reduction("mean", -1, 0)),
    ReductionOp("amax.default", "amax", _dim_reduction("amax", 1, 2)),
    ReductionOp("amin.default", "amin", _dim_reduction("amin", 1, 2)),
    ReductionOp("max.dim", "amax", _dim_reduction("amax", 1, 2, out_index=0)),
    ReductionOp("min.dim", "amin", _dim_reduction("amin", 1, 2, out_index=0)),
    ReductionOp("prod.dim_int", "prod", _dim_reduction("prod", 1, 2, dtype_kw=True)),
    ReductionOp("logsumexp.default", "logsumexp", _dim_reduction("logsumexp", 1, 2)),
    ReductionOp("argmax.default", "argmax", _arg_reduction("argmax")),
    ReductionOp("argmin.default", "argmin", _arg_reduction("argmin")),
    ReductionOp("_softmax.default", "softmax", _softmax("softmax")),
    ReductionOp("_log_softmax.default", "log_softmax", _softmax("log_softmax")),
    ReductionOp("native_layer_norm.default", "norm", _layer_norm),
    ReductionOp("native_group_norm.default", "norm", _group_norm),
    ReductionOp("native_batch_norm.default", "norm", _batch_norm),
    ReductionOp("_native_batch_norm_legit_no_training.default", "norm", _batch_norm),
    ReductionOp("max_pool1d_with_indices.default", "max_pool", _pool("max_pool", 1)),
    ReductionOp("max_pool2d_with_indices.default", "max_pool", _pool("max_pool", 2)),
    ReductionOp("max_pool3d_with_indices.default", "max_pool", _pool("max_pool", 3)),
    ReductionOp("avg_pool1d.default", "avg_pool", _pool("avg_pool", 1)),
    ReductionOp("avg_pool2d.default", "avg_pool", _pool("avg_pool", 2)),
    ReductionOp("avg_pool3d.default", "avg_pool", _pool("avg_pool", 3)),
    ReductionOp("_adaptive_avg_pool2d.default", "avg_pool", _adaptive_pool("avg_pool", 2)),
    ReductionOp("_adaptive_avg_pool3d.default", "avg_pool", _adaptive_pool("avg_pool", 3)),
    ReductionOp("adaptive_max_pool2d.default", "max_pool", _adaptive_pool("max_pool", 2)),
    ReductionOp("adaptive_max_pool3d.default", "max_pool", _adaptive_pool("max_pool", 3)),
)

REDUCTION_BY_ATEN: dict[str, ReductionOp] = {row.aten: row for row in REDUCTION_OPS}
