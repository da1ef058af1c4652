"""Python API `kernelfuse.optimize(model, example_inputs)`: fused module on a GPU, the original model otherwise."""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelfuse
from kernelfuse.capture import capture_module
from kernelfuse.emit.calltext import call_text


class LinearGeluScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 128)
        self.scale = torch.nn.Parameter(torch.randn(128))

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)) * self.scale


def test_capture_module_uses_fake_tensors_only() -> None:
    model = LinearGeluScale()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    graph = capture_module(model, [torch.randn(8, 64)])
    assert [n.op for n in graph.nodes if n.op not in ("param", "buffer", "input")] == [
        "t.default", "addmm.default", "gelu.default", "mul.Tensor"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_sequential_state_paths_are_valid_python() -> None:
    from kernelfuse.emit.forward import forward_source
    from kernelfuse.plan import plan_variants
    from kernelfuse.rewrite import rewrite

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    plan = plan_variants(rewrite(capture_module(model, [torch.randn(4, 16)])))[0]
    text = forward_source(plan, call_text(plan.graph.call_spec, "input"), True, True, state="self.inner")
    compile(text, "<forward>", "exec")
    assert "get_parameter('0.bias')" in text


def test_cpu_inputs_return_the_model_with_a_warning() -> None:
    model = LinearGeluScale()
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        assert kernelfuse.optimize(model, [torch.randn(8, 64)]) is model


def test_nothing_to_fuse_returns_the_model() -> None:
    model = torch.nn.Flatten()  # a view: no kernel to generate
    with pytest.warns(UserWarning, match="nothing to fuse"):
        assert kernelfuse.optimize(model, [torch.randn(8, 64)]) is model


@pytest.mark.gpu
def test_gpu_module_is_fused_and_matches() -> None:
    torch.manual_seed(0)
    model = LinearGeluScale().cuda()
    x = torch.randn(32, 64, device="cuda")
    fused = kernelfuse.optimize(model, [x])
    assert fused is not model and type(fused).__name__ == "FusedModule"
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(32, 64, device="cuda")
            torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    # optimize's own check, then the three calls: all served by the kernels
    assert fused.kernelfuse_stats() == {"fused_calls": 4, "fallback_calls": 0, "fallback_reasons": {},
                                        "first_fallback": None, "last_fallback": None}
    # an eval-mode model: the wrapper takes its mode, so the guard lets the kernels run
    evaluated = kernelfuse.optimize(model.eval(), [x])
    assert not evaluated.training

    def never(*args: object) -> None:
        raise AssertionError("the fused module fell back to the original ops")

    evaluated._reference_forward = never
    with torch.no_grad():
        torch.testing.assert_close(evaluated(x), model(x), atol=1e-4, rtol=1e-4)
    model.train()
    # grad mode with trainable parameters: the original ops run, so gradients are right (counted, not warned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused(x)
    out.sum().backward()
    assert model.fc.weight.grad is not None
    assert [w for w in caught if w.category.__name__ == "KernelfuseFallbackWarning"] == []
    assert fused.kernelfuse_stats()["fallback_reasons"] == {"autograd": 1}
    with pytest.warns(UserWarning, match="input x has shape \\[16, 64\\], the kernels were built for \\[32, 64\\]"):
        with torch.no_grad():
            torch.testing.assert_close(fused(x[:16]), model(x[:16]), atol=1e-4, rtol=1e-4)


def test_in_process_module_without_kernels_guards_and_falls_back_on_cpu() -> None:
    """conv -> relu (NCHW) fuses into cuDNN's conv+relu with no custom kernel: the guard must still be there."""
    from kernelfuse.emit.module import build_module
    from kernelfuse.plan import PlanOptions, make_plan
    from kernelfuse.rewrite import rewrite

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    plan = make_plan(rewrite(capture_module(model, [x])), PlanOptions(conv_layout="nchw"))
    assert plan.fused and not plan.fused[0].needs_kernel
    fused = build_module(model, plan, None)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=0, rtol=0)


def test_bf16_captures_under_autocast_before_it_needs_a_gpu(monkeypatch) -> None:
    # the plan's graph is autocast's (its casts part of it): seen through the plans the API builds on the CPU
    import kernelfuse.api as api

    graphs = []
    real = api.plan_variants
    monkeypatch.setattr(api, "plan_variants", lambda graph, *a, **k: graphs.append(graph) or real(graph, *a, **k))
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        kernelfuse.optimize(LinearGeluScale(), [torch.randn(8, 64)], precision="bf16")
    assert graphs and graphs[0].autocast == torch.bfloat16
    assert any(n.op == "_to_copy.default" for n in graphs[0].nodes)


@pytest.mark.gpu
def test_gpu_module_under_bf16_runs_autocasts_numerics_and_falls_back_under_autocast() -> None:
    model, fused, x, expected, got = _bf16_module_and_call(LinearGeluScale())  # no autocast needed: the plan
    with torch.no_grad():  # carries its casts
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
        assert fused.kernelfuse_stats()["fused_calls"] >= 2
        with pytest.warns(UserWarning, match="the kernels were built for"):  # another batch: the original ops,
            other = fused(x[:16])  # run under the autocast the plan was captured under
        assert other.dtype == expected.dtype
        torch.testing.assert_close(other, expected[:16], atol=1e-2, rtol=1e-2)


class LinearOut(torch.nn.Module):
    """Ends in a Linear: under autocast its output is bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.fc(torch.relu(x) * 2.0)


@pytest.mark.gpu
def test_gpu_bf16_module_whose_autocast_output_is_bf16_returns_float32_through_the_kernels() -> None:
    # called without autocast, the fused module returns float32 as the model does; the check compares it with
    # autocast's bf16 result (it was refused for the dtype alone, and the model came back unchanged)
    _, fused, _, expected, got = _bf16_module_and_call(LinearOut())
    assert (got.dtype, expected.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(got, expected.float(), atol=1e-2, rtol=1e-2)
    assert fused.kernelfuse_stats()["fused_calls"] == 2  # optimize's own check, then this call


def _bf16_module_and_call(model: torch.nn.Module) -> tuple:
    """(model, its bf16 module, x, the model's output under autocast, the module's without it) on the GPU."""
    torch.manual_seed(0)
    model = model.cuda()
    x = torch.randn(32, 64, device="cuda")
    fused = kernelfuse.optimize(model, [x], precision="bf16")
    assert fused is not model
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = model(x)
        got = fused(x)
    return model, fused, x, expected, got
