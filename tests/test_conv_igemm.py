"""The implicit-GEMM convolution with its epilogue inside (kernelfuse.codegen.conv_igemm), run on the CPU.

The kernel file is built with the host compiler (tests/emulation_helpers.py): the tensor-core step becomes its
scalar fallback, which computes the same accumulator elements per lane, so the gather (stride, padding, dilation,
groups, transposed), the tiling, the edge masks and the epilogue are what the GPU runs. The reference is torch's
convolution in float64 on the operands rounded to TF32 as the kernel rounds them (unrounded for the depthwise one,
which runs the direct kernel of conv_depthwise in full fp32), then the plan's epilogue: what is left is fp32
accumulation error.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated

import kernelfuse.codegen.cuda as cuda_module
from kernelfuse.capture import capture_module
from kernelfuse.codegen.conv_geometry import conv_shape, phases
from kernelfuse.codegen.conv_igemm import render_conv, tile_config
from kernelfuse.plan import make_plan, optimizer_variants, owned_anchor_variants, plan_variants
from kernelfuse.plan.fuse import PlanOptions
from kernelfuse.plan.interpret import run_env, run_fused
from kernelfuse.report import plan_json


class Convs(torch.nn.Module):
    """Independent convolutions, each followed by pointwise ops: one fused step each, one kernel file."""

    def __init__(self) -> None:
        super().__init__()
        self.strided = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)  # M below one tile, K = 27
        self.grouped = torch.nn.Conv2d(8, 12, 3, padding=2, dilation=2, groups=4, bias=False)
        self.depthwise = torch.nn.Conv2d(6, 6, (3, 2), padding=(1, 0), groups=6)
        self.wide = torch.nn.Conv2d(32, 70, 3)  # two N tiles of 64, K = 288: 18 stages of one tap each
        self.vol = torch.nn.Conv3d(2, 9, (2, 3, 3), stride=(1, 2, 1), padding=(0, 1, 1))
        self.line = torch.nn.Conv1d(4, 20, 5, stride=3, padding=2)
        self.up = torch.nn.ConvTranspose2d(16, 6, 3, stride=2, padding=1, output_padding=1)  # 4 phases
        self.up_vol = torch.nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1, groups=2, dilation=(1, 2, 1))
        self.sparse = torch.nn.ConvTranspose1d(4, 5, 2, stride=3)  # one phase of three has no tap: bias only
        self.tiny = torch.nn.ConvTranspose2d(2, 3, 1, stride=2)  # 1x1 output: one phase, not stride 1
        self.scale = torch.nn.Parameter(torch.randn(12, 1, 1))

    def forward(self, a, b, c, d, e, f, g, h, i, j):
        return (torch.relu(self.strided(a)) * 0.5,
                torch.tanh(self.grouped(b) - self.scale),
                self.depthwise(c) + 1.0,
                torch.nn.functional.gelu(self.wide(d)),
                torch.sigmoid(self.vol(e)) * 2.0,
                torch.clamp(self.line(f), -0.5, 0.5),
                self.up(g) * g.mean(),
                torch.nn.functional.hardswish(self.up_vol(h)),
                self.sparse(i) * 3.0,
                self.tiny(j) + 1.0)


INPUTS = [(2, 3, 9, 11), (1, 8, 10, 13), (2, 6, 7, 5), (1, 32, 12, 13), (2, 2, 5, 6, 7), (3, 4, 50), (2, 16, 5, 6),
          (1, 4, 3, 4, 5), (2, 4, 7), (3, 2, 1, 1)]


def _tf32(t: torch.Tensor, round_: bool = True) -> torch.Tensor:
    """fp32 -> TF32: round the low 13 mantissa bits to nearest, ties away from zero, as cvt.rna does (or drop them,
    as the tensor cores read an unrounded operand). As ptxas compiles cvt.rna (kf_round_tf32): the half ulp added
    to finite values only, the bits cleared from every value (so a finite value from 0x7f7ff000 up rounds to
    infinity, and a NaN whose payload is all in those bits becomes one)."""
    t = t.float().contiguous()
    bits = t.view(torch.int32)
    if round_:
        bits = torch.where(t.isfinite(), bits + 0x1000, bits)
    return (bits & ~0x1FFF).view(torch.float32)


@pytest.fixture(scope="module")
def model_and_plan():
    torch.manual_seed(0)
    model = Convs().eval()
    inputs = [torch.randn(s) for s in INPUTS]
    graph = capture_module(model, inputs)
    return model, inputs, graph


def _run(model, inputs, graph, plan, tmp_path, exact: bool = False):
    """(ours, reference) for every fused convolution step of `plan`, on the CPU build of its kernels."""
    emu = emulated(plan, tmp_path)
    state = {k: v.detach().double() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    env = run_env(plan, state, [t.double() for t in inputs])
    results = []
    for step in plan.fused:
        assert step.anchor.epilogue_inside, step.kernel
        node = step.anchor.node
        args32 = [env[r.name].float() if r is not None else None for r in node.args[:3]]
        operands = [env[o.ref.name].float() for o in step.epilogue.operands]
        out = getattr(emu.kernels, step.kernel)(*args32, *operands)
        ref_env = dict(env)
        direct = step.anchor.impl == "direct"  # the direct kernel multiplies in full fp32
        for ref, t in zip(node.args[:2], args32[:2], strict=True):
            ref_env[ref.name] = (t if exact or direct else _tf32(t)).double()
        results.append((step, out, run_fused(plan.graph, step, ref_env)))
    return results


def test_every_convolution_is_generated_with_its_epilogue_inside(model_and_plan):
    _, _, graph = model_and_plan
    (plan,) = owned_anchor_variants(graph)
    assert plan.variant == "fused-igemm"
    impls = [s.anchor.impl for s in plan.fused]
    assert len(plan.fused) == 10 and all(s.needs_kernel for s in plan.fused)
    assert impls == ["generated"] * 2 + ["direct"] + ["generated"] * 7  # the depthwise one: the direct kernel
    # one more variant: the best library plan (channels-last first, unmeasured) with the depthwise convolution ours
    *library, igemm, direct = optimizer_variants(graph)
    assert igemm.variant == "fused-igemm" and direct.variant == "fused-nhwc-direct"
    assert direct.options == replace(library[0].options, conv_impl="direct")
    assert [s.anchor.impl for s in direct.fused] == ["library"] * 2 + ["direct"] + ["library"] * 7
    assert direct.fused[2].anchor.layout == "nchw"  # the direct kernel reads and writes NCHW
    assert not any(s.anchor.fused_relu for s in plan.fused)  # the ReLU is an epilogue statement here
    # nothing measured: fp32 accuracy (3xTF32) everywhere, as cuDNN computes small convolutions exactly
    assert all(s.anchor.fp32 for s in plan.fused) and "generated implicit GEMM 3xTF32 [nchw]" in plan.summary()
    convs = frozenset(s.anchor.node.name for s in plan.fused)
    exact = sorted(convs)[0]
    measured = owned_anchor_variants(graph, measured=convs, fp32_convs=frozenset({exact}))[0]
    assert [s.anchor.fp32 for s in measured.fused] == [s.anchor.node.name == exact for s in measured.fused]
    assert "generated implicit GEMM TF32 [nchw], epilogue inside" in measured.summary()
    assert all(s.anchor.impl == "library" for p in plan_variants(graph) for s in p.fused)  # unchanged


def test_graph_without_convolution_has_no_generated_variant():
    linear = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    assert owned_anchor_variants(capture_module(linear, [torch.randn(2, 4)])) == []


def test_report_says_where_the_epilogue_runs(model_and_plan):
    _, _, graph = model_and_plan
    igemm = owned_anchor_variants(graph)[0]
    anchors = [k for k in plan_json(igemm)["kernels"] if "impl" in k]
    assert len(anchors) == 10
    assert all(k["epilogue_in_anchor"] and not k["epilogue_kernel"] for k in anchors)
    assert [(k["impl"], k["family"]) for k in anchors].count(("direct", "conv-direct")) == 1
    assert [k["impl"] for k in anchors].count("generated") == 9
    library = [k for p in plan_variants(graph) for k in plan_json(p)["kernels"] if "impl" in k]
    assert library and all(k["impl"] == "library" and k["library"] == "cuDNN" for k in library)
    # every library anchor here has ops behind cuDNN's call: they run in an epilogue kernel of their own
    assert {k["epilogue_in_anchor"] for k in library} == {False}


def test_transposed_convolutions_split_into_phases(model_and_plan):
    """Each phase reads only the taps that reach an input position: a quarter (2-d, stride 2) of the kernel."""
    _, _, graph = model_and_plan
    plan = owned_anchor_variants(graph)[0]
    shapes = [conv_shape(graph, s) for s in plan.fused]
    step, scale, up = phases(shapes[6])
    assert step == (2, 2) and scale == (1, 1) and len(up) == 4
    assert sorted(len(p.taps) for p in up) == [1, 2, 2, 4] and sum(p.pixels for p in up) == 10 * 12
    _, _, sparse = phases(shapes[8])
    assert [len(p.taps) for p in sparse] == [1, 1, 0]
    _, scale, (forward,) = phases(shapes[0])
    assert scale == (2, 2) and len(forward.taps) == 9
    step, _, (tiny,) = phases(shapes[9])
    assert step == (2, 2) and tiny.count == (1, 1) and tiny.taps == ((0, (0, 0)),)


def test_tile_sizes_follow_the_channels(model_and_plan):
    _, _, graph = model_and_plan
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False))
    widths = {s.chain(plan.graph).split(" -> ")[1]: tile_config(conv_shape(plan.graph, s)).bn for s in plan.fused}
    assert [tile_config(conv_shape(plan.graph, s)).bn for s in plan.fused] == [8, 8, 8, 64, 16, 32, 8, 8, 8, 8], widths


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_kernels_match_float64_on_tf32_operands(model_and_plan, tmp_path, monkeypatch, layout):
    model, inputs, graph = model_and_plan
    monkeypatch.setattr(cuda_module, "render_conv", functools.partial(render_conv, out_layout=layout))
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False))
    for step, out, ref in _run(model, inputs, graph, plan, tmp_path):
        fmt = torch.channels_last if out.dim() == 4 else torch.channels_last_3d
        if layout == "nhwc" and out.dim() > 3:
            assert out.is_contiguous(memory_format=fmt), step.kernel
        assert out.shape == ref.shape and not out.isnan().any(), step.kernel
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=f"{step.kernel}: {step.chain(graph)}")


def test_fp32_anchor_is_fp32_accurate(model_and_plan, tmp_path):
    """A convolution eager computes in full fp32 (Anchor.fp32) multiplies each operand's TF32 part and the TF32
    rounding of its rest (3xTF32): fp32 accuracy against the unrounded operands."""
    model, inputs, graph = model_and_plan
    names = tuple(s.anchor.node.name for s in owned_anchor_variants(graph)[0].fused)
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False,
                                        fp32_convs=names[3:4]))
    (wide,) = [s for s in plan.fused if s.anchor.fp32]
    source = cuda_module.generate(plan).cuda
    assert source.count("kf_igemm_k8<2, 8, true>") == 1 and "kf_igemm_k8<2, 8, false>" not in source
    results = {s.kernel: (out, ref) for s, out, ref in _run(model, inputs, graph, plan, tmp_path, exact=True)}
    out, ref = results[wide.kernel]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_kernels_compile_for_sm90_without_spills(model_and_plan, tmp_path):
    """nvcc builds the tensor-core path (the emulation runs the scalar one): exported launchers of the binding's
    arity, and no register spills under the kernel's launch bounds."""
    import re
    import subprocess

    from test_nvcc_compile import _nvcc

    nvcc = _nvcc()
    _, _, graph = model_and_plan
    names = [n.name for n in graph.nodes if n.op == "convolution.default"]
    plan = make_plan(graph, PlanOptions(conv_layout="nchw", conv_impl="generated", cudnn_fused_relu=False,
                                        fp32_convs=tuple(names[3:5])))  # the 3xTF32 path too, 64 and 16 wide
    src = cuda_module.generate(plan)
    cu, lib = tmp_path / "igemm.cu", tmp_path / "igemm.so"
    cu.write_text(src.cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC",
                             "-Xptxas", "-v", str(cu), "-o", str(lib)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert " 0 bytes spill stores" in result.stderr
    ptx = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", str(cu), "-o", "-"], capture_output=True,
                         text=True, timeout=600).stdout
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx and "cp.async.ca.shared.global" in ptx
    assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", result.stderr), result.stderr[-3000:]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
    for step in plan.fused:
        assert f"{step.kernel}_launch" in exported
        assert f'"{step.kernel}_launch", [ctypes.c_void_p] * {4 + len(step.epilogue.operands)}' in src.binding


def test_emitted_forward_calls_the_anchor_kernel_once():
    """The emitted file: one call per convolution (input, weight, bias, operands), no cuDNN call, no epilogue
    kernel; the plan computes what the model computes (CPU interpreter)."""
    from optimizer_helpers import assert_interpreter_matches, pipeline

    from kernelfuse.emit import emit_modelnew

    problem, graph, _ = pipeline(Path(__file__).parent / "fixtures" / "problems" / "conv_layouts.py")
    (plan,) = owned_anchor_variants(graph)
    assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)
    text = emit_modelnew(problem, plan, cuda_module.generate(plan), "CPU test")
    generated = [s for s in plan.fused if s.anchor.epilogue_inside]
    assert generated and "torch.convolution(" not in text and "cudnn_convolution" not in text
    for step in generated:
        calls = [ln for ln in text.splitlines() if f"ext.{step.kernel}(" in ln]
        assert len(calls) == 1 and ".contiguous()" in calls[0], calls
        assert calls[0].count(",") == 2 + len(step.epilogue.operands), calls[0]
