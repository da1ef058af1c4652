"""A pointwise kernel's output in eager's layout (kernelfuse.plan.ir.GenStep.permuted_out): an elementwise op on
permuted operands keeps their layout in eager, and later views and kernels were captured against it (level-3
Mamba2: a later kernel's stride check failed on a contiguous output). The wrapper allocates those strides and the
kernel iterates in their memory order; checked in the CPU emulation against the interpreter."""

from __future__ import annotations

from pathlib import Path

import torch
from emulation_helpers import emulated, emulated_run
from optimizer_helpers import pipeline, write_problem

from kernelfuse.codegen import generate


def test_a_permuted_output_keeps_eagers_strides(tmp_path: Path) -> None:
    body = "def forward(self, x, y):\n    return torch.sigmoid(x.transpose(1, 2)) * y.transpose(1, 2)"
    _, _, plans = pipeline(write_problem(tmp_path, "perm", body, "[torch.randn(2, 40, 24), torch.randn(2, 40, 24)]"))
    plan = plans[-1]
    (step,) = plan.generated
    eager = (torch.sigmoid(torch.randn(2, 40, 24).transpose(1, 2)) * torch.randn(2, 40, 24).transpose(1, 2)).stride()
    assert step.permuted_out == eager == (960, 1, 24)
    sources = generate(plan)
    assert "out = src.new_empty_strided((2, 24, 40), (960, 1, 24))" in sources.binding
    # iterated in the output's memory order, where the source lies alike: 16 bytes per access
    assert "k0_kernel<4><<<" in sources.cuda
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step, seed=4)
    assert out.stride() == (960, 1, 24)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_a_contiguous_output_stays_as_it_was(tmp_path: Path) -> None:
    _, _, plans = pipeline(write_problem(tmp_path, "flat", "def forward(self, x):\n    return torch.sigmoid(x) * 2.0",
                                         "[torch.randn(2, 40, 24)]"))
    (step,) = plans[-1].generated
    assert step.permuted_out is None
    sources = generate(plans[-1])
    assert "new_empty_strided" not in sources.binding and "out[m] = " not in sources.cuda
