"""Channels-last convolutions (2-d, 3-d, transposed) in the plan, the kernels and the emitted file (CPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from optimizer_helpers import assert_interpreter_matches, pipeline
from test_nvcc_compile import _nvcc

from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.plan import FusedStep, TorchStep, make_plan, plan_variants
from kernelfuse.plan.fuse import PlanOptions
from kernelfuse.plan.layout import channels_last_strides

FIXTURE = Path(__file__).parent / "fixtures" / "problems" / "conv_layouts.py"


@pytest.fixture(scope="module")
def layouts():
    return pipeline(FIXTURE)


def test_channels_last_strides_follow_torch():
    import torch

    for shape in [(2, 3, 4, 5), (2, 3, 4, 5, 6), (1, 1, 7, 1)]:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        expected = torch.empty(shape).contiguous(memory_format=fmt).stride()
        got = channels_last_strides(shape)
        assert all(d == 1 or g == e for d, g, e in zip(shape, got, expected, strict=True)), (shape, got, expected)


def test_both_layouts_compute_what_the_model_computes(layouts):
    problem, _, plans = layouts
    assert [p.variant for p in plans] == ["fused-nhwc", "fused-nchw"]
    for plan in plans:
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)


def test_reductions_read_the_channels_last_output_through_its_strides(layouts):
    _, g, (nhwc, _) = layouts
    kept = [s for s in nhwc.fused if s.keeps_layout]
    assert len(kept) == 4 and all(not s.needs_kernel for s in kept)  # no kernel transposes these back
    readers = {s.source.ref.name: s for s in nhwc.generated}
    binding = generate(nhwc).binding
    for step in kept:
        reader = readers[step.out]
        strides = channels_last_strides(reader.source.meta.shape)
        assert reader.source.meta.stride == strides
        # the wrapper checks the layout the kernel reads, not the captured NCHW one
        (check,) = [ln for ln in binding.splitlines() if f'_check(src, "{reader.kernel} src' in ln]
        assert check.endswith(f"{tuple(strides)}, torch.float32)"), check
    transposed = [s for s in nhwc.fused if s.epilogue.statements]
    # the bias of every biased convolution (rewrite conv_bias_to_epilogue) is the epilogue's first add
    assert [s.chain(nhwc.graph) for s in transposed] == ["convolution -> add -> add -> clamp"]
    assert transposed[0].needs_kernel and not transposed[0].inplace  # reads NHWC, writes a new NCHW tensor


def test_a_convolution_no_kernel_reads_stays_a_torch_call(layouts):
    _, g, (nhwc, _) = layouts
    torch_convs = [s for s in nhwc.steps if isinstance(s, TorchStep) and s.node.op == "convolution.default"]
    assert len(torch_convs) == 1 and g.users(torch_convs[0].node.name)[0].op == "roll.default"


def test_strategies_follow_the_source_layout(layouts):
    _, _, (nhwc, nchw) = layouts
    strategies = {
        variant.variant: re.findall(r"// strategy: (\w+)", generate(variant).cuda) for variant in (nhwc, nchw)
    }
    # amin and softmax over channels: contiguous rows when channels-last; strided rows in NCHW
    assert strategies["fused-nhwc"][:2] == ["inner", "inner"]
    assert strategies["fused-nchw"][:2] == ["strided", "strided"]
    # the mean over space of 16 channels-last rows: too few rows for a thread each, so split into chunks
    assert strategies["fused-nhwc"][2:] == ["split", "strided"]
    assert "split strided, 16 rows of 2145 in 8 chunks" in generate(nhwc).cuda


def test_measured_layouts_make_one_plan_per_convolution_choice(layouts):
    _, g, _ = layouts
    convs = [n.name for n in g.nodes if n.op == "convolution.default"]
    choice = {name: ("nchw" if i % 2 else "nhwc") for i, name in enumerate(convs)}
    plan, fallback = plan_variants(g, conv_layouts=choice)
    assert plan.variant == "fused-nchw+nhwc" and fallback.variant == "fused-nchw"  # all NCHW if the first fails
    for step in plan.fused:
        assert step.anchor.layout == choice[step.anchor.node.name]
    same = make_plan(g, PlanOptions(conv_layouts=tuple(sorted(choice.items()))))
    assert same.steps == plan.steps


def test_emitted_file_converts_operands_and_keeps_the_layout(layouts, tmp_path):
    problem, _, (nhwc, _) = layouts
    text = emit_modelnew(problem, nhwc, generate(nhwc), "CPU test")
    assert "memory_format=torch.channels_last_3d)" in text and "memory_format=torch.channels_last)" in text
    assert text.count(".contiguous(memory_format=torch.channels_last_3d)\n") == 2  # the two 3-d convs kept NDHWC
    assert "torch.cudnn_convolution_relu(ext.to_channels_last(" in text
    compile(text, "emitted", "exec")


def test_channels_last_kernels_compile_with_nvcc(layouts, tmp_path):
    nvcc = _nvcc()
    _, _, (nhwc, _) = layouts
    cu = tmp_path / "layouts.cu"
    cu.write_text(generate(nhwc).cuda)
    result = subprocess.run([nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(tmp_path / "l.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_one_dimensional_convolutions_stay_nchw(tmp_path):
    from optimizer_helpers import write_problem

    path = write_problem(tmp_path, "c1", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))
        """, "[torch.randn(2, 3, 9)]")
    _, _, plans = pipeline(path)
    assert [p.variant for p in plans] == ["fused"]
    (step,) = [s for s in plans[0].steps if isinstance(s, FusedStep)]
    assert step.anchor.layout == "nchw" and step.inplace
