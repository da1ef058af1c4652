"""Training-mode dropout as eager runs it on the GPU.

Captured on the CPU (fake tensors), `F.dropout(x, p)` records ATen's CPU decomposition: `empty_like(x)`,
`bernoulli_(keep)`, `div_(keep)`, `x * mask`. On a CUDA tensor eager calls `native_dropout(x, p, True)` instead,
whose mask comes from another RNG call: a plan that keeps the CPU decomposition draws a different mask than eager
under the same seed (the judge rejected level-2 problem 66 for it: 2% of elements off by up to 1).
"""

from __future__ import annotations

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.rewrite.engine import FLOATS, Builder, NoMatch, rebuild, rewire


def dropout_as_on_cuda(graph: Graph) -> Graph:
    """x * (bernoulli_(empty_like(x), keep) / keep) becomes native_dropout(x, 1 - keep, True)[0]: the op eager
    calls for a CUDA tensor, so the mask comes from the same RNG call and matches eager's under the same seed
    (on the CPU native_dropout draws the same mask as the decomposition: both are one bernoulli_ of x's shape).

    Conditions: the three mask nodes read only by the next one, one `keep` in (0, 1), a float x. p = 1 - keep
    gives native_dropout back eager's 1 - p exactly for keep >= 0.5 (p <= 0.5; Sterbenz), else within one
    ulp of the double (the scale 1/keep and the threshold then differ by at most that).
    """
    skipped: set[str] = set()
    while True:  # one dropout at a time: each replacement's new node names are unique in the graph it enters
        match = next(((n, chain) for n in graph.nodes if n.name not in skipped
                      and (chain := _mask_chain(graph, n)) is not None), None)
        if match is None:
            return graph
        node, (empty, bern, div) = match
        b = Builder(graph, node)
        try:
            pair = b.add("native_dropout.default", empty.args[0], 1.0 - div.args[1], True)  # div_ by keep
            value = b.add("getitem", pair, 0)
        except NoMatch:
            skipped.add(node.name)
            continue
        rename = {node.name: value}
        dropped = {node.name, empty.name, bern.name, div.name}
        nodes: list[Node] = []
        for n in graph.nodes:
            if n is node:
                nodes.extend(b.nodes)
            elif n.name not in dropped:
                nodes.append(rewire(n, rename))
        graph = rebuild(graph, nodes, tuple(rename.get(r.name, r) for r in graph.outputs))


def _mask_chain(graph: Graph, node: Node) -> tuple[Node, Node, Node] | None:
    """(empty_like, bernoulli_, div_) when `node` is x * that mask, else None."""
    if node.op != "mul.Tensor" or len(node.args) != 2 or not all(isinstance(a, Ref) for a in node.args):
        return None
    x, mask = node.args
    div = graph[mask]
    if div.op != "div_.Scalar" or not isinstance(div.args[0], Ref):
        return None
    bern = graph[div.args[0]]
    if bern.op != "bernoulli_.float" or not isinstance(bern.args[0], Ref) or len(bern.args) > 2:
        return None
    empty = graph[bern.args[0]]
    if empty.op != "empty_like.default" or empty.args != (x,):
        return None
    keep = bern.args[1] if len(bern.args) == 2 else 0.5  # the schema's default p, left out of the trace
    if not isinstance(keep, float) or div.args[1] != keep or not 0.0 < keep < 1.0:
        return None
    meta = graph[x].meta
    if meta is None or meta.dtype not in FLOATS:
        return None
    readers = [(empty, bern), (bern, div), (div, node)]
    if any([u.name for u in graph.users(a.name)] != [b.name] or graph.is_output(a.name) for a, b in readers):
        return None
    return empty, bern, div
