"""dropout_as_on_cuda: training-mode dropout captured as ATen's CPU decomposition becomes the native_dropout call
eager makes on CUDA; on the CPU both draw the same mask under one seed, so the rewritten graph equals eager."""

from __future__ import annotations

import pytest
import torch
from optimizer_helpers import pipeline, write_problem
from rewrite_helpers import run_graph
from torch import nn

from kernelfuse.capture import capture_module
from kernelfuse.plan import interpret
from kernelfuse.rewrite import apply_rules


class Drop(nn.Module):
    def __init__(self, p: float, also_mask: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.drop = nn.Dropout(p)
        self.also_mask = also_mask

    def forward(self, x):
        if self.also_mask:  # the decomposition by hand, its mask also returned: not dropout's pattern
            mask = torch.empty_like(x).bernoulli_(0.75).div_(0.75)
            return x * mask, mask
        return torch.softmax(self.drop(self.lin(x)), dim=1)


@pytest.mark.parametrize("p", [0.2, 0.5, 0.7])
def test_dropout_becomes_native_dropout_with_eager_mask(p):
    model = Drop(p)
    x = torch.randn(64, 8)
    graph = capture_module(model, [x])
    ops = [n.op for n in graph.nodes]
    assert "bernoulli_.float" in ops  # what a CPU capture records
    result = apply_rules(graph)
    assert "dropout_as_on_cuda" in result.rules_fired
    ops = [n.op for n in result.graph.nodes]
    assert "native_dropout.default" in ops and not {"bernoulli_.float", "div_.Scalar", "empty_like.default"} & set(ops)
    with torch.no_grad():
        for seed in (0, 1):
            torch.manual_seed(seed)
            expected = model(x)
            torch.manual_seed(seed)
            (got,) = run_graph(result.graph, model, [x])
            assert torch.equal(got, expected)  # the same mask, the same scale: bit for bit


def test_eval_mode_and_other_masks_are_left_alone():
    model = Drop(0.2).eval()
    assert "dropout_as_on_cuda" not in apply_rules(capture_module(model, [torch.randn(4, 8)])).rules_fired
    hand = Drop(0.2, also_mask=True)
    assert "dropout_as_on_cuda" not in apply_rules(capture_module(hand, [torch.randn(4, 8)])).rules_fired


def test_plan_runs_native_dropout_then_the_softmax_kernel(tmp_path):
    path = write_problem(tmp_path, "drop", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 32)
            self.drop = nn.Dropout(0.3)

        def forward(self, x):
            return torch.softmax(self.drop(self.lin(x)), dim=1)
    """, "[torch.randn(8, 16)]")
    problem, _, (plan,) = pipeline(path)
    assert [s.node.op for s in plan.unfused if s.node.op.startswith("native_dropout")] == ["native_dropout.default"]
    assert [g.chain(plan.graph) for g in plan.generated] == ["_softmax"]
    model = problem.make_model()
    state = dict(model.named_parameters())
    x = problem.make_inputs(0)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model(*x)
        torch.manual_seed(7)
        (got,) = interpret(plan, state, x)
    assert torch.equal(got, expected)  # the same seed, the same mask: exact


def test_two_dropouts_keep_two_masks():
    class Two(nn.Module):
        def forward(self, x):
            return nn.functional.dropout(x, 0.25) + nn.functional.dropout(x, 0.25)

    x = torch.randn(32, 16)
    result = apply_rules(capture_module(Two(), [x]))
    assert sum(n.op == "native_dropout.default" for n in result.graph.nodes) == 2
    torch.manual_seed(3)
    expected = Two()(x)
    torch.manual_seed(3)
    (got,) = run_graph(result.graph, Two(), [x])
    assert torch.equal(got, expected)
