"""Shapes that vary (kernelfuse.shapes): one fused module per input shape up to a limit, a visible fallback past it,
through `kernelfuse.optimize(..., max_shapes=N)` and through the Dynamo backend's graphs with symbolic sizes."""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelfuse
import kernelfuse.shapes as shapes
from kernelfuse.dynamo import kernelfuse_backend
from kernelfuse.shapes import ShapeFallbackWarning, ShapeSpecialised, shape_key


class LinearGelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x)) * 2.0


class Counted:
    """A stand-in for a fused module: doubles its input and counts its calls like one."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2

    def kernelfuse_stats(self) -> dict[str, object]:
        return {"fused_calls": self.calls, "fallback_calls": 0, "fallback_reasons": {}}


def test_each_new_shape_is_built_once_and_past_the_limit_runs_the_original_ops_visibly(monkeypatch):
    monkeypatch.setattr(shapes, "_not_served", lambda *a: None)  # as if on CUDA, without a GPU
    built: list[tuple[int, ...]] = []

    def build(args: tuple, kwargs: dict) -> Counted:
        built.append(tuple(args[0].shape))
        return Counted()

    original = []
    first = torch.ones(2, 3)
    wrapper = ShapeSpecialised(lambda x: original.append(x.shape) or x * 2, build, 3, (shape_key([first]), Counted()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (2, 4, 2, 8, 4, 16, 32, 16):
            assert torch.equal(wrapper(torch.ones(n, 3)), torch.full((n, 3), 2.0))
    assert built == [(4, 3), (8, 3)]  # the first came built; 16 and 32 are past the limit of 3
    assert [list(s) for s in original] == [[16, 3], [32, 3], [16, 3]]
    fallbacks = [w for w in caught if issubclass(w.category, ShapeFallbackWarning)]
    assert len(fallbacks) == 1 and "[16, 3] float32" in str(fallbacks[0].message), [str(w.message) for w in caught]
    stats = wrapper.kernelfuse_stats()
    assert (stats["fused_calls"], stats["fallback_calls"], stats["fallback_reasons"]) == (5, 3, {"shape": 3})
    assert [s["inputs"] for s in stats["specialisations"]] == ["([2, 3] float32 cpu)", "([4, 3] float32 cpu)",
                                                                "([8, 3] float32 cpu)"]
    assert "[16, 3]" in stats["beyond_limit"]


def test_a_call_no_kernel_would_serve_builds_nothing():
    built = []
    wrapper = ShapeSpecialised(torch.nn.Identity(), lambda a, k: built.append(a) or Counted(), 4)
    assert torch.equal(wrapper(torch.ones(3)), torch.ones(3))  # CPU tensors: the original ops, counted
    assert built == [] and wrapper.kernelfuse_stats()["fallback_reasons"] == {"device": 1}


def test_the_key_tells_shapes_dtypes_and_other_arguments_apart():
    x = torch.ones(2, 3)
    assert shape_key([x, 1]) == shape_key((torch.zeros(2, 3), 1))
    assert len({shape_key([x, 1]), shape_key([x, 2]), shape_key([x.double(), 1]), shape_key([x.t(), 1])}) == 4


def test_max_shapes_below_one_is_refused():
    with pytest.raises(ValueError, match="max_shapes"):
        kernelfuse.optimize(LinearGelu(), [torch.randn(4, 32)], max_shapes=0)


def test_a_graph_with_symbolic_sizes_is_specialised_per_shape_and_matches_on_the_cpu():
    from kernelfuse import dynamo

    torch._dynamo.reset()
    model = LinearGelu().eval()
    compiled = torch.compile(model, backend=kernelfuse_backend, dynamic=True)
    before = len(dynamo.stats())
    with torch.no_grad():
        for n in (4, 6, 9):
            x = torch.randn(n, 32)
            torch.testing.assert_close(compiled(x), model(x))
    served = dynamo.stats()[before:]
    assert len(served) == 1 and served[0]["fallback_reasons"] == {"device": 3}, served  # CPU: nothing built


@pytest.mark.gpu
def test_a_model_at_three_batch_sizes_runs_kernels_at_each_or_says_it_fell_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = LinearGelu().cuda().eval()
    fast = kernelfuse.optimize(model, [torch.randn(8, 32, device="cuda")], max_shapes=2)
    assert isinstance(fast, ShapeSpecialised)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (8, 16, 32, 16):
            x = torch.randn(n, 32, device="cuda")
            torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=1e-4)
    assert sum(issubclass(w.category, ShapeFallbackWarning) for w in caught) == 1
    stats = fast.kernelfuse_stats()
    assert [s["fused"] for s in stats["specialisations"]] == [True, True]
    assert (stats["fused_calls"], stats["fallback_reasons"]) == (5, {"shape": 1})  # 3 calls + 2 builds' checks

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=kernelfuse_backend, dynamic=True)  # (the name: an installed package)
    from kernelfuse import dynamo

    before = len(dynamo.stats())
    with torch.no_grad():
        for n in (8, 16, 32):
            x = torch.randn(n, 32, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    served = [s for s in dynamo.stats()[before:] if "specialisations" in s]
    assert served and [s["fused"] for s in served[-1]["specialisations"]] == [True, True, True], dynamo.stats()
