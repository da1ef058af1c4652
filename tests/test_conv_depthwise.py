"""Depthwise convolutions run the direct kernel (kernelfuse.codegen.conv_depthwise), checked in the CPU emulation
against float64 on unrounded operands (the kernel multiplies in fp32, never TF32): 1-, 2- and 3-d; strided,
padded, dilated; a channel multiplier; output rows that do not fill a thread's four; both output layouts."""

from __future__ import annotations

import functools

import pytest
import torch
from emulation_helpers import emulated

import kernelfuse.codegen.cuda as cuda_module
from kernelfuse.capture import capture_module
from kernelfuse.codegen.conv_igemm import render_conv
from kernelfuse.plan import make_plan
from kernelfuse.plan.fuse import PlanOptions
from kernelfuse.plan.interpret import run_env, run_fused


class Depthwise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = torch.nn.Conv2d(4, 4, 3, groups=4)
        self.strided = torch.nn.Conv2d(3, 3, 5, stride=2, padding=2, groups=3, bias=False)
        self.dilated = torch.nn.Conv2d(2, 6, (3, 2), padding=(2, 1), dilation=(2, 3), groups=2)  # multiplier 3
        self.line = torch.nn.Conv1d(5, 5, 4, stride=3, padding=1, groups=5)
        self.vol = torch.nn.Conv3d(3, 3, (2, 3, 3), stride=(2, 1, 2), padding=(1, 1, 0), groups=3)
        self.shift = torch.nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, a, b, c, d, e):
        return (torch.relu(self.plain(a) - self.shift), self.strided(b) * 0.5, torch.tanh(self.dilated(c)),
                self.line(d) + 1.0, torch.sigmoid(self.vol(e)))


INPUTS = [(2, 4, 9, 37), (1, 3, 11, 10), (2, 2, 7, 13), (3, 5, 29), (2, 3, 5, 6, 9)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_depthwise_kernels_match_float64(tmp_path, monkeypatch, layout):
    torch.manual_seed(0)
    model = Depthwise().eval()
    inputs = [torch.randn(s) for s in INPUTS]
    graph = capture_module(model, inputs)
    monkeypatch.setattr(cuda_module, "render_conv", functools.partial(render_conv, out_layout=layout))
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False))
    assert len(plan.fused) == 5 and all(s.anchor.impl == "direct" for s in plan.fused)
    assert cuda_module.generate(plan).cuda.count("direct depthwise convolution") == 5
    emu = emulated(plan, tmp_path)
    state = {k: v.detach().double() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    env = run_env(plan, state, [t.double() for t in inputs])
    for step in plan.fused:
        node = step.anchor.node
        args32 = [env[r.name].float() if r is not None else None for r in node.args[:3]]
        out = getattr(emu.kernels, step.kernel)(*args32, *[env[o.ref.name].float() for o in step.epilogue.operands])
        ref = run_fused(plan.graph, step, env)
        if layout == "nhwc" and out.dim() > 3:
            fmt = torch.channels_last if out.dim() == 4 else torch.channels_last_3d
            assert out.is_contiguous(memory_format=fmt), step.kernel
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=f"{step.kernel}: {step.chain(graph)}")


def test_a_grouped_convolution_with_several_input_channels_stays_an_implicit_gemm():
    graph = capture_module(torch.nn.Conv2d(4, 4, 3, groups=2), [torch.randn(1, 4, 6, 6)])
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False))
    assert plan.fused[0].anchor.impl == "generated"
    assert "implicit GEMM, epilogue inside" in cuda_module.generate(plan).cuda
