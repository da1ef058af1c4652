"""Channels-last convolutions on the GPU: both layouts' emitted files and the measured choice against eager."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kernelfuse.bench.layout import measure_conv_layouts
from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

FIXTURE = Path(__file__).parent / "fixtures" / "problems" / "conv_layouts.py"


def _outputs(path: Path, cls: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = runpy.run_path(str(path))[cls]().cuda()
    with torch.no_grad():
        return list(model(*inputs))


@pytest.mark.gpu
def test_every_layout_matches_eager(tmp_path: Path, strict_cudnn: None) -> None:
    problem = load_problem(FIXTURE)
    graph = rewrite(capture(problem, build_model(problem)))
    timings = measure_conv_layouts(graph)
    assert timings is not None and len(timings) == 6 and all(t.nchw_ms > 0 and t.nhwc_ms > 0 for t in timings)
    measured = plan_variants(graph, conv_layouts={t.node: t.choice for t in timings},
                             fp32_convs=frozenset(t.node for t in timings if t.fp32))
    assert all(t.fp32 for t in timings)  # cuDNN's TF32 is off here: every NCHW call computes in full fp32
    plans = plan_variants(graph) + measured
    torch.manual_seed(1)
    inputs = [t.cuda() for t in runpy.run_path(str(FIXTURE))["get_inputs"]()]
    expected = _outputs(FIXTURE, "Model", inputs)
    for plan in plans:
        path = tmp_path / f"layouts_{plan.variant.replace('+', '_')}.py"
        path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
        got = _outputs(path, "ModelNew", inputs)
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert g.shape == e.shape, (plan.variant, i)
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, v=plan.variant, i=i: f"{v} {i}: {m}")
            assert g.is_contiguous(), (plan.variant, i)  # NCHW out, whatever layout ran inside


@pytest.mark.gpu
def test_a_norm_writing_a_convolutions_channels_last_input_matches_eager(tmp_path: Path, strict_cudnn: None) -> None:
    """kernelfuse.plan.convinput: the batch norm's normalise pass writes the next convolution's input
    channels-last (transposed through shared memory); in the NCHW plan the second norm's 16-byte pass reads the
    shortcut with its source. Outputs and running statistics as eager's."""
    fixture = Path(__file__).parent / "fixtures" / "problems" / "conv_bn_conv.py"
    problem = load_problem(fixture)
    plans = plan_variants(rewrite(capture(problem, build_model(problem))))
    torch.manual_seed(1)
    inputs = [t.cuda() for t in runpy.run_path(str(fixture))["get_inputs"]()]
    for plan in (plans[0], next(p for p in plans if p.variant == "fused-nchw")):
        path = tmp_path / f"conv_bn_conv_{plan.variant.replace('-', '_')}.py"
        path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
        torch.manual_seed(0)
        ref = runpy.run_path(str(fixture))["Model"]().cuda()
        torch.manual_seed(0)
        new = runpy.run_path(str(path))["ModelNew"]().cuda()
        with torch.no_grad():
            torch.testing.assert_close(new(*inputs), ref(*inputs), atol=1e-4, rtol=1e-4, msg=plan.variant)
        for name in ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"):
            torch.testing.assert_close(new.get_buffer(name), ref.get_buffer(name), atol=1e-5, rtol=1e-5)
