"""Pooling of every shape as generated kernels: a 1-d max pool (traced as a 2-d pool whose indices are squeezed
and dropped) is one kernel, not the original op; the interpreter and the CPU emulation of the CUDA agree."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated, emulated_and_interpreted
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

from kernelfuse.capture import capture
from kernelfuse.load import load_problem
from kernelfuse.rewrite import apply_rules
from kernelfuse.rewrite.rules import RULE_NAMES

POOLS = """
def forward(self, x):
    return (
        F.max_pool1d(x, 8, stride=1, padding=4, dilation=3),
        F.max_pool1d(x, 4, stride=3, padding=2, ceil_mode=True),
        F.avg_pool1d(x, 5, stride=2, padding=2, count_include_pad=False, ceil_mode=True),
    )
"""


@pytest.fixture(scope="module")
def pool_plan(tmp_path_factory):
    path = write_problem(tmp_path_factory.mktemp("pools1d"), "pools1d", POOLS, "[torch.randn(3, 5, 101)]",
                         header="import torch.nn.functional as F")
    problem, _, (plan,) = pipeline(path)
    return problem, plan


def test_unused_pool_indices_are_dropped_even_without_rewrites(pool_plan):
    """The trace squeezes the 1-d pool's indices though nothing reads them: they are dropped before planning,
    also with every rewrite rule switched off, so the pool's value alone is read and the kernel takes it."""
    problem, plan = pool_plan
    assert [g.spec.kind for g in plan.generated] == ["max_pool", "max_pool", "avg_pool"]
    assert plan.unfused == []
    bare = apply_rules(capture(load_problem(problem.path)), RULE_NAMES).graph
    assert not [n for n in bare.nodes if n.op == "getitem" and n.args[1] == 1]


def test_interpreter_equals_the_model(pool_plan):
    problem, plan = pool_plan
    assert_interpreter_matches(problem, plan)


def test_pool_kernels_run_in_a_cpu_emulation(pool_plan, tmp_path):
    _, plan = pool_plan
    emu = emulated(plan, tmp_path)
    for g in plan.generated:
        out, expected = emulated_and_interpreted(emu, plan, g)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6, msg=lambda m, k=g.kernel: f"{k}: {m}")
