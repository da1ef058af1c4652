"""torch.compile(model, backend="kernelfuse"): the name resolves through the installed entry point, the compiled
model computes what eager does, and on a GPU the backend returns fused kernels for a graph it can fuse."""

from __future__ import annotations

import warnings

import pytest
import torch

from kernelfuse.dynamo import kernelfuse_backend


class LinearReLU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2.0


def test_backend_name_resolves_to_kernelfuse():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("kernelfuse") is kernelfuse_backend


def test_compiled_model_matches_eager_on_the_cpu_and_says_why_it_did_not_fuse():
    torch.manual_seed(0)
    model, x = LinearReLU(), torch.randn(4, 16)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = torch.compile(model, backend="kernelfuse")(x)
    assert torch.equal(out, model(x))
    assert any("not on a CUDA device" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.gpu
def test_backend_returns_fused_kernels_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = LinearReLU().cuda()
    x = torch.randn(64, 16, device="cuda")
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        compiled = kernelfuse_backend(gm, [x])
        assert compiled != gm.forward and hasattr(compiled, "inner"), "the backend kept the captured graph"
        torch.testing.assert_close(compiled(x), gm(x), atol=1e-4, rtol=1e-4)
        torch._dynamo.reset()
        # the backend itself (the name needs the installed entry point: test_backend_name_resolves_to_kernelfuse)
        torch.testing.assert_close(torch.compile(model, backend=kernelfuse_backend)(x), model(x), atol=1e-4,
                                   rtol=1e-4)


def test_a_lazy_graph_module_is_captured_with_its_real_parameters():
    """Dynamo hands over lazy graph modules, called through a (*args, **kwargs) stub until their first call: the
    capture binds the real parameters, the names the fused forward is written with."""
    from kernelfuse.capture import capture_module

    seen = []

    def backend(gm, example_inputs):
        seen.append(capture_module(gm, list(example_inputs)).call_spec)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(LinearReLU(), backend=backend)(torch.randn(4, 16))
    (call,) = seen
    assert call.plain and [p.name for p in call.params][-1] == "L_x_"


@pytest.fixture
def ambient_autocast():
    """CUDA autocast switched on as `torch.autocast("cuda")` would (which turns itself off without a GPU)."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")

    def switch(to: torch.dtype) -> None:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", to)

    yield switch
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)


def test_inside_bf16_autocast_the_backend_fuses_under_the_bf16_policy(ambient_autocast, monkeypatch):
    import kernelfuse.dynamo as dynamo

    asked = []
    monkeypatch.setattr(dynamo, "optimize", lambda gm, inputs, precision: asked.append(precision) or gm)
    gm = torch.fx.symbolic_trace(LinearReLU())
    kernelfuse_backend(gm, [torch.randn(4, 16)])
    ambient_autocast(torch.bfloat16)
    kernelfuse_backend(gm, [torch.randn(4, 16)])
    kernelfuse_backend(gm, [torch.randn(4, 16)], {"precision": "bf16"})
    assert asked == ["strict", "bf16", "bf16"]
    # fp16 autocast has no policy; strict asked for inside bf16 autocast contradicts it: the graph as captured
    with pytest.warns(UserWarning, match="precision 'strict' was asked for inside CUDA autocast"):
        assert kernelfuse_backend(gm, [torch.randn(4, 16)], {"precision": "strict"}) == gm.forward
    ambient_autocast(torch.float16)
    with pytest.warns(UserWarning, match="autocast to torch.float16 has no kernelfuse policy"):
        assert kernelfuse_backend(gm, [torch.randn(4, 16)]) == gm.forward
    assert len(asked) == 3


@pytest.mark.gpu
def test_backend_inside_bf16_autocast_returns_kernels_with_autocast_numerics():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = LinearReLU().cuda()
    x = torch.randn(64, 16, device="cuda")
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        expected = model(x)
        got = torch.compile(model, backend=kernelfuse_backend)(x)
    # the kernels served the call (the graph as captured would also give autocast's numbers): no fallback warning.
    # Its output is bf16 as autocast's is: it was refused as a mismatch when the plan widened it to float32
    assert not [str(w.message) for w in seen if str(w.message).startswith("kernelfuse")]
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
