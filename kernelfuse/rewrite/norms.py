"""A norm whose normalised output is better recomputed where it is read than stored: its statistics apart, its
normalisation written out as pointwise ops that join the kernel reading them.

- A group norm read, through pointwise ops, by a reduction over other dims (level-2 92: GroupNorm -> tanh ->
  hardswish -> + x -> logsumexp over the channels). As one norm kernel it reads its input, writes the normalised
  tensor, and the reduction reads that again. Apart, a statistics kernel reads the input and writes two values a
  row (kernelfuse.ops.reductions' `moments`), and `x * a + b` (a = 1/std * weight, b = bias - mean * a per sample
  and channel: the fused parameters ATen's group norm computes) joins the reduction's prologue.
- A training-mode batch norm whose output meets another norm's in a pointwise op (a ResNet block's residual,
  `bn2(conv2(y)) + bn(downsample(x))`, level-3 8): the norm kernel wrote its output for the other norm's kernel to
  read back; apart, `(x - mean) * invstd * weight + bias` (ATen's elementwise form) runs inside the kernel that
  reads it.

torch.compile splits norms the same way. The statistics node is the norm itself, read through its mean and 1/std
outputs stacked (its running statistics update stays where it was).
"""

from __future__ import annotations

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.ops import VIEW_OPS
from kernelfuse.ops.pointwise import POINTWISE_BY_ATEN
from kernelfuse.ops.reductions import REDUCTION_BY_ATEN
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement

PLAIN_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "logsumexp"})
MAX_CHAIN = 32  # pointwise ops followed from the norm's output


def norm_statistics_apart(graph: Graph, node: Node) -> Replacement | None:
    """A group norm's output read, through pointwise ops each read once, by a sum/mean/max/min/prod/logsumexp,
    or a training batch norm's output meeting another's (`_from_a_norm`) in a pointwise op, becomes its
    normalisation written out from the norm's mean and 1/std (stacked: one statistics kernel writes both).
    fp32 (and fp64) with weight and bias only (ATen rounds a half-precision norm's statistics to its type)."""
    if node.op != "getitem" or node.args[1] != 0:
        return None
    norm = graph[node.args[0]]  # type: ignore[index]
    if norm.op == "native_group_norm.default":
        x, weight, bias = norm.args[:3]
        n, c, groups = norm.args[3], norm.args[4], norm.args[6]
        if c % groups or not _feeds_a_reduction(graph, node.name):  # type: ignore[operator]
            return None
    elif _training_batch_norm(norm):
        x, weight, bias = norm.args[:3]
        if not _meets_another_norm(graph, node.name):
            return None
    else:
        return None
    if not all(isinstance(r, Ref) for r in (x, weight, bias)) or len(graph.users(norm.name)) != 1:
        return None  # its statistics are read already: the kernel writing them is the norm's own
    meta = graph[x].meta  # type: ignore[index]
    if meta is None or meta.dtype not in FLOATS or not meta.is_contiguous or len(meta.shape) < 2:
        return None
    b = Builder(graph, node)
    stacked = b.add("stack.default", (b.add("getitem", Ref(norm.name), 1), b.add("getitem", Ref(norm.name), 2)), -1)
    mean, rstd = (b.add("select.int", stacked, -1, i) for i in (0, 1))
    channels = [1, meta.shape[1]] + [1] * (len(meta.shape) - 2)
    if norm.op == "native_batch_norm.default":
        def per_channel(v: Ref) -> Ref:
            return b.add("view.default", v, channels)
        y = b.add("mul.Tensor", b.add("sub.Tensor", x, per_channel(mean)), per_channel(rstd))
        y = b.add("add.Tensor", b.add("mul.Tensor", y, per_channel(weight)), per_channel(bias))  # type: ignore[arg-type]
        return b.done(y, "batch norm's statistics apart, its normalisation into the kernel that reads it")
    cg = c // groups  # type: ignore[operator]
    mean, rstd = (b.add("unsqueeze.default", v, 2) for v in (mean, rstd))
    scale = b.add("mul.Tensor", rstd, b.add("view.default", weight, [groups, cg]))
    shift = b.add("sub.Tensor", b.add("view.default", bias, [groups, cg]), b.add("mul.Tensor", mean, scale))
    per_sample = [n, c] + [1] * (len(meta.shape) - 2)
    y = b.add("add.Tensor", b.add("mul.Tensor", x, b.add("view.default", scale, per_sample)),
              b.add("view.default", shift, per_sample))
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


def _meets_another_norm(graph: Graph, value: str) -> bool:
    """Does `value`, through pointwise ops each the only reader of the one before, meet in a pointwise op another
    operand computed from a norm (`_from_a_norm`)?"""
    for _ in range(MAX_CHAIN):
        users = graph.users(value)
        if graph.is_output(value) or len(users) != 1 or users[0].op not in POINTWISE_BY_ATEN:
            return False
        user = users[0]
        if any(r.name != value and _from_a_norm(graph, r.name) for r in user.refs):
            return True
        value = user.name
    return False


def _from_a_norm(graph: Graph, value: str) -> bool:
    """Is `value`, read once, computed through pointwise ops and views from a training batch norm's output read
    once, or from its statistics (one this rule wrote out already)? Then both norms' normalisations run in the one
    kernel that meets them, and neither is stored. (A norm output also read elsewhere is stored anyway: splitting
    its partner would only move the same passes around.)"""
    if len(graph.users(value)) != 1:
        return False
    seen, todo = set(), [value]
    while todo and len(seen) < MAX_CHAIN:
        node = graph[Ref(todo.pop())]
        seen.add(node.name)
        if node.op == "getitem" and _training_batch_norm(graph[node.args[0]]):  # type: ignore[index]
            return node.args[1] != 0 or len(graph.users(node.name)) == 1
        if node.op in POINTWISE_BY_ATEN or node.op in VIEW_OPS or node.op == "stack.default":
            todo += [r.name for r in node.refs if r.name not in seen]
    return False


def _training_batch_norm(node: Node) -> bool:
    return node.op == "native_batch_norm.default" and node.args[5] is True
