"""Graph rewrites before planning: each a pure named function Graph -> Graph, applied in the order of `PASSES`.

Every rule preserves eager numerics exactly (each has a test that proves it on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelfuse.capture import Graph, Node, Ref

# Ops that return their input's value unchanged; in a traced, non-mutating graph they can be bypassed.
IDENTITY_OPS = frozenset({"alias.default", "detach.default", "clone.default", "lift_fresh_copy.default"})
# Of those, the ones that return fresh storage: kept when returned, so the caller never receives an input, a
# parameter or another output itself where the model returned a copy.
COPY_OPS = frozenset({"clone.default", "lift_fresh_copy.default"})


def drop_identities(graph: Graph) -> Graph:
    """Bypass alias/detach/clone so they do not split a fusable chain (skipped if the graph mutates anything).

    A clone the forward returns is kept: the caller gets fresh storage, as from the model, not an input, a
    parameter or another output.
    """
    if any(n.op.split(".")[0].endswith("_") for n in graph.nodes):
        return graph  # an in-place op: a clone may be protecting a value, keep the graph as traced
    returned_copies = set()  # the first copy on each output's chain of identities
    for ref in graph.outputs:
        node = graph[ref]
        while node.op in IDENTITY_OPS and node.args and isinstance(node.args[0], Ref):
            if node.op in COPY_OPS:
                returned_copies.add(node.name)
                break
            node = graph[node.args[0]]
    rename: dict[str, Ref] = {}
    kept = []
    for node in graph.nodes:
        if node.op in IDENTITY_OPS and not any(isinstance(a, tuple) and a[:1] == ("kw",) for a in node.args) \
                and node.name not in returned_copies:
            rename[node.name] = _resolve(node.args[0], rename)
            continue
        kept.append(_rewire(node, rename))
    outputs = tuple(_resolve(r, rename) for r in graph.outputs)
    return Graph(tuple(kept), outputs, graph.training)


def div_by_scalar_to_mul(graph: Graph) -> Graph:
    """`x / c` for a Python scalar c becomes `x * (1/c)` with 1/c rounded to float32, as ATen's CUDA kernel does."""
    nodes = []
    for node in graph.nodes:
        if node.op == "div.Tensor" and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
                and not isinstance(node.args[1], bool) and node.meta is not None \
                and node.meta.dtype in (torch.float32, torch.float16, torch.bfloat16):
            inv = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(node.args[1]), dtype=torch.float32))
            node = Node(node.name, "mul.Tensor", (node.args[0], inv.item()), node.meta, node.target)
        nodes.append(node)
    return Graph(tuple(nodes), graph.outputs, graph.training)


PASSES: tuple[Callable[[Graph], Graph], ...] = (drop_identities, div_by_scalar_to_mul)


def rewrite(graph: Graph, passes: tuple[Callable[[Graph], Graph], ...] = PASSES) -> Graph:
    for rule in passes:
        graph = rule(graph)
    return graph


def _resolve(arg: object, rename: dict[str, Ref]) -> Ref:
    assert isinstance(arg, Ref)
    while arg.name in rename:
        arg = rename[arg.name]
    return arg


def _rewire(node: Node, rename: dict[str, Ref]) -> Node:
    def sub(a: object) -> object:
        if isinstance(a, Ref):
            return _resolve(a, rename)
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        return a

    return Node(node.name, node.op, tuple(sub(a) for a in node.args), node.meta, node.target)
