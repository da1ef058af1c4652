"""The comparison rules on CPU tensors: structure, shape, dtype, NaN/Inf positions, tolerance."""

from __future__ import annotations

import math

import torch

from kernelfuse.verify import compare_outputs, describe, flatten_outputs, get_policy

STRICT = get_policy("strict")


def cmp(ref, out, policy=STRICT):
    return compare_outputs(ref, out, policy.atol, policy.rtol)


def test_identical_and_within_tolerance():
    ref = torch.randn(64, 32)
    assert cmp(ref, ref.clone()).ok
    near = ref + 5e-5
    result = cmp(ref, near)
    assert result.ok and math.isclose(result.max_abs, 5e-5, rel_tol=0.05)


def test_outside_tolerance_is_counted():
    ref = torch.zeros(10)
    out = ref.clone()
    out[3] = 1e-3
    result = cmp(ref, out)
    assert not result.ok and result.n_bad == 1 and "1 of 10 elements outside atol=0.0001" in result.reason
    assert cmp(ref, out, get_policy("tf32")).ok


def test_relative_tolerance_scales_with_the_reference():
    ref = torch.full((4,), 1000.0)
    assert cmp(ref, ref + 0.05).ok
    assert not cmp(ref, ref + 0.2).ok


def test_shape_dtype_and_structure():
    ref = torch.zeros(2, 3)
    assert "shape [3, 2]" in cmp(ref, torch.zeros(3, 2)).reason
    assert "dtype torch.float64" in cmp(ref, torch.zeros(2, 3, dtype=torch.float64)).reason
    assert "structure differs" in cmp((ref, ref), ref).reason
    assert "expected a tensor" in cmp(ref, 3.0).reason


def test_nan_positions_must_match():
    ref = torch.tensor([1.0, float("nan"), 3.0])
    assert cmp(ref, ref.clone()).ok
    moved = torch.tensor([float("nan"), 2.0, 3.0])
    result = cmp(ref, moved)
    assert not result.ok and result.n_unwritten == 1 and "NaN positions differ" in result.reason


def test_unwritten_output_counts_nan_over_finite():
    ref = torch.ones(100)
    out = ref.clone()
    out[:40] = float("nan")
    result = cmp(ref, out)
    assert result.n_unwritten == 40 and "40 NaN where the reference is finite" in result.reason


def test_inf_positions_and_signs():
    ref = torch.tensor([float("inf"), 1.0])
    assert cmp(ref, ref.clone()).ok
    assert "Inf positions or signs" in cmp(ref, torch.tensor([float("-inf"), 1.0])).reason
    assert "Inf positions or signs" in cmp(ref, torch.tensor([1e30, 1.0])).reason


def test_integer_outputs_are_exact():
    ref = torch.arange(10)
    out = ref.clone()
    out[0] = 1
    assert not cmp(ref, out).ok and cmp(ref, ref.clone()).ok


def test_tuple_outputs_and_non_tensors():
    a, b = torch.randn(3), torch.randn(4)
    assert cmp((a, b, 7), (a.clone(), b.clone(), 7)).ok
    result = cmp((a, b), (a.clone(), b + 1))
    assert not result.ok and result.reason.startswith("output 1:")
    assert not cmp((a, 7), (a, 8)).ok
    assert len(flatten_outputs({"y": a, "x": (b, a)})) == 3
    assert describe((a, torch.zeros(2, 2, dtype=torch.int64))) == "(float32[3], int64[2, 2])"


def test_half_precision_outputs_are_compared_in_float32():
    ref = torch.randn(50).half()
    assert cmp(ref, ref.clone()).ok
    assert cmp(ref, ref.clone()).max_abs == 0.0


def test_large_outputs_are_reduced_in_chunks(monkeypatch):
    import kernelfuse.verify.compare as compare

    monkeypatch.setattr(compare, "CHUNK", 7)
    ref = torch.randn(100)
    out = ref.clone()
    out[97] += 1.0
    result = cmp(ref, out)
    assert result.n_bad == 1 and math.isclose(result.max_abs, 1.0, rel_tol=1e-5)
