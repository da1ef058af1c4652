"""Chains that collapse and values computed twice: exact clean-ups that remove whole ops."""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.capture.graph import pure
from kernelfuse.rewrite.engine import Builder, Replacement, scalar, single_use

INF = float("inf")


def common_subexpressions(graph: Graph, node: Node) -> Replacement | None:
    """A pure op applied to the same arguments as an earlier node is that node's value (exact: ATen ops are
    deterministic for equal inputs). Never merged: in-place, random (dropout, bernoulli), uninitialised (empty)
    and batch-norm nodes, and an output that would then share storage with another output."""
    if not pure(node):
        return None
    earlier = graph.first_equal(node)
    if earlier is node:
        return None
    return Builder(graph, node).done(Ref(earlier.name), f"same as %{earlier.name}")


NEUTRAL = {"mul.Tensor": 1.0, "div.Tensor": 1.0, "add.Tensor": 0.0, "sub.Tensor": 0.0}


def neutral_scalars(graph: Graph, node: Node) -> Replacement | None:
    """x * 1, 1 * x, x / 1, x + 0, 0 + x and x - 0 are x. Exact for every value including NaN and +-Inf, except
    that -0.0 + 0 is +0.0 (the sign of a zero only). Only when the result keeps x's dtype and shape (an integer
    tensor times 1.0 is a float tensor) and there is no alpha argument."""
    if node.op not in NEUTRAL or len(node.args) != 2:
        return None
    x, c = node.args
    if node.op in ("mul.Tensor", "add.Tensor") and not isinstance(x, Ref):
        x, c = c, x
    if not isinstance(x, Ref) or scalar(c) != NEUTRAL[node.op] or graph[x].meta != node.meta:
        return None
    return Builder(graph, node).done(x, f"{node.op.split('.')[0]} by {c!r} is the identity")


def cat_without_empties(graph: Graph, node: Node) -> Replacement | None:
    """cat drops the operands that add nothing: size 0 along the dim, or ATen's legacy 1-d empty of shape (0,),
    which cat skips whatever the dim (transformers' KV cache: an empty tensor concatenated with the first keys and
    values in every layer). With one operand left the cat is a copy of it: a plain `clone` of a contiguous operand,
    which drop_identities bypasses where nothing in the graph is mutated in place, else a contiguous one (cat's
    output is contiguous: the copy stays, the empty tensor's making goes). Exact: the same values, only where the
    result keeps the remaining operands' dtype (cat promotes over every operand, the empty ones included)."""
    if node.op != "cat.default" or not node.args or not isinstance(node.args[0], (list, tuple)) or node.meta is None:
        return None
    tensors, rank = node.args[0], len(node.meta.shape)
    dim = node.args[1] if len(node.args) > 1 else 0
    if rank == 0 or not isinstance(dim, int) or not all(isinstance(t, Ref) and graph[t].meta for t in tensors):
        return None
    dim %= rank

    def adds_nothing(t: Ref) -> bool:
        shape = tuple(graph[t].meta.shape)
        return shape == (0,) or (len(shape) == rank and shape[dim] == 0)

    kept = [t for t in tensors if not adds_nothing(t)]
    if not kept or len(kept) == len(tensors) or any(graph[t].meta.dtype != node.meta.dtype for t in kept):
        return None
    b = Builder(graph, node)
    if len(kept) > 1:
        out = b.add("cat.default", tuple(kept), dim)
    elif graph[kept[0]].meta.stride == node.meta.stride:
        out = b.add("clone.default", kept[0])
    else:
        out = b.add("clone.default", kept[0], ("kw", "memory_format", torch.contiguous_format))
    return b.done(out, f"cat without its {len(tensors) - len(kept)} empty operand(s)")


def pad_without_padding(graph: Graph, node: Node) -> Replacement | None:
    """constant_pad_nd with every pad 0 is a copy of its input: a `clone` (what ATen itself returns then), which
    fuses into a kernel, or which drop_identities bypasses, where the copy ran on its own (torchvision's Swin pads
    each window to a multiple of its size: by 0 on its own shapes). Exact."""
    if node.op != "constant_pad_nd.default" or len(node.args) < 2 or not isinstance(node.args[0], Ref):
        return None
    pad = node.args[1]
    if not isinstance(pad, (list, tuple)) or any(p != 0 for p in pad) or graph[node.args[0]].meta != node.meta:
        return None
    b = Builder(graph, node)
    return b.done(b.add("clone.default", node.args[0]), "padding by 0 is a copy")


def _clamp_bounds(node: Node) -> tuple[float, float] | None:
    """(lo, hi) of a clamp-like op with scalar bounds (-inf/inf where unbounded), or None."""
    args = node.args[1:]
    if node.op == "relu.default" and not args:
        return 0.0, INF
    if node.op == "hardtanh.default":
        args = (list(args) + [-1.0, 1.0][len(args):])[:2]
    elif node.op == "clamp_min.default":
        args = (args[0], None) if len(args) == 1 else ()
    elif node.op == "clamp_max.default":
        args = (None, args[0]) if len(args) == 1 else ()
    elif node.op != "clamp.default":
        return None
    args = list(args) + [None] * (2 - len(args))
    if len(args) != 2 or any(a is not None and scalar(a) is None for a in args):
        return None
    lo, hi = (-INF if args[0] is None else float(args[0])), (INF if args[1] is None else float(args[1]))
    return (lo, hi) if lo <= hi else None


def collapse_clamps(graph: Graph, node: Node) -> Replacement | None:
    """Two clamps in a row (relu, hardtanh, clamp, clamp_min, clamp_max with scalar bounds) are one clamp to the
    intersection of their ranges: clamp(clamp(x, a1, b1), a2, b2) = clamp(x, max(a1, a2), min(b1, b2)) when
    a1 <= b1, a2 <= b2 and the ranges overlap (disjoint ranges give a constant: left alone). relu(relu(x)) is
    relu(x). Exact, NaN included (every clamp passes NaN through). The inner clamp must have no other reader."""
    outer = _clamp_bounds(node)
    if outer is None or not node.args or not isinstance(node.args[0], Ref):
        return None
    inner_node = graph[node.args[0]]
    inner = _clamp_bounds(inner_node)
    if inner is None or single_use(graph, inner_node.name) is not node or not isinstance(inner_node.args[0], Ref):
        return None
    lo, hi = max(inner[0], outer[0]), min(inner[1], outer[1])
    if lo > hi:
        return None
    x = inner_node.args[0]
    b = Builder(graph, node)
    if (lo, hi) == (0.0, INF) and node.op == inner_node.op == "relu.default":
        out = b.add("relu.default", x)
    else:
        out = b.add("clamp.default", x, None if lo == -INF else lo, None if hi == INF else hi)
    return b.done(out, f"{node.op.split('.')[0]}({inner_node.op.split('.')[0]}(x)) = clamp(x, {lo}, {hi})")


def mish_written_out(graph: Graph, node: Node) -> Replacement | None:
    """x * tanh(softplus(x)) (either order of the product) is mish(x): ATen's mish is x * tanh(log1p(exp(x))), and
    softplus (beta 1) is log1p(exp(x)) up to its threshold; past it (20 or more) softplus is x, where tanh of either
    is 1 in float32 and float64 (from x = 9.1 and 19.1 on). The same arithmetic, NaN and +-Inf included, in float32
    and float64 (ATen's CUDA kernels compute both forms with expf, log1pf and tanhf; its vectorised CPU kernels
    differ by an ulp); other dtypes round the intermediate values, which mish does not. The tanh and softplus must
    have no other reader, so that they go."""
    if node.op != "mul.Tensor" or len(node.args) != 2 or not all(isinstance(a, Ref) for a in node.args):
        return None
    for t, x in (node.args, node.args[::-1]):
        tanh = graph[t]
        if tanh.op != "tanh.default" or single_use(graph, tanh.name) is not node or not isinstance(tanh.args[0], Ref):
            continue
        soft = graph[tanh.args[0]]
        if soft.op != "softplus.default" or soft.keywords or soft.args[0] != x \
                or single_use(graph, soft.name) is not tanh:
            continue
        beta = scalar(soft.args[1]) if len(soft.args) > 1 else 1.0
        threshold = scalar(soft.args[2]) if len(soft.args) > 2 else 20.0
        if beta != 1.0 or threshold is None or threshold < 20.0:
            continue
        if any(m is None or m.dtype not in (torch.float32, torch.float64) or m != node.meta
               for m in (graph[x].meta, soft.meta, tanh.meta)):
            continue
        b = Builder(graph, node)
        return b.done(b.add("mish.default", x), "x * tanh(softplus(x)) = mish(x)")
    return None


def double_views(graph: Graph, node: Node) -> Replacement | None:
    """A transpose undone (t(t(x)), transpose(transpose(x, a, b), a, b)), permutes composed into one (or none
    when they cancel), and a view/reshape to the shape its input already has, are x or one view of x. Views
    only re-index: exact for every value."""
    if not node.args or not isinstance(node.args[0], Ref):
        return None
    inner = graph[node.args[0]]
    b = Builder(graph, node)
    if node.op in ("view.default", "reshape.default", "_unsafe_view.default"):
        if inner.meta is not None and tuple(inner.meta.shape) == tuple(node.meta.shape):
            return b.done(node.args[0], "view to the shape it has")
        return None
    if not inner.args or not isinstance(inner.args[0], Ref):
        return None
    x = inner.args[0]
    if node.op == inner.op == "t.default":
        return b.done(x, "t(t(x)) = x")
    rank = len(node.meta.shape) if node.meta is not None else 0
    if node.op == inner.op == "transpose.int" and len(node.args) == len(inner.args) == 3 \
            and {d % rank for d in node.args[1:]} == {d % rank for d in inner.args[1:]}:
        return b.done(x, "transpose(transpose(x)) = x")
    if node.op == inner.op == "permute.default":
        p, q = [d % rank for d in inner.args[1]], [d % rank for d in node.args[1]]
        composed = tuple(p[i] for i in q)
        if composed == tuple(range(rank)):
            return b.done(x, "permute(permute(x)) = x")
        return b.done(b.add("permute.default", x, composed), "two permutes are one")
    return None
