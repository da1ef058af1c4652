"""Which values may share storage, which an op writes, and which depend on the weights alone: the facts that
decide what the emitted forward may cache (kernelfuse.emit.hoist) or lay out in a shared buffer
(kernelfuse.plan.catbuffer)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kernelfuse.capture import Graph, Node, Ref, aten_overload
from kernelfuse.capture.graph import pure
from kernelfuse.ops import VIEW_OPS

STATE_OPS = ("param", "buffer")


def weight_only(graph: Graph, device_args: bool = False) -> frozenset[str]:
    """Nodes whose values depend only on parameters, buffers and constants, the same in every call.

    Excluded: forward inputs and everything computed from them; impure ops (random draws, uninitialised memory,
    in-place ops, batch norm, whose running statistics change in training mode); every tensor an op writes, with
    the values sharing its storage (a buffer the forward updates differs before and after the update); ops with
    a device argument (a constant made on the inputs' device, which the cache key does not see), unless
    `device_args` (a caller that checks the values where they are: the attention's causal guard, for masks that
    library code builds with `arange(..., device=...)`, as transformers' Llama does).
    """
    written = alias_closure(graph, (r.name for n in graph.nodes if n.op not in (*STATE_OPS, "input")
                                    and not pure(n) for r in written_args(n)))
    constant: set[str] = set()
    for node in graph.nodes:
        if node.name in written or node.op == "input":
            continue
        if node.op in STATE_OPS or (pure(node) and (device_args or not _has_device(node.args))
                                    and all(r.name in constant for r in node.refs)):
            constant.add(node.name)
    return frozenset(constant)


def alias_closure(graph: Graph, names: Iterable[str]) -> set[str]:
    """`names` and every value whose storage they may share, back through views and aliasing ops."""
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            if may_alias(graph[name]):
                todo.extend(r.name for r in graph[name].refs)
    return out


def written_args(node: Node) -> list[Ref]:
    """The tensors an impure op may write: the arguments its schema marks `(a!)`; batch norm's running statistics
    (its schema hides their update in training mode); every argument of an op without a schema."""
    fn = aten_overload(node.op)
    if fn is None:
        return list(node.refs)
    hidden = ("running_mean", "running_var") if "batch_norm" in node.op else ()
    schema = {a.name: a for a in fn._schema.arguments}
    positional = list(fn._schema.arguments)
    out: list[Ref] = []
    for i, a in enumerate(node.args):
        kw = isinstance(a, tuple) and len(a) == 3 and a[0] == "kw"
        arg = schema.get(a[1]) if kw else (positional[i] if i < len(positional) else None)
        if arg is None or arg.name in hidden or (arg.alias_info is not None and arg.alias_info.is_write):
            out += Node("", "", (a[2] if kw else a,)).refs
    return out


def may_alias(node: Node) -> bool:
    """The op may return its input's storage: a view, or an op whose schema says so (`to` to the same dtype,
    `contiguous` of a contiguous tensor, `expand`...). Unknown ops are assumed to."""
    if node.op in VIEW_OPS:
        return True
    fn = aten_overload(node.op)
    return fn is None or any(r.alias_info is not None for r in fn._schema.returns)


def _has_device(args: tuple) -> bool:
    return any(isinstance(a, torch.device) or (isinstance(a, tuple) and _has_device(a)) for a in args)
