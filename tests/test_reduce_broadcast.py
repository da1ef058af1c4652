"""Reduce-then-broadcast kernels: a plain reduction whose row value is read back by every element of its row
(RMSNorm `x / sqrt(mean(x**2) + eps)`, L1/L2 norms, a max-abs scaling) is one kernel: the row's value, then the
consumer for each element, the elements kept in registers between the two passes where they fit. Their CUDA runs
in the CPU emulation of CUDA against the plan interpreter, which is checked against eager."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated, emulated_run
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

import kernelfuse.plan.schedule as schedule
from kernelfuse.codegen import generate

CASES = {
    # name: (forward body, input shape, strategy line, cached between the passes)
    "rms_strided": ("return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5)", (2, 8, 4, 8),
                    "strided, 1 thread(s) per row", True),
    "rms_strided_uncached": ("return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5)",
                             (2, 80, 2, 4), "strided, 1 thread(s) per row", False),
    "l1_warp": ("return x / torch.mean(torch.abs(x), dim=1, keepdim=True)", (16, 300),
                "inner, 32 thread(s) per row", True),
    "l2_block_uncached": ("return x / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True))", (4, 9000),
                          "inner, 256 thread(s) per row", False),
    "maxabs_scaled": ("return torch.tanh(x / torch.amax(torch.abs(x), dim=1, keepdim=True) * self.w)", (16, 100),
                      "inner, 8 thread(s) per row", True),
}
INIT = "def __init__(self):\n    super().__init__()\n    self.w = nn.Parameter(torch.rand(100) + 0.5)\n\n"


@pytest.fixture(autouse=True)
def _small_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedule, "MAPPED_MIN_ROWS", 1)  # small emulated shapes; the threshold has its own test


@pytest.mark.parametrize("name", sorted(CASES))
def test_reduce_then_broadcast_is_one_kernel(name: str, tmp_path) -> None:
    expr, shape, strategy, cached = CASES[name]
    body = (INIT if "self.w" in expr else "") + f"def forward(self, x):\n    {expr}"
    problem, _, plans = pipeline(write_problem(tmp_path, name, body, f"[torch.randn{shape}]"))
    plan = plans[-1]
    (step,) = plan.generated
    assert step.mapped is not None and not plan.unfused, plan.summary()
    cuda = generate(plan).cuda
    assert strategy in cuda, cuda[-3000:]
    assert ("float cache[PER];" in cuda) == cached
    assert "const float m_in0 = raw;" in cuda  # the source is not read again as the consumer's operand
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-5)
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step, seed=2)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_few_long_rows_stay_two_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under MAPPED_MIN_ROWS rows the reduction is split across blocks (kernelfuse.codegen.split): no broadcast."""
    monkeypatch.setattr(schedule, "MAPPED_MIN_ROWS", 1024)
    body = "def forward(self, x):\n    return x / torch.mean(torch.abs(x), dim=1, keepdim=True)"
    problem, _, plans = pipeline(write_problem(tmp_path, "few", body, "[torch.randn(4, 5000)]"))
    plan = plans[-1]
    assert len(plan.generated) == 2 and all(g.mapped is None for g in plan.generated), plan.summary()
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("row", [schedule.MAPPED_MAX_ROW, schedule.MAPPED_MAX_ROW + 4])
def test_rows_longer_than_the_chip_holds_stay_two_kernels(row: int, tmp_path) -> None:
    """One kernel only where the row stays on chip: registers, or the most blocks the code generator shares a row
    (a longer row would be read twice by the one kernel, slower than two kernels)."""
    from kernelfuse.codegen.onchip import ONCHIP_MAX_ROW

    assert schedule.MAPPED_MAX_ROW == ONCHIP_MAX_ROW
    body = "def forward(self, x):\n    return x / torch.sum(torch.abs(x), dim=1, keepdim=True)"
    _, _, plans = pipeline(write_problem(tmp_path, "long", body, f"[torch.randn(2, {row})]"))
    mapped = [g for g in plans[-1].generated if g.mapped is not None]
    assert bool(mapped) == (row <= schedule.MAPPED_MAX_ROW), plans[-1].summary()


NOT_BROADCAST = {  # forward body, input shape
    # the row value has another reader: it is stored, and the division is a kernel of its own
    "another_reader": ("    m = torch.mean(torch.abs(x), dim=1, keepdim=True)\n    return x / m, m", (16, 100)),
    # mean(x, 1, keepdim) viewed as (64, 8, 1) is no longer each element's own row value: fusing it would divide
    # by another row's mean (the kernel hands an element its row's value; 560 off in the emulation)
    "reshaped": ("    v = torch.mean(x, dim=1, keepdim=True).view(64, 8, 1)\n    return x / v", (64, 8, 8)),
}


@pytest.mark.parametrize("name", sorted(NOT_BROADCAST))
def test_row_value_that_is_not_each_elements_own_is_not_broadcast(name: str, tmp_path) -> None:
    body, shape = NOT_BROADCAST[name]
    problem, _, plans = pipeline(write_problem(tmp_path, name, f"def forward(self, x):\n{body}",
                                               f"[torch.randn{shape}]"))
    plan = plans[-1]
    assert all(g.mapped is None for g in plan.generated), plan.summary()
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-5)
