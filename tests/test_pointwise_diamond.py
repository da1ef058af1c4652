"""Pointwise diamonds: a branch computed from the same input for one reader joins that reader's kernel
(0.5 * x * (1 + tanh(k * (x + 0.044715 * x**3))), level-1 MinGPTNewGelu, was two kernels and a round trip of the
tanh branch through memory); a branch with another reader stays a kernel of its own."""

from __future__ import annotations

from pathlib import Path

from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

GELU = """
def forward(self, x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
"""
SHARED = """
def forward(self, x):
    t = torch.tanh(x * 2.0)
    return x * t, t + 1.0
"""


def test_branch_read_once_joins_the_kernel(tmp_path: Path) -> None:
    problem, graph, plans = pipeline(write_problem(tmp_path, "gelu", GELU, "[torch.randn(64, 33)]",
                                                   header="import math"))
    plan = plans[0]
    assert len(plan.generated) == 1 and not plan.unfused, plan.summary()
    assert len(plan.generated[0].replaces) == len([n for n in graph.nodes if n.op not in ("input",)])
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_branch_with_another_reader_is_not_pulled_in(tmp_path: Path) -> None:
    problem, graph, plans = pipeline(write_problem(tmp_path, "shared", SHARED, "[torch.randn(64, 33)]"))
    plan = plans[0]
    tanh = next(n.name for n in graph.nodes if n.op == "tanh.default")
    owners = [g for g in plan.generated if tanh in g.replaces]
    assert len(owners) == 1 and owners[0].out == tanh, plan.summary()  # t is an output: its own kernel ends on it
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)
