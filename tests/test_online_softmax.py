"""Softmax, log_softmax and logsumexp row kernels find a row's max and sum of exp(x - max) in one pass (online:
a larger max rescales the sum). Their generated CUDA, run in the CPU emulation of CUDA, against eager on rows with
-inf (some, all), +inf, NaN and large offsets, in each row strategy (a thread, a warp or a block per row)."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import call, emulated
from optimizer_helpers import pipeline, write_problem

from kernelfuse.codegen import generate
from kernelfuse.codegen.iteration import tensor_args

BODY = """
def forward(self, x):
    return {expr}
"""
CASES = {
    # name: (expression, input shape, the strategy line's start)
    "softmax_block": ("torch.softmax(x, -1)", (8, 3000), "// strategy: inner, 256 thread(s) per row"),
    "log_softmax_warp": ("torch.log_softmax(x, 1)", (8, 100), "// strategy: inner, 32 thread(s) per row"),
    "logsumexp_warp": ("torch.logsumexp(x, 1)", (8, 100), "// strategy: inner, 32 thread(s) per row"),
    "logsumexp_block": ("torch.logsumexp(x, 1)", (8, 3000), "// strategy: inner, 256 thread(s) per row"),
    "softmax_strided": ("torch.softmax(x, 1)", (2, 40, 4), "// strategy: strided, 1 thread(s) per row"),
}


def _special_rows(shape: tuple[int, ...]) -> torch.Tensor:
    """Random values, then one special pattern per row along dim 1: all -inf, some -inf, one +inf, one NaN,
    a large offset, a max at the row's end (the sum rescaled late), and two ordinary rows."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 4.0
    rows = x.movedim(1, -1).reshape(-1, shape[1])  # a view: writes land in x
    n = shape[1]
    rows[0].fill_(float("-inf"))
    rows[1, : n // 2] = float("-inf")
    rows[2, n // 3] = float("inf")
    rows[3, n // 2] = float("nan")
    rows[4] += 1e4
    rows[5, -1] = 60.0
    return x


@pytest.mark.parametrize("name", sorted(CASES))
def test_online_row_kernel_matches_eager_on_special_values(name: str, tmp_path) -> None:
    expr, shape, strategy = CASES[name]
    problem, _, plans = pipeline(write_problem(tmp_path, name, BODY.format(expr=expr), f"[torch.randn{shape}]"))
    plan = plans[-1]
    (step,) = plan.generated
    assert strategy in generate(plan).cuda, generate(plan).cuda[:2000]
    assert "kf_row_reduce_online<TPR>(m, s)" in generate(plan).cuda  # one pass for the max and the sum
    x = _special_rows(shape)
    assert [n for n, _ in tensor_args(step)] == ["src"]
    out = torch.full(step.out_meta.shape, float("nan"))
    call(emulated(plan, tmp_path), step, [x.contiguous(), out])
    with torch.no_grad():
        expected = problem.make_model()(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5, equal_nan=True)
