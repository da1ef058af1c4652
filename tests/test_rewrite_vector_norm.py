"""The vector_norm_as_reduction rule: linalg_vector_norm of order 2, 1, +-inf becomes its reduction, equal to the
captured norm on random values with NaN and infinities; other orders and a dtype argument keep the norm."""

from __future__ import annotations

import pytest
import torch
from rewrite_helpers import prove, signed, specials


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.norm(x, p="fro"),                                  # all dims
    lambda m, x: x / torch.norm(x, p=2, dim=1, keepdim=True),             # a row's 2-norm, broadcast back
    lambda m, x: torch.linalg.vector_norm(x, ord=1, dim=-1),
    lambda m, x: torch.linalg.vector_norm(x, ord=float("inf"), dim=(0, 2)),
    lambda m, x: torch.linalg.vector_norm(x, ord=float("-inf"), dim=1, keepdim=True),
])
def test_vector_norm_as_reduction(fn):
    prove(fn, signed(4, 6, 5), rule="vector_norm_as_reduction", rtol=1e-12)


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.linalg.vector_norm(x, dim=2),
    lambda m, x: torch.linalg.vector_norm(x, ord=float("inf")),
    lambda m, x: torch.linalg.vector_norm(x, ord=1, dim=(1, 2), keepdim=True),
])
def test_vector_norm_as_reduction_exact_with_nan_inf(fn):
    prove(fn, specials(4, 6, 5), rule="vector_norm_as_reduction", rtol=1e-12)


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.linalg.vector_norm(x, ord=3, dim=1),               # another order
    lambda m, x: torch.linalg.vector_norm(x, ord=0, dim=1),               # a count of nonzeros
    lambda m, x: torch.linalg.vector_norm(x, dim=1, dtype=torch.float64),  # a dtype argument
])
def test_vector_norm_as_reduction_negative(fn):
    prove(fn, signed(4, 6, 5), rule="vector_norm_as_reduction", fires=False)
