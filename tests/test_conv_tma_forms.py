"""The TMA im2col convolution's generalised forms (kernelfuse.codegen.conv_tma.TmaConv): dilation (the im2col
offsets r * dil_h, s * dil_w and the corners' dilated halo), stride (the map's traversal strides), 1-d convolutions
(H = 1, the input viewed (N, C, 1, L)), transposed convolutions of stride 1 (the forward one of the reversed taps,
the weight's tap-major rows read at tap KV - 1 - rs) and 32-wide channel tiles (C_out % 64 != 0).

On the CPU the kernel text runs emulated (tests/test_conv_tma.py's harness): the im2col box's walk with the traversal
strides is the emulation's model of the TMA unit (CUTLASS's reading of the driver's corners), which the GPU tests
check against torch's convolution.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import emulated
from optimizer_helpers import owned_tf32_plan
from test_conv_igemm import _tf32
from test_conv_tma import _counted, _launches, _with_tma, tma_ptxas_reports

import kernelfuse.codegen.conv_tma as conv_tma
from kernelfuse.capture import capture, capture_module
from kernelfuse.codegen import generate
from kernelfuse.codegen.conv_geometry import conv_shape
from kernelfuse.codegen.conv_igemm import carries_tma, dense_kernel
from kernelfuse.load import load_problem
from kernelfuse.plan.interpret import run_env, run_fused
from kernelfuse.rewrite import apply_rules


class Forms(torch.nn.Module):
    """One convolution of each new form (small: every tile ragged or two tiles on the emulation's two blocks), and
    two the TMA kernel does not take (a transposed one of stride 2, a grouped one), which keep the dense kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.dilated = torch.nn.Conv2d(32, 64, (3, 5), padding=(2, 1), dilation=(2, 3))
        self.strided = torch.nn.Conv2d(32, 64, 3, stride=(2, 3), padding=1)  # 21 x 40: neither divides; two tiles
        self.line = torch.nn.Conv1d(32, 64, 3, stride=3, dilation=2, padding=1)  # 1-d, strided and dilated
        self.line_t = torch.nn.ConvTranspose1d(32, 64, 5, padding=3, dilation=2)  # 1-d transposed, padding 5 below
        self.plane_t = torch.nn.ConvTranspose2d(32, 32, (3, 4), padding=(1, 2))  # 32 output channels: TBN 32
        self.out_pad = torch.nn.ConvTranspose2d(32, 64, 3, dilation=2, output_padding=1)  # upper corner + 1
        self.up = torch.nn.ConvTranspose2d(32, 64, 3, stride=2)
        self.grouped = torch.nn.Conv2d(64, 64, 3, groups=2)

    def forward(self, a, b, c, d, e, f, g, h):
        return (torch.relu(self.dilated(a)), self.strided(b) * 0.5, torch.tanh(self.line(c)), self.line_t(d) + 1.0,
                torch.sigmoid(self.plane_t(e)), self.out_pad(f), self.up(g), self.grouped(h))


INPUTS = [(2, 32, 9, 14), (2, 32, 21, 40), (2, 32, 200), (1, 32, 150), (1, 32, 9, 17), (1, 32, 7, 9), (1, 32, 5, 5),
          (1, 64, 7, 7)]
TAKES_TMA = [True] * 6 + [False, False]
# each convolution's TMA geometry: (H, W, R, S, P, Q, lower, upper, dilation, stride, flip), and its channel tile
GEOMETRY = [
    ((9, 14, 3, 5, 9, 4, (-2, -1), (-2, -11), (2, 3), (1, 1), False), 64),
    ((21, 40, 3, 3, 11, 14, (-1, -1), (-1, -1), (1, 1), (2, 3), False), 64),
    ((1, 200, 1, 3, 1, 66, (0, -1), (0, -3), (1, 2), (1, 3), False), 64),
    ((1, 150, 1, 5, 1, 152, (0, -5), (0, -3), (1, 2), (1, 1), True), 64),
    ((9, 17, 3, 4, 9, 16, (-1, -1), (-1, -2), (1, 1), (1, 1), True), 32),
    ((7, 9, 3, 3, 12, 14, (-4, -4), (1, 1), (2, 2), (1, 1), True), 64),
]


@pytest.fixture(scope="module")
def model_and_graph():
    torch.manual_seed(0)
    model = Forms().eval()
    inputs = [torch.rand(s) for s in INPUTS]
    return model, inputs, capture_module(model, inputs)


def test_forms_take_the_tma_kernel_where_it_supports_them(model_and_graph, monkeypatch):
    """With TMA_MIN_TILES lowered: the six new forms carry the TMA kernel with the geometry TmaConv gives (corners,
    dilation, traversal strides, reversed taps for the transposed ones, a 32-wide tile for 32 output channels), the
    transposed convolution of stride 2 and the grouped one keep the dense kernel; a 1-d convolution's binding views
    its input (N, C, 1, L)."""
    _, _, graph = model_and_graph
    _with_tma(monkeypatch)
    plan = owned_tf32_plan(graph)
    assert [dense_kernel(plan.graph, s) for s in plan.fused] == [True] * 8
    assert [carries_tma(plan.graph, s) for s in plan.fused] == TAKES_TMA
    for step, (geometry, bn) in zip(plan.fused, GEOMETRY, strict=False):
        shape = conv_shape(plan.graph, step)
        g = conv_tma.tma_conv(shape)
        assert (g.h, g.w, g.r, g.s, g.p, g.q, g.lower, g.upper, g.dilation, g.stride, g.flip) == geometry, step.kernel
        assert conv_tma.tma_tile(shape)[0] == bn
        assert (g.p, g.q) == ((1,) * (2 - len(shape.out_size)) + shape.out_size)
    sources = generate(plan)
    k = plan.fused[2].kernel  # the 1-d one
    method = sources.binding.split(f"def {k}(")[1].split("\n    def ")[0]
    assert "self._conv_tma_input(x.unsqueeze(2) if x.dim() == 3 else x," in method, method
    assert f'_check_dense(x, "{k} input", (2, 32, 1, 200), torch.float32, fmt)' in method, method
    assert sources.cuda.count("_kernel_tma<<<") == 6
    assert "((KT / CB - 1 - rs) * CB + cb) * 32" in sources.cuda  # the transposed ones' reversed taps


def test_gate_refuses_what_the_map_cannot_hold():
    """tma_shape: traversal strides up to 8 and corners in [-128, 127] (a 4-d im2col map's), 32 input and output
    channels a multiple, no groups, no transposed stride; enough tiles."""
    def shape(**kw):
        base = dict(batch=256, cin=32, cout=64, groups=1, in_size=(64, 64), out_size=(64, 64), kernel=(3, 3),
                    stride=(1, 1), padding=(1, 1), dilation=(1, 1), transposed=False)
        return conv_tma.ConvShape(**{**base, **kw})
    assert conv_tma.tma_shape(shape())
    assert conv_tma.tma_shape(shape(cout=96)) and conv_tma.tma_tile(shape(cout=96))[0] == 32
    assert not conv_tma.tma_shape(shape(cout=48)) and not conv_tma.tma_shape(shape(cin=48))
    assert not conv_tma.tma_shape(shape(groups=2))
    assert conv_tma.tma_shape(shape(stride=(8, 1), out_size=(8, 64)))
    assert not conv_tma.tma_shape(shape(stride=(9, 1), out_size=(8, 64)))
    assert conv_tma.tma_shape(shape(padding=(1, 127), out_size=(64, 316)))  # lower corner -127
    assert not conv_tma.tma_shape(shape(padding=(1, 129), out_size=(64, 320)))
    assert not conv_tma.tma_shape(shape(dilation=(1, 70), padding=(1, 0), out_size=(64, 1)))  # upper -140
    assert conv_tma.tma_shape(shape(transposed=True))
    assert not conv_tma.tma_shape(shape(transposed=True, stride=(2, 2), out_size=(127, 127)))
    assert not conv_tma.tma_shape(shape(batch=1, in_size=(8, 8), out_size=(8, 8)))  # 1 tile
    assert not conv_tma.tma_shape(shape(kernel=(3, 3, 3), in_size=(8, 8, 8), out_size=(8, 8, 8), stride=(1, 1, 1),
                                        padding=(1, 1, 1), dilation=(1, 1, 1)))  # 3-d


@pytest.mark.parametrize("round_tf32", [True, False])
def test_emulated_forms_match_float64_on_tf32_operands(model_and_graph, tmp_path, monkeypatch, round_tf32):
    """Every convolution through its binding: the TMA kernel for the six forms (the pre-rounded form on the
    binding's rounding copy of the NCHW input, the rounding one on a channels-last input), the dense kernel for
    the others; each against float64 on the operands rounded to nearest TF32 (truncated where round_tf32 is off).
    Truncating, the six run the dense kernel too with the loader's switch off (its binding's fallback)."""
    model, inputs, graph = model_and_graph
    _with_tma(monkeypatch, round_tf32)
    plan = owned_tf32_plan(graph)
    emu = emulated(plan, tmp_path)
    state = {k: v.detach().double() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    env = run_env(plan, state, [t.double() for t in inputs])
    emu.kernels._allow_wgmma(True)
    for step, tma in zip(plan.fused, TAKES_TMA, strict=True):
        node = step.anchor.node
        x, w = env[node.args[0].name].float(), env[node.args[1].name].float()
        b = env[node.args[2].name].float() if node.args[2] is not None else None
        operands = [env[o.ref.name].float() for o in step.epilogue.operands]
        ref_env = dict(env)
        ref_env[node.args[0].name] = _tf32(x, round_tf32).double()
        ref_env[node.args[1].name] = _tf32(w, round_tf32).double()
        ref = run_fused(plan.graph, step, ref_env)
        # an NCHW input (the binding's copy), then where the TMA kernel runs a channels-last one (no copy)
        last = x.unsqueeze(2) if x.dim() == 3 else x
        inputs_of = [x, last.contiguous(memory_format=torch.channels_last).squeeze(2) if x.dim() == 3 else
                     last.contiguous(memory_format=torch.channels_last)] if tma else [x]
        for x_in, expected in zip(inputs_of, [(1, int(round_tf32)), (1, 0)], strict=False):
            before = _launches(emu.lib)
            out = getattr(emu.kernels, step.kernel)(x_in, w, b, *operands)
            assert _counted(emu.lib, before) == (expected if tma else (0, 0)), step.kernel
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"{step.kernel}: {m}")  # noqa: B023
        if tma and not round_tf32:  # the switch off (no sm_90a): the dense kernel, on the same (N, C, 1, L) view
            emu.kernels._allow_wgmma(False)
            before = _launches(emu.lib)
            out = getattr(emu.kernels, step.kernel)(x, w, b, *operands)
            assert _counted(emu.lib, before) == (0, 0), step.kernel
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            emu.kernels._allow_wgmma(True)


def test_new_forms_compile_for_sm_90a_without_spills(model_and_graph, tmp_path, monkeypatch):
    """ptxas (sm_90a) takes every TMA kernel of the new forms, both rounding forms, without spills; the 32-wide
    tile's products are m64n32 wgmma. The file builds for sm_80 too."""
    import re
    import subprocess

    from test_nvcc_compile import _nvcc

    nvcc = _nvcc()
    _with_tma(monkeypatch)
    plan = owned_tf32_plan(model_and_graph[2])
    cu = tmp_path / "forms.cu"
    cu.write_text(generate(plan).cuda)
    tma_ptxas_reports(nvcc, cu, tmp_path, kernels=12)
    ptx = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-ptx", str(cu), "-o", "-"], capture_output=True,
                         text=True, timeout=600).stdout
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k8\.f32\.tf32\.tf32", ptx)) >= {"32", "64"}
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-O3", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]  # (the TMA kernels' bodies are traps there)


LEVEL1 = Path(__file__).resolve().parents[1].parent / "shared" / "kernelbench" / "level1"
# the dev level-1 convolutions the TMA kernel takes: (TBN, reversed taps, traversal strides, dilation)
LEVEL1_TMA = {"64": (128, True, (1, 1), (1, 1)), "74": (64, True, (1, 1), (1, 3)), "76": (128, False, (1, 3), (1, 4)),
              "78": (32, True, (1, 1), (1, 1)), "80": (64, False, (1, 1), (2, 3)), "56": (128, False, (1, 1), (1, 1))}


@pytest.mark.parametrize("number", sorted(LEVEL1_TMA))
def test_level1_convolutions_take_the_tma_kernel(number):
    """Measured TF32 (as eager's cuDNN call on an H200), each of these level-1 convolutions plans the dense kernel
    and carries its TMA form, at its default TMA_MIN_TILES: the plan and binding decision, no GPU needed."""
    paths = sorted(LEVEL1.glob(f"{number}_*.py")) if LEVEL1.is_dir() else []
    if not paths:
        pytest.skip(f"the dev split is not at {LEVEL1}")
    graph = apply_rules(capture(load_problem(paths[0]))).graph
    plan = owned_tf32_plan(graph)
    (step,) = [s for s in plan.fused if s.anchor.family == "conv"]
    assert dense_kernel(plan.graph, step) and carries_tma(plan.graph, step), plan.summary()
    shape = conv_shape(plan.graph, step)
    g = conv_tma.tma_conv(shape)
    assert (conv_tma.tma_tile(shape)[0], g.flip, g.stride, g.dilation) == LEVEL1_TMA[number]
    assert f"self._{step.kernel}_tma_prerounded" in generate(plan).binding


class GpuForms(torch.nn.Module):
    """The new forms at sizes past TMA_MIN_TILES (the default plan carries the TMA kernel for each)."""

    def __init__(self) -> None:
        super().__init__()
        self.dilated = torch.nn.Conv2d(32, 64, (5, 9), padding=(2, 4), dilation=(2, 3))  # level-1 80's
        self.strided = torch.nn.Conv2d(64, 128, 3, stride=(2, 3), padding=1)
        self.line = torch.nn.Conv1d(64, 128, 3, stride=3, dilation=4)  # level-1 76's
        self.line_t = torch.nn.ConvTranspose1d(32, 64, 5, dilation=3, padding=2)
        self.plane_t = torch.nn.ConvTranspose2d(32, 32, (3, 7), padding=(1, 3))  # level-1 78's
        self.out_pad = torch.nn.ConvTranspose2d(64, 128, 3, dilation=2, output_padding=1)

    def forward(self, a, b, c, d, e, f):
        return (F.relu(self.dilated(a)), self.strided(b), torch.tanh(self.line(c)), self.line_t(d),
                self.plane_t(e) * 0.5, self.out_pad(f))


@pytest.mark.gpu
def test_new_forms_run_and_match_float64_on_hopper() -> None:
    """On an H100/H200 the TF32 plan (as eager's cuDNN calls measure on an H200) carries the TMA kernel for each
    convolution of GpuForms, each runs it (the launch counters: pre-rounded launches only, from the forward's NCHW
    inputs) and every output matches float64 on the operands rounded to nearest TF32 (eager's own arithmetic may be
    TF32 or not: the judge's rule against it is the optimizer's question) and torch's convolutions within TF32's
    error; each kernel called on a channels-last input runs the rounding form and agrees with the pre-rounded one."""
    from kernelfuse.emit.module import build_module, load_kernels

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA form runs on compute capability 9.0")
    torch.manual_seed(0)
    model = GpuForms().cuda().eval()
    inputs = [torch.rand(8, 32, 128, 128, device="cuda"), torch.rand(16, 64, 192, 300, device="cuda"),
              torch.rand(16, 64, 30000, device="cuda"), torch.rand(8, 32, 20000, device="cuda"),
              torch.rand(4, 32, 128, 256, device="cuda"), torch.rand(16, 64, 90, 90, device="cuda")]
    plan = owned_tf32_plan(capture_module(model, inputs))
    tma = [s.kernel for s in plan.fused if carries_tma(plan.graph, s)]
    assert len(tma) == 6, plan.summary()
    sources = generate(plan)
    fused = build_module(model, plan, sources)
    with torch.no_grad():
        ours, eager = fused(*inputs), model(*inputs)
        reference = GpuForms().cuda().double().eval()
        reference.load_state_dict({k: _tf32(v) if k.endswith("weight") else v for k, v in model.state_dict().items()})
        expected = reference(*[_tf32(t).double() for t in inputs])
    for i, (o, r, e) in enumerate(zip(ours, expected, eager, strict=True)):
        assert o.shape == r.shape == e.shape and not o.isnan().any(), i
        err, scale = (o.double() - r).abs().max().item(), r.abs().max().item()
        assert err <= 1e-4 * max(scale, 1.0), (i, err, scale)
        off = (o - e).abs().max().item()  # torch's convolution, TF32 or not: within TF32's error of it
        assert off <= 5e-3 * max(scale, 1.0), (i, off, scale)
    kernels = load_kernels(sources, type(model).__name__.lower())  # the same library: its launch counters
    total, prerounded = _launches(kernels._lib)
    assert total >= 6 and prerounded == total, (total, prerounded)
    state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    with torch.no_grad():
        env = run_env(plan, state, inputs)
        for step in plan.fused:
            node = step.anchor.node
            x, w = env[node.args[0].name], env[node.args[1].name]
            b = env[node.args[2].name] if node.args[2] is not None else None
            operands = [env[o.ref.name] for o in step.epilogue.operands]
            pre = getattr(kernels, step.kernel)(x, w, b, *operands)
            last = (x.unsqueeze(2) if x.dim() == 3 else x).contiguous(memory_format=torch.channels_last)
            before = _launches(kernels._lib)
            rounding = getattr(kernels, step.kernel)(last.squeeze(2) if x.dim() == 3 else last, w, b, *operands)
            assert _counted(kernels._lib, before) == (1, 0), step.kernel
            torch.testing.assert_close(rounding, pre, atol=1e-5, rtol=1e-5)

class Line(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(32, 64, 3)
        self.plane = torch.nn.Conv2d(64, 64, 3)

    def forward(self, x):
        return self.plane(self.conv(x).unsqueeze(2).expand(-1, -1, 4, -1))


def test_layout_timing_measures_1d_convolutions_nchw_only():
    """kernelfuse.bench.layout times a 1-d convolution NCHW only (its choice NCHW, no channels-last call) for the
    TF32 question: measured, the owned-anchor plan may give it the TMA kernel."""
    from kernelfuse.bench.layout import LayoutTiming, _conv1d

    graph = capture_module(Line().eval(), [torch.rand(2, 32, 20)])
    convs = [n for n in graph.nodes if n.op == "convolution.default"]
    assert [_conv1d(graph, n) for n in convs] == [True, False]
    timing = LayoutTiming(convs[0].name, 1.0, float("inf"))
    assert timing.choice == "nchw" and "1-d: no channels-last" in timing.describe() and "TF32" in timing.describe()
    assert "full fp32" in LayoutTiming(convs[0].name, 1.0, float("inf"), True).describe()


@pytest.mark.gpu
def test_layout_timing_measures_a_1d_convolution_on_the_gpu() -> None:
    """On a GPU both convolutions of Line are measured: the 1-d one NCHW only."""
    from kernelfuse.bench.layout import measure_conv_layouts

    graph = capture_module(Line().cuda().eval(), [torch.rand(2, 32, 20, device="cuda")])
    timings = measure_conv_layouts(graph)
    assert timings is not None and len(timings) == 2
    assert timings[0].nhwc_ms == float("inf") and timings[0].choice == "nchw" and timings[1].nhwc_ms < float("inf")
