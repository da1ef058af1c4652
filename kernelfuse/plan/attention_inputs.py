"""What an attention step reads past (kernelfuse.plan.attention): the copies that only lay its inputs out (a KV
cache's first-call copy, transformers' repeat_kv copies of key and value heads), read through the strides or as
grouped-query heads of the tensors before them, where only the attention reads the copies and nothing in the graph
changes a value in place."""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref

# a value viewed in another shape, same flat order (narrower than kernelfuse.ops.anchors.RESHAPES: no squeezes)
FLAT_RESHAPES = frozenset({"_unsafe_view.default", "view.default", "reshape.default"})


def past_copies(graph: Graph, ref: Ref, chain: set[str]) -> Ref:
    """An SDPA input read past the contiguous copies that only the attention reads (transformers' KV cache on a
    first call: `cat` of an empty cache and the transposed keys, a copy once the empty operand is gone): the
    kernel, or torch's SDPA, reads the strided source. The copies join `chain`. Not where the graph mutates anything
    in place: a copy may then be protecting the value it took (as in rewrite's drop_identities)."""
    node = graph[ref]
    if mutates(graph):
        return ref
    while node.op == "clone.default" and node.meta is not None and private(graph, node, chain) \
            and node.keywords.get("memory_format", torch.contiguous_format) == torch.contiguous_format \
            and isinstance(node.args[0], Ref) and graph[node.args[0]].meta is not None \
            and graph[node.args[0]].meta.shape == node.meta.shape:
        chain.add(node.name)
        ref = node.args[0]
        node = graph[ref]
    return ref


def mutates(graph: Graph) -> bool:
    """Does the graph change any value in place? A copy may then protect the value it took (as in rewrite's
    drop_identities), so attention does not read past it."""
    return any(n.op.split(".")[0].endswith("_") for n in graph.nodes)


def repeated_heads(graph: Graph, ref: Ref, chain: set[str]) -> tuple[Ref, int, tuple[str, ...]] | None:
    """An SDPA key or value made by repeating each of its heads `rep` times in a row (transformers' repeat_kv:
    `x[:, :, None].expand(b, hk, rep, L, D).reshape(b, hk * rep, L, D)`, a copy): the tensor before the repeat, rep
    and the nodes that made the copy, which only the attention reads. Head h of the copy is head h // rep of the
    tensor, as grouped-query attention reads it; the kernel reads it through its strides, with no copy. None where
    the input is no such repeat, or the graph mutates a value in place (`mutates`)."""
    view = graph[ref]
    if view.op not in FLAT_RESHAPES or not isinstance(view.args[0], Ref) or view.meta is None \
            or len(view.meta.shape) != 4:
        return None
    clone = graph[view.args[0]]
    if clone.op != "clone.default" or not isinstance(clone.args[0], Ref):
        return None
    inside = chain | {view.name, clone.name}
    found = repeated_source(graph, graph[clone.args[0]], inside)
    if found is None or not private(graph, view, inside) or not private(graph, clone, inside):
        return None
    source, rep, nodes = found
    b, hk, length, d = source.meta.shape
    if tuple(view.meta.shape) != (b, hk * rep, length, d):
        return None
    return Ref(source.name), rep, (view.name, clone.name, *nodes)


def repeated_source(graph: Graph, node: Node, chain: set[str]) -> tuple[Node, int, tuple[str, ...]] | None:
    """The hand-written form's view of repeat_kv, its reshape and copy already walked past: the broadcasting
    `expand(b, hk, rep, L, D)` of `x[:, :, None]`. (x, rep, the expand and the unsqueeze), or None (also where
    the graph mutates a value in place)."""
    if node.op != "expand.default" or node.meta is None or len(node.meta.shape) != 5 or mutates(graph):
        return None
    unsqueeze = graph[node.args[0]]
    if unsqueeze.op != "unsqueeze.default" or unsqueeze.args[1] not in (2, -3) \
            or not isinstance(unsqueeze.args[0], Ref):
        return None
    source = graph[unsqueeze.args[0]]
    if source.meta is None or len(source.meta.shape) != 4:
        return None
    b, hk, length, d = source.meta.shape
    rep = node.meta.shape[2]
    if tuple(node.meta.shape) != (b, hk, rep, length, d) or not private(graph, node, chain) \
            or not private(graph, unsqueeze, chain | {node.name}):
        return None
    return source, rep, (node.name, unsqueeze.name)


def private(graph: Graph, node: Node, chain: set[str]) -> bool:
    """Is `node` read only by members of `chain` (and no graph output)?"""
    return not graph.is_output(node.name) and all(u.name in chain for u in graph.users(node.name))
