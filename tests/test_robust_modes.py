"""Train/eval semantics: the fused forward serves only the mode it was captured in; the other runs the original ops.

The emitted guard `_fallback_reason` is exec'd from the emitted file and run on stand-ins that look like CUDA
tensors (no GPU needed): it must refuse the fused path in the other mode, saying so. The plan interpreter must equal
the model in the mode it was captured in, eval included (BatchNorm running statistics, Dropout the identity).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_helpers import pipeline

from kernelfuse.capture import capture_module
from kernelfuse.cpucheck import compare
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import interpret, plan_variants
from kernelfuse.rewrite import rewrite

FIXTURE = Path(__file__).parent / "fixtures" / "problems" / "tiny_bn_dropout.py"


class AsCuda:
    """A tensor or module seen as if it lived on a CUDA device; everything else is the real object's."""

    is_cuda = True

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def parameters(self):
        return [AsCuda(p) for p in self._inner.parameters()]


@pytest.fixture(scope="module")
def emitted():
    """(problem, plan, namespace of the exec'd emitted file)."""
    problem, graph, plans = pipeline(FIXTURE)
    plan = plans[0]
    text = emit_file(problem, plan, "test")
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)  # noqa: S102 - our generated file
    return problem, plan, text, ns


def test_capture_records_training_mode_through_rewrite_and_plan(emitted):
    problem, plan, text, _ = emitted
    assert plan.graph.training is True  # the problem's model as constructed: training mode
    assert "CAPTURED_TRAINING = True" in text
    model = problem.make_model().eval()
    graph = rewrite(capture_module(model, [torch.rand(8, 16)]))
    assert graph.training is False
    assert all(p.graph.training is False for p in plan_variants(graph))


def test_guard_refuses_the_other_mode(emitted):
    problem, plan, _, ns = emitted
    guard = ns["_fallback_reason"]
    model = ns["ModelNew"](*problem.init_inputs())
    x = AsCuda(torch.rand(8, 16))
    with torch.no_grad():
        assert guard(AsCuda(model), (x,)) is None
        model.eval()
        assert guard(AsCuda(model), (x,))[0] == "mode"
        model.train()
        model.drop.eval()  # one submodule in the other mode is enough to change the result
        assert guard(AsCuda(model), (x,))[0] == "mode"


def test_emitted_model_in_eval_mode_equals_original_in_eval_mode(emitted):
    problem, plan, _, ns = emitted
    real_guard = ns["_fallback_reason"]
    ns["_fallback_reason"] = lambda module, inputs: real_guard(AsCuda(module), tuple(AsCuda(t) for t in inputs))

    def fused_path_taken():
        raise AssertionError("fused path taken")

    ns["_extension"] = fused_path_taken
    torch.manual_seed(42)
    ours = ns["ModelNew"](*problem.init_inputs())
    reference = problem.make_model()
    x = torch.rand(8, 16)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="fused path taken"):
            ours(x)  # training mode: the guard lets the captured (fused) path run
        ours.eval()
        reference.eval()
        torch.testing.assert_close(ours(x), reference(x), atol=0, rtol=0)


def test_interpreter_equals_model_in_eval_mode():
    problem, _, _ = pipeline(FIXTURE)
    model = problem.make_model()
    with torch.no_grad():  # give BatchNorm running statistics that differ from a batch's
        for _ in range(3):
            model(torch.rand(8, 16) * 3)
    model.eval()
    x = torch.rand(8, 16)
    graph = rewrite(capture_module(model, [x]))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for plan in plan_variants(graph):
        with torch.no_grad():
            check = compare(plan.variant, model(x), interpret(plan, state, [x]), [x])
        assert check.ok, check.note
