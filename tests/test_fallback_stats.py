"""The visible fallback: an emitted file (and kernelfuse.optimize's module) counts the calls its fused path served
and those that ran the original ops, says why in `kernelfuse_stats()`, and warns once per module and kind of reason
(KernelfuseFallbackWarning), except where autograd needs the original ops (training: counted, not warned).

All on the CPU: a CPU tensor is itself a reason the kernels decline, and the guard `_fallback_reason` is plain
Python, run here on stand-ins that look like CUDA tensors where a case needs one.
"""

from __future__ import annotations

import runpy
import warnings
from pathlib import Path

import pytest
import torch
from optimizer_helpers import AsCuda

from kernelfuse.capture import capture, capture_module
from kernelfuse.emit.module import build_module
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import PlanOptions, make_plan, plan_variants
from kernelfuse.rewrite import rewrite

FIXTURES = Path(__file__).parent / "fixtures" / "problems"


def _emitted(name: str, tmp_path: Path) -> tuple[dict, str]:
    """The namespace of the fixture's emitted file (first plan), run from disk as a user would, and its text."""
    problem = load_problem(FIXTURES / f"{name}.py")
    text = emit_file(problem, plan_variants(rewrite(capture(problem)))[0], "test")
    path = tmp_path / f"{name}_new.py"
    path.write_text(text)
    return runpy.run_path(str(path)), text


def _model(ns: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return ns["ModelNew"](*ns["get_init_inputs"]())


def _fallback_warnings(caught: list[warnings.WarningMessage], ns: dict) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ns["KernelfuseFallbackWarning"])]


def test_cpu_calls_are_counted_and_warned_once(tmp_path: Path) -> None:
    ns, text = _emitted("tiny_gemm_add_relu", tmp_path)
    model = _model(ns)
    (x,) = ns["get_inputs"]()
    assert model.kernelfuse_stats() == {"fused_calls": 0, "fallback_calls": 0, "fallback_reasons": {},
                                        "first_fallback": None, "last_fallback": None}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")  # our own once-per-kind, not Python's once-per-location
        for _ in range(3):
            assert torch.equal(model(x), model._reference_forward(x))
    (message,) = _fallback_warnings(caught, ns)
    assert "input x is a CPU tensor, the kernels run on CUDA" in message and "ran the original ops" in message
    assert issubclass(ns["KernelfuseFallbackWarning"], UserWarning)
    stats = model.kernelfuse_stats()
    assert stats == {"fused_calls": 0, "fallback_calls": 3, "fallback_reasons": {"device": 3},
                     "first_fallback": "input x is a CPU tensor, the kernels run on CUDA",
                     "last_fallback": "input x is a CPU tensor, the kernels run on CUDA"}
    stats["fallback_reasons"]["device"] = 0  # a copy: the module's counts are not the caller's to change
    assert model.kernelfuse_stats()["fallback_reasons"] == {"device": 3}
    assert _model(ns).kernelfuse_stats()["fallback_calls"] == 0  # per module
    assert "_kernelfuse_calls" not in model.state_dict()
    # the file says which calls run the kernels, next to INPUT_SPECS
    notes = text[:text.index("\nINPUT_SPECS = ")]
    assert "#   - input x: shape [16, 64], torch.float32, contiguous, on a CUDA device" in notes
    assert "every submodule in training mode" in notes and "torch.no_grad()" in notes
    assert "INPUT_SPECS = [('x', (16, 64), torch.float32)]" in text


def test_grad_mode_with_trainable_parameters_is_counted_not_warned(tmp_path: Path) -> None:
    ns, _ = _emitted("tiny_gemm_add_relu", tmp_path)
    model = _model(ns)
    (x,) = ns["get_inputs"]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(x).sum().backward()  # training: the original ops, so autograd sees them
    assert _fallback_warnings(caught, ns) == []
    assert model.gemm.weight.grad is not None
    stats = model.kernelfuse_stats()
    assert stats["fallback_calls"] == 2 and stats["fallback_reasons"] == {"autograd": 2}
    assert "grad mode with trainable parameters" in stats["last_fallback"]
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(x)  # another kind of reason still warns
    assert len(_fallback_warnings(caught, ns)) == 1


def test_a_call_of_another_structure_is_counted_with_its_reason(tmp_path: Path) -> None:
    ns, _ = _emitted("sig_scalar_float", tmp_path)
    model = _model(ns)
    a, _ = ns["get_inputs"]()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for s in (4.0, 4.0, 3.5, 2.0):
            model(a, s)
    messages = _fallback_warnings(caught, ns)
    assert len(messages) == 2 and "the call's structure differs" in messages[0] and "CPU tensor" in messages[1]
    assert model.kernelfuse_stats()["fallback_reasons"] == {"call": 3, "device": 1}


def test_guard_says_why_it_declines(tmp_path: Path) -> None:
    ns, _ = _emitted("tiny_gemm_add_relu", tmp_path)
    why = ns["_fallback_reason"]
    model = _model(ns)
    x = torch.rand(16, 64)
    with torch.no_grad():
        assert why(AsCuda(model), (AsCuda(x),)) is None  # the traced call: the kernels serve it
        assert why(model, (x,)) == ("device", "input x is a CPU tensor, the kernels run on CUDA")
        assert why(model, (torch.rand(8, 64),)) == (  # shape before device: the reason a GPU user would get
            "shape", "input x has shape [8, 64], the kernels were built for [16, 64]")
        assert why(model, (x.double(),)) == ("dtype", "input x is torch.float64, the kernels were built for "
                                             "torch.float32")
        assert why(AsCuda(model), (AsCuda(torch.rand(64, 16).t()),)) == (
            "layout", "input x is not contiguous, the kernels were built for a contiguous one")
        assert why(model, (AsCuda(x),)) == ("device", "a parameter is not on a CUDA device, the kernels run on CUDA")
        model.eval()
        kind, words = why(AsCuda(model), (AsCuda(x),))
        assert kind == "mode" and words.startswith("training mode differs") and "in training mode" in words
        model.train()
    kind, words = why(AsCuda(model), (AsCuda(x),))  # grad mode, trainable parameters
    assert kind == "autograd" and words.startswith("grad mode with trainable parameters")
    model.requires_grad_(False)
    assert why(AsCuda(model), (AsCuda(x),)) is None  # grad mode, but nothing requires grad
    assert why(AsCuda(model), (AsCuda(x.requires_grad_()),))[0] == "autograd"


def test_in_process_module_counts_and_warns_the_same_way() -> None:
    """kernelfuse.optimize's module runs the same guard text: the same counts, method and warning."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    plan = make_plan(rewrite(capture_module(model, [x])), PlanOptions(conv_layout="nchw"))
    fused = build_module(model, plan, None)
    category = fused.forward.__func__.__globals__["KernelfuseFallbackWarning"]
    with pytest.warns(category, match="input input is a CPU tensor") as caught:
        with torch.no_grad():
            fused(x)
            fused(x)
        fused(x)  # grad mode: counted only
    assert len([w for w in caught if issubclass(w.category, category)]) == 1
    assert fused.kernelfuse_stats()["fallback_reasons"] == {"device": 2, "autograd": 1}
    assert "input input: shape [2, 3, 8, 8], torch.float32, contiguous, on a CUDA device" in type(fused).__doc__
