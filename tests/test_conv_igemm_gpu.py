"""The implicit-GEMM convolutions on the GPU: the fused-igemm forward against eager and float64, with the judge's
accuracy rule (TF32 tensor cores where eager's cuDNN call uses TF32 under allow_tf32's default; 3xTF32, fp32
accuracy, where it computes in full fp32)."""

from __future__ import annotations

import pytest
import torch
from test_conv_depthwise import INPUTS as DEPTHWISE_INPUTS
from test_conv_depthwise import Depthwise
from test_conv_igemm import INPUTS, Convs

from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.emit.module import build_module
from kernelfuse.plan import make_plan
from kernelfuse.plan.fuse import PlanOptions
from kernelfuse.plan.interpret import call_aten, run_env
from kernelfuse.verify.float64 import accuracy_ok


def _plan(graph, model: torch.nn.Module, inputs: list[torch.Tensor]):
    """The fused-igemm plan, its convolutions fp32-accurate where eager's cuDNN call computes in full fp32 here (its
    result equals the TF32-free one: small problems often do), TF32 tensor cores elsewhere, as the optimizer
    plans them from the layout timings."""
    state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    env = run_env(make_plan(graph, PlanOptions(conv_layout="nchw", generated=False)), state, inputs)
    exact = []
    previous = torch.backends.cudnn.allow_tf32
    for node in graph.nodes:
        if node.op != "convolution.default":
            continue
        torch.backends.cudnn.allow_tf32 = True
        tf32 = call_aten(node, env)
        torch.backends.cudnn.allow_tf32 = False
        full = call_aten(node, env)
        torch.backends.cudnn.allow_tf32 = previous
        if torch.allclose(tf32, full, rtol=1e-5, atol=1e-5 * float(full.abs().max())):
            exact.append(node.name)
    return make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False,
                                        fp32_convs=tuple(exact)))


def _never_reference(*args: object) -> None:
    raise AssertionError("the fused module fell back to the original ops: the kernels did not run")


def _check(model: torch.nn.Module, fused: torch.nn.Module, inputs: list[torch.Tensor],
           memory_format: torch.memory_format = torch.contiguous_format) -> None:
    """The fused module's outputs (dense in `memory_format`) pass the judge's accuracy rule against eager's and
    float64's."""
    fused._reference_forward = _never_reference  # the comparison below must be of our kernels
    with torch.no_grad():
        eager, ours = model(*inputs), fused(*inputs)
        ref = model.double()(*[t.double() for t in inputs])
        model.float()
    for i, (e, o, r) in enumerate(zip(eager, ours, ref, strict=True)):
        assert o.shape == e.shape and o.is_contiguous(memory_format=memory_format) and not o.isnan().any(), i
        ours_err, eager_err = (o.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert accuracy_ok(ours_err, eager_err, r.abs().max().item()), (i, ours_err, eager_err)


def _run_scaled(module: type[torch.nn.Module], shapes: list[tuple[int, ...]], scale: int) -> list[str]:
    """`module`'s convolutions planned as the optimizer plans them, built and checked against eager and float64
    with the batch `scale` times larger; the anchors' implementations."""
    torch.manual_seed(0)
    model = module().cuda().eval()
    inputs = [torch.randn((s[0] * scale, *s[1:]), device="cuda") for s in shapes]
    graph = capture_module(model, inputs)
    plan = _plan(graph, model, inputs)
    with torch.no_grad():
        _check(model, build_module(model, plan, generate(plan)), inputs)
    return [s.anchor.impl for s in plan.fused]


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 8])
def test_generated_convolutions_match_eager(scale: int) -> None:
    """Every kind the kernel covers, at the CPU test's sizes and with a batch 8 times larger (many blocks)."""
    impls = _run_scaled(Convs, INPUTS, scale)
    assert impls.count("direct") == 1 and set(impls) == {"generated", "direct"}  # the depthwise one is direct


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 16])
def test_direct_depthwise_convolutions_match_eager(scale: int) -> None:
    """The direct kernel (1/2/3-d, strided, padded, dilated, a channel multiplier) against eager and float64."""
    assert _run_scaled(Depthwise, DEPTHWISE_INPUTS, scale) == ["direct"] * 5


@pytest.mark.gpu
def test_large_convolution_tf32_and_3xtf32() -> None:
    """A level-2-sized 2-d convolution (64 -> 128 channels, many K stages) on tensor cores, then the same with the
    anchor marked fp32 (3xTF32) against eager with cuDNN's TF32 off, to fp32 rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 128, 3), torch.nn.Mish()).cuda().eval()
    inputs = [torch.randn(8, 64, 66, 66, device="cuda")]
    graph = capture_module(model, inputs)
    plan = _plan(graph, model, inputs)
    with torch.no_grad():
        _check(model, build_module(model, plan, generate(plan)), inputs)
    (conv,) = [n.name for n in graph.nodes if n.op == "convolution.default"]
    exact = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False,
                                         fp32_convs=(conv,)))
    assert exact.fused[0].anchor.fp32
    fused = build_module(model, exact, generate(exact))
    fused._reference_forward = _never_reference
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            torch.testing.assert_close(fused(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)
    finally:
        torch.backends.cudnn.allow_tf32 = previous
