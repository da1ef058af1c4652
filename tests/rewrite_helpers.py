"""Shared helpers for the rewrite-rule tests: `prove` captures a forward in float64, applies the rules, checks
that the named rule fired (or did not) and that the graphs before and after agree with eager; `signed` and
`specials` draw inputs of both signs with exact zeros, and with NaN/Inf mixed in."""

from __future__ import annotations

import torch
from emulation_helpers import node_values
from torch import nn

from kernelfuse.capture import Graph, capture_module
from kernelfuse.rewrite import apply_rules

INF, NAN = float("inf"), float("nan")


class Fn(nn.Module):
    """A forward given as a function of (module, *inputs), with a Linear(8 -> 6) and a per-channel parameter."""

    def __init__(self, fn, bias: bool = True):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(8, 6, bias=bias)
        self.scale = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, *xs):
        return self.fn(self, *xs)


def run_graph(graph: Graph, model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate a graph node by node with the ATen ops themselves (what the planner's torch steps run)."""
    env = node_values(graph, model, inputs)
    return [env[r.name] for r in graph.outputs]


def prove(fn, *inputs: torch.Tensor, rule: str, fires: bool = True, bias: bool = True, rtol: float = 1e-12):
    """Capture fn in float64, rewrite, check `rule` fired (or not) and both graphs agree on `inputs`."""
    torch.manual_seed(0)
    model = Fn(fn, bias).double()
    inputs = [t.double() for t in inputs]
    graph = capture_module(model, inputs)
    result = apply_rules(graph)
    assert (rule in result.rules_fired) == fires, result.fired
    with torch.no_grad():
        before = run_graph(graph, model, inputs)
        after = run_graph(result.graph, model, inputs)
        eager = model(*inputs)
    eager = list(eager) if isinstance(eager, tuple) else [eager]
    for b, a, e in zip(before, after, eager, strict=True):
        assert a.shape == b.shape == e.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12, equal_nan=True)
    return result


def signed(*shape: int) -> torch.Tensor:
    """Random values of both signs with exact zeros."""
    t = torch.randn(*shape) * 3
    t.view(-1)[::5] = 0.0
    return t


def specials(*shape: int) -> torch.Tensor:
    """`signed` with NaN, +Inf and -Inf mixed in."""
    t = signed(*shape)
    flat = t.view(-1)
    flat[1::7], flat[2::11], flat[3::13] = INF, -INF, NAN
    return t
