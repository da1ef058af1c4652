"""The library anchors' epilogue kernels on the CPU (tests/emulation_helpers.py): the channels-last plan's layout
changes (the NCHW -> channels-last copy of a convolution's input, the epilogue that writes the channels-last result
back as NCHW) in their 16-byte form (fp32, channel and plane sizes multiples of 4) and their scalar form, and the
NCHW / matmul (flat) epilogue; operands constant over a 16-byte vector loaded once for it. Against torch."""

from __future__ import annotations

import ctypes

import pytest
import torch
from emulation_helpers import emulated

from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.plan import make_plan
from kernelfuse.plan.fuse import PlanOptions


class ConvEpilogue(torch.nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, bias=False)
        self.shift = torch.nn.Parameter(torch.randn(cout, 1, 1))

    def forward(self, x):
        return torch.tanh(self.conv(x) - self.shift) * 2.0


# (input, conv out channels): 16-byte both ways (8 channels, 6 x 10 = 60 positions), several tiles of 32 x 64
# (40 channels, 10 x 12 = 120 positions), and the scalar fallbacks (6 channels; 5 x 7 = 35 positions)
CASES = {"vector": ((2, 4, 8, 12), 8), "tiles": ((1, 8, 12, 14), 40), "scalar": ((2, 3, 7, 9), 6)}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_changes_match_torch(case, tmp_path):
    shape, cout = CASES[case]
    torch.manual_seed(0)
    model = ConvEpilogue(shape[1], cout).eval()
    x = torch.randn(shape)
    graph = capture_module(model, [x])
    plan = make_plan(graph, PlanOptions(conv_layout="nhwc"))
    (step,) = plan.fused
    assert step.anchor.layout == "nhwc" and step.needs_kernel
    vector = "_kernel_v<<<" in generate(plan).cuda
    assert vector == (case != "scalar")
    emu = emulated(plan, tmp_path)
    converted = torch.empty_like(x, memory_format=torch.channels_last)  # the binding's launcher, without its CUDA check
    n, c, h, w = shape
    assert emu.lib.kf_nchw_to_nhwc_float32(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(converted.data_ptr()),
                                           ctypes.c_longlong(n), c, h * w, None) == 0
    assert torch.equal(converted, x)
    with torch.no_grad():
        acc = torch.nn.functional.conv2d(x, model.conv.weight).contiguous(memory_format=torch.channels_last)
        out = getattr(emu.kernels, step.kernel)(acc, model.shift.detach())
        expected = torch.tanh(acc - model.shift) * 2.0
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


class ConvResidual(torch.nn.Module):
    """A per-channel shift (loaded once for a thread's 4 positions) beside a full-shape residual (per element)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, bias=False)
        self.shift = torch.nn.Parameter(torch.randn(cout, 1, 1))

    def forward(self, x, residual):
        return torch.sigmoid(self.conv(x) * self.shift) + residual


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("case", list(CASES))
def test_epilogues_load_vector_constant_operands_once(case, layout, tmp_path):
    """The channels-last and the NCHW (flat) epilogue: the per-channel operand is loaded once for a 16-byte vector
    where the plane is a multiple of 4 elements (60 and 120 positions, rows of 10 and 12: a vector may cross a
    row), per element where it is not (35 positions: the scalar kernels); the full-shape residual always per
    element. Both against torch, over several tiles and samples."""
    shape, cout = CASES[case]
    torch.manual_seed(1)
    model = ConvResidual(shape[1], cout).eval()
    x = torch.randn(shape)
    residual = torch.randn(shape[0], cout, shape[2] - 2, shape[3] - 2)
    plan = make_plan(capture_module(model, [x, residual]), PlanOptions(conv_layout=layout))
    (step,) = plan.fused
    assert step.anchor.layout == layout
    cuda = generate(plan).cuda
    assert (f"{step.kernel}_apply_h(" in cuda) == (case != "scalar") and "in1_h" not in cuda
    emu = emulated(plan, tmp_path)
    with torch.no_grad():
        acc = torch.nn.functional.conv2d(x, model.conv.weight)
        if layout == "nhwc":
            acc = acc.contiguous(memory_format=torch.channels_last)
        shift = model.shift.detach()
        args = [shift if tuple(o.meta.shape) == tuple(shift.shape) else residual for o in step.epilogue.operands]
        out = getattr(emu.kernels, step.kernel)(acc.clone(), *args)  # the NCHW epilogue writes acc in place
        expected = torch.sigmoid(acc * model.shift) + residual
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


class LinearEpilogue(torch.nn.Module):
    """A per-row scale (one value for a vector's 4 columns) beside a per-column bias (one per element)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k))
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x, row_scale):
        return torch.tanh((x @ self.weight.T + self.bias) * row_scale)


def test_flat_epilogue_of_a_matmul_hoists_the_row_operand_only(tmp_path):
    """A GEMM output (M, N): a vector is 4 columns of one row, so the per-row scale is loaded once for it and the
    per-column bias per element."""
    torch.manual_seed(3)
    model = LinearEpilogue(16, 12).eval()
    x, row_scale = torch.randn(8, 16), torch.randn(8, 1)
    plan = make_plan(capture_module(model, [x, row_scale]))
    (step,) = plan.fused
    cuda = generate(plan).cuda
    hoisted = [o.meta.shape for j, o in enumerate(step.epilogue.operands) if f"float in{j}_h" in cuda]
    assert hoisted == [torch.Size([8, 1])], hoisted
    emu = emulated(plan, tmp_path)
    with torch.no_grad():
        acc = x @ model.weight.T
        named = {(12,): model.bias.detach(), (8, 1): row_scale}
        operands = [named[tuple(o.meta.shape)] for o in step.epilogue.operands]
        out = getattr(emu.kernels, step.kernel)(acc.clone(), *operands)
        expected = torch.tanh((acc + model.bias) * row_scale)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
