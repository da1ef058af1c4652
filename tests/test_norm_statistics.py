"""A group norm whose output a reduction over other dims reads (level-2 92's form): its statistics in a kernel of
their own, its normalisation inside the reduction's prologue (kernelfuse.rewrite.norms, the `moments` kind)."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from rewrite_helpers import prove
from torch import nn

RULE = "group_norm_statistics_apart"

MODEL = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(3, 8, 3, padding=1)
    self.norm = nn.GroupNorm(2, 8)

def forward(self, x):
{body}
"""


def _plans(tmp_path, body: str):
    return pipeline(write_problem(tmp_path, "gn", MODEL.format(body=body), "[torch.randn(2, 3, 6, 6)]"))


@pytest.mark.parametrize("reduce", ["torch.logsumexp(z, dim=1)", "z.amin(dim=1, keepdim=True)", "z.mean()"])
def test_the_normalisation_moves_into_the_reduction(tmp_path, reduce):
    """conv -> GroupNorm -> tanh -> + conv -> a reduction: one statistics kernel reading the raw conv output, the
    normalisation inside the reduction's kernel, no normalised tensor stored; the CPU check, and every generated
    kernel emulated on the CPU against the interpreter."""
    problem, graph, plans = _plans(tmp_path, f"""
    y = self.conv(x)
    z = torch.tanh(self.norm(y)) + y
    return {reduce}
    """)
    for plan in plans:
        moments = [s for s in plan.generated if s.family == "moments"]
        assert len(moments) == 1 and not any(s.family == "norm" for s in plan.generated), plan.summary()
        reduction = next(s for s in plan.generated if s.reduce_node is not None and s.family != "moments")
        ops = [st.op for st in reduction.prologue.statements]
        assert "tanh" in ops and ops.count("mul") >= 1, ops  # x * a + b, then the chain, in the reduction
        if plan.variant != "fused-igemm":  # the conv's bias is recomputed in both kernels, never stored
            anchor = plan.fused[0]
            assert not anchor.needs_kernel and moments[0].source.ref.name == reduction.source.ref.name == anchor.out
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)
    assert emulated_against_interpreter(plans[0], tmp_path, ulps=4) >= 3


@pytest.mark.parametrize("body, fires", [
    ("return torch.logsumexp(torch.tanh(m.norm(x)) + x, dim=1)", True),
    ("return m.norm(x).sum(dim=(2, 3))", True),
    ("return torch.tanh(m.norm(x))", False),  # nothing reduces it: the norm kernel stays
    ("y = m.norm(x)\n    return y, y.sum(dim=1)", False),  # the normalised tensor is returned too
    ("return torch.softmax(m.norm(x), dim=1)", False),  # a broadcasting reader writes the whole tensor anyway
])
def test_the_rule_is_exact_in_float64(body, fires):
    """The rewritten graph equals the original (and eager) in float64, where it fires; it fires only where a plain
    reduction reads the norm's output through pointwise ops."""
    norm = nn.GroupNorm(3, 6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
        norm.bias.copy_(torch.randn(6))
    scope: dict = {"torch": torch}
    exec(f"def fn(m, x):\n    {body}\n", scope)

    def forward(m, x):
        m.norm = norm
        return scope["fn"](m, x)

    prove(forward, torch.randn(2, 6, 5, 4) * 3 + 1, rule=RULE, fires=fires)


def test_a_norm_without_weight_and_bias_is_left_alone(tmp_path):
    """A norm without weight and bias keeps its norm kernel (the rule takes the affine form only)."""
    _, graph, _ = _plans(tmp_path, """
    y = self.conv(x)
    return torch.nn.functional.group_norm(y, 2).sum(dim=1)
    """)
    assert not any(n.op == "stack.default" for n in graph.nodes)
