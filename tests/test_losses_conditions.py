"""Elementwise losses written out (mse, smooth L1, Huber) and comparisons fused as in-kernel conditions: a
where/masked_fill reads its 1.0f/0.0f condition from a comparison in the same kernel, and no bool tensor is ever
read or stored as floats (level-1 HuberLoss shipped the original ops: smooth_l1_loss was one opaque node)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import emulated, emulated_run
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from rewrite_helpers import prove

LOSSES = {
    "mse_mean": lambda m, x, y: F.mse_loss(x, y),
    "mse_none": lambda m, x, y: F.mse_loss(x, y, reduction="none"),
    "smooth_l1_mean": lambda m, x, y: F.smooth_l1_loss(x, y),
    "smooth_l1_sum_beta": lambda m, x, y: F.smooth_l1_loss(x, y, reduction="sum", beta=0.3),
    "huber_sum": lambda m, x, y: F.huber_loss(x, y, reduction="sum", delta=2.0),
    "huber_none_delta": lambda m, x, y: F.huber_loss(x, y, reduction="none", delta=0.7),
    "huber_mean": lambda m, x, y: F.huber_loss(x, y),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses_written_out_match_eager(name: str) -> None:
    x, y = torch.randn(6, 50) * 2, torch.randn(6, 50)
    x[0, :3] = y[0, :3]  # z = 0 exactly, and z on both sides of beta
    x[1, 0], x[2, 1] = float("nan"), float("inf")
    prove(LOSSES[name], x, y, rule="losses_as_pointwise")


def _plan(tmp_path: Path, name: str, body: str, inputs: str):
    problem, graph, plans = pipeline(write_problem(tmp_path, name, body, inputs))
    return problem, graph, plans[-1]


def test_huber_loss_is_one_kernel_on_the_gpu_emulation(tmp_path: Path) -> None:
    problem, _, plan = _plan(tmp_path, "huber", "def forward(self, x, y):\n    return F.smooth_l1_loss(x, y, beta=0.5)",
                             "[torch.randn(16, 300), torch.randn(16, 300)]")
    (step,) = plan.generated
    assert not plan.unfused and "where" in plan.summary(), plan.summary()
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_condition_fused_into_a_pointwise_kernel(tmp_path: Path) -> None:
    body = "def forward(self, x, y):\n    return torch.where(x > y, x * 2.0, torch.masked_fill(y, y < -0.5, 3.0))"
    problem, _, plan = _plan(tmp_path, "cond", body, "[torch.randn(8, 33), torch.randn(8, 33)]")
    (step,) = plan.generated
    assert not plan.unfused, plan.summary()
    assert_interpreter_matches(problem, plan)
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


BOOL_CASES = {
    "comparison_output": "return x > 0.0, x + 1.0",  # a comparison that is an output is stored as bool
    "chain_ending_in_comparison": "return (x * 2.0) > 0.0",  # the float chain stops before the comparison
    "bool_input_condition": "return torch.where(m, x, x * 2.0)",  # a bool tensor in memory
    "shared_condition": "c = x > 0.0\n    return c, torch.where(c, x, x * 2.0)",  # computed outside the kernel
}


@pytest.mark.parametrize("name", sorted(BOOL_CASES))
def test_stored_or_external_bool_is_not_fused(tmp_path: Path, name: str) -> None:
    """No kernel stores a bool result or reads a bool tensor as floats: those ops stay torch calls, each with its
    reason, and the plan still computes the model's outputs."""
    body = f"def forward(self, x, m):\n    {BOOL_CASES[name]}"
    problem, graph, plan = _plan(tmp_path, name, body, "[torch.randn(8, 33), torch.rand(8, 33) > 0.5]")
    bools = {n.name for n in graph.nodes if n.meta is not None and n.meta.dtype == torch.bool and n.op != "input"}
    wheres = {n.name for n in graph.nodes if n.op.startswith("where.")}
    for g in plan.generated:
        assert g.out not in bools, plan.summary()
        if name in ("bool_input_condition", "shared_condition"):
            assert not wheres & set(g.replaces), plan.summary()
    if name == "chain_ending_in_comparison":  # the float part still gets its kernel
        assert [g.out for g in plan.generated] == [next(n.name for n in graph.nodes if n.op == "mul.Tensor")]
    assert_interpreter_matches(problem, plan)
