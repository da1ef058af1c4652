"""Estimated bytes a forward moves through device memory: eager (every ATen op reads its operands and writes its
output) against a plan (every kernel reads the values it takes from outside and writes its result once).

A CPU-only estimate from the captured graph's shapes, for reports where nothing was timed: how much traffic the
fusion removes. Views move nothing. The library calls' own internal traffic (cuBLAS tiles, cuDNN workspaces) is
the same on both sides and left out, as the floor estimate (kernelfuse.bench.floor) leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.capture import Graph
from kernelfuse.plan import Plan
from kernelfuse.plan.ir import TorchStep

SOURCES = ("input", "param", "buffer")
VIEW_OPS = ("view", "_unsafe_view", "reshape", "permute", "expand", "t.", "transpose", "squeeze", "unsqueeze",
            "slice", "select", "alias", "getitem", "detach", "as_strided", "unflatten", "flatten")


@dataclass(frozen=True)
class PlanBytes:
    """Estimated bytes moved per forward."""

    eager: int
    fused: int


def _nbytes(graph: Graph, name: str) -> int:
    meta = graph[name].meta
    return meta.numel * meta.dtype.itemsize if meta is not None else 0


def _is_view(op: str) -> bool:
    return op.startswith(VIEW_OPS)


def _moved(graph: Graph, names: set[str], out: str) -> int:
    """Bytes a step computing `names` moves: the values it reads from outside them, and its output."""
    outside = {r.name for n in names for r in graph[n].refs if r.name not in names}
    return sum(_nbytes(graph, n) for n in outside) + _nbytes(graph, out)


def plan_bytes(plan: Plan) -> PlanBytes:
    """Eager's and the plan's estimated bytes moved (module docstring)."""
    graph = plan.graph
    eager = sum(_moved(graph, {n.name}, n.name) for n in graph.nodes
                if n.op not in SOURCES and not _is_view(n.op))
    fused = 0
    for step in plan.steps:
        if isinstance(step, TorchStep):
            if step.reason != "view" and not _is_view(step.node.op):
                fused += _moved(graph, {step.node.name}, step.node.name)
        else:
            fused += _moved(graph, set(step.replaces), step.out)
            if getattr(step, "needs_kernel", False):  # a library call's epilogue kernel: reads, writes in place
                fused += 2 * _nbytes(graph, step.out)
    return PlanBytes(eager, fused)
