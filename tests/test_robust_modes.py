"""Train/eval semantics: the fused forward serves only the mode it was captured in; the other runs the original ops.

The emitted guard `_fallback_reason` is exec'd from the emitted file and run on stand-ins that look like CUDA
tensors (no GPU needed): it must refuse the fused path in the other mode, saying so. The plan interpreter must equal
the model in the mode it was captured in, eval included (BatchNorm running statistics, Dropout the identity).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_helpers import AsCuda, pipeline

from kernelfuse.capture import capture_module
from kernelfuse.cpucheck import compare
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import interpret, plan_variants
from kernelfuse.rewrite import rewrite

FIXTURE = Path(__file__).parent / "fixtures" / "problems" / "tiny_bn_dropout.py"


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
    _assert_every_plan_interprets_like(model)


def _assert_every_plan_interprets_like(model: torch.nn.Module) -> None:
    """Captured in the model's current modes, every plan variant interpreted equals the model."""
    x = torch.rand(8, 16)
    graph = rewrite(capture_module(model, [x]))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for plan in plan_variants(graph):
        with torch.no_grad():
            check = compare(plan.variant, model(x), interpret(plan, state, [x]), [x])
        assert check.ok, check.note


MIXED = Path(__file__).parent / "fixtures" / "problems" / "tiny_mixed_modes.py"


def test_mixed_modes_are_recorded_per_module_and_guarded_per_module():
    """A training-mode model holding an eval-mode body (a wrapper around a library model built with .eval()):
    the fused path serves the modes as constructed, and model.train() (which flips the body to training mode:
    batch statistics, dropout) or model.eval() runs the original ops instead of kernels planned for other modes."""
    problem, graph, plans = pipeline(MIXED)
    assert graph.mixed_modes and graph.modes == "100001"  # Model, body, Linear, BatchNorm1d, Dropout, head
    text = emit_file(problem, plans[0], "test")
    assert 'CAPTURED_MODES = "1" + "0" * 4 + "1"' in text
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)  # noqa: S102 - our generated file
    guard, model, x = ns["_fallback_reason"], ns["ModelNew"](*problem.init_inputs()), AsCuda(torch.rand(8, 16))
    with torch.no_grad():
        assert guard(AsCuda(model), (x,)) is None  # as constructed
        model.train()
        assert guard(AsCuda(model), (x,))[0] == "mode"
        model.eval()
        assert guard(AsCuda(model), (x,))[0] == "mode"


def test_mixed_modes_plan_equals_the_model_as_constructed():
    problem, _, _ = pipeline(MIXED)
    model = problem.make_model()
    with torch.no_grad():  # running statistics that differ from a batch's: a training-mode BatchNorm would differ
        model.body[1].running_mean.fill_(0.5)
        model.body[1].running_var.fill_(3.0)
    _assert_every_plan_interprets_like(model)


def test_in_process_wrapper_guards_the_wrapped_models_modes():
    from kernelfuse.emit.module import build_module

    problem, _, plans = pipeline(MIXED)
    model = problem.make_model()
    wrapped = build_module(model, plans[0], None)
    guard = type(wrapped).forward.__globals__["_fallback_reason"]
    x = AsCuda(torch.rand(8, 16))
    with torch.no_grad():
        assert guard(AsCuda(wrapped), (x,)) is None
        wrapped.train()
        assert guard(AsCuda(wrapped), (x,))[0] == "mode"
