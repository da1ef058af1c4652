"""Pointwise layout changes through shared-memory tiles (kernelfuse.codegen.tiled), run on the CPU
(tests/emulation_helpers.py) against the plan interpreter: channels-last to NCHW and back (the channels-last
graph's first and last copies), a plain transpose, with a pointwise op on each side, sizes that leave partial
tiles."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated_against_interpreter

from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.plan import make_plan


class ToNCHW(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x.contiguous(memory_format=torch.contiguous_format)) * 2.0


class ToChannelsLast(torch.nn.Module):
    def forward(self, x):
        return (x + 1.0).contiguous(memory_format=torch.channels_last)


class Transpose(torch.nn.Module):
    def forward(self, x):
        return x.transpose(-1, -2).contiguous() - 0.5


CASES = [
    (ToNCHW(), torch.randn(3, 40, 9, 7).contiguous(memory_format=torch.channels_last)),  # 63 positions, 40 channels
    (ToChannelsLast(), torch.randn(2, 33, 12, 10)),
    (Transpose(), torch.randn(70, 45)),
]


@pytest.mark.parametrize(("module", "x"), CASES, ids=["to_nchw", "to_channels_last", "transpose"])
def test_a_layout_change_goes_through_tiles_and_matches_torch(tmp_path, module, x):
    plan = make_plan(capture_module(module, (x,)))
    assert len(plan.generated) == 1, plan.summary()
    cuda = generate(plan).cuda
    assert "__shared__ float tile[32][33]" in cuda and "block(32, 8)" in cuda, cuda[-1500:]
    assert emulated_against_interpreter(plan, tmp_path) == 1
