"""The dense convolution's TMA im2col form (kernelfuse.codegen.conv_tma), a Hopper branch of the dense anchor.

On the CPU (tests/emulation_helpers.py) the kernel text runs with its producer thread's copies done at once as the
TMA unit would write them (the im2col box's walk, padding's zero fill, the 128-byte swizzle), mbarriers as
counters with the hardware's phase rules, the rounding warps' pass over each slot's weight tile, and kf_wg's
emulated wgmma (A from the consumers' rounded register fragments by emulated shuffles, or by descriptor where the
form truncates or reads the binding's copy rounded to nearest TF32): the ring's slots and phases across a block's
several tiles, the descriptors' offsets, the fragments' layout and rounding, the rounding copy, the accumulator's
way to the shared epilogue code and both output layouts are checked against float64 on the operands rounded to
nearest TF32 (truncated for round_tf32 off). What the real TMA unit does with the corners and offsets is the
emulation's model of it: the GPU test checks it.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import emulated
from optimizer_helpers import owned_tf32_plan
from test_conv_igemm import _tf32

import kernelfuse.codegen.conv_igemm as conv_igemm
import kernelfuse.codegen.conv_tma as conv_tma
import kernelfuse.codegen.cuda as codegen_cuda
from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.codegen.binding import _KernelLibrary
from kernelfuse.codegen.conv_geometry import conv_shape
from kernelfuse.codegen.conv_igemm import carries_tma, dense_kernel
from kernelfuse.plan.interpret import run_env, run_fused


class TmaConvs(torch.nn.Module):
    """Five convolutions the TMA form takes (epilogues of the dense tests' kind; stride 2 and dilation 2 since the
    TMA kernel's strides and dilation, tests/test_conv_tma_forms.py has the other new forms) and one it leaves to
    the general kernel (48 input channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = torch.nn.Conv2d(32, 64, 3)  # no padding; 198 pixels: one part-filled tile
        self.padded = torch.nn.Conv2d(64, 128, 3, padding=1)  # 672 pixels: three tiles on two blocks
        self.oblong = torch.nn.Conv2d(32, 64, (3, 2), padding=(1, 0))  # R != S, padding in H only
        self.strided = torch.nn.Conv2d(64, 64, 3, stride=2, padding=1)
        self.dilated = torch.nn.Conv2d(32, 64, 3, dilation=2)
        self.odd = torch.nn.Conv2d(48, 64, 3)

    def forward(self, a, b, c, d, e, f):
        return (F.mish(F.mish(self.plain(a))), torch.relu(self.padded(b)) * 0.5, torch.tanh(self.oblong(c)),
                self.strided(d) + 1.0, torch.sigmoid(self.dilated(e)), self.odd(f))


INPUTS = [(2, 32, 13, 11), (4, 64, 14, 12), (2, 32, 9, 20), (1, 64, 9, 9), (1, 32, 12, 11), (1, 48, 7, 6)]
TAKES_TMA = [True, True, True, True, True, False]


def _with_tma(monkeypatch, round_tf32: bool = True) -> None:
    """The small convolutions here carry the TMA form, as dense_config gives it to large ones (their tiles fill
    the GPU: conv_tma.TMA_MIN_TILES); its operands truncated where not `round_tf32`."""
    monkeypatch.setattr(conv_tma, "TMA_MIN_TILES", 1)
    if not round_tf32:
        base = conv_igemm.dense_config
        monkeypatch.setattr(conv_igemm, "dense_config", lambda s: replace(base(s), round_tf32=False))


def _with_out_layout(monkeypatch, layout: str) -> None:
    render = conv_igemm.render_conv
    monkeypatch.setattr(codegen_cuda, "render_conv", lambda plan, step: render(plan, step, layout))


@pytest.fixture(scope="module")
def model_and_graph():
    torch.manual_seed(0)
    model = TmaConvs().eval()
    inputs = [torch.rand(s) for s in INPUTS]
    return model, inputs, capture_module(model, inputs)


def _launches(lib) -> tuple[int, int]:
    """(TMA kernel launches, those of them of the pre-rounded form)."""
    lib.kf_conv_tma_launches.restype = ctypes.c_longlong
    lib.kf_conv_tma_prerounded_launches.restype = ctypes.c_longlong
    return lib.kf_conv_tma_launches(), lib.kf_conv_tma_prerounded_launches()


def _counted(lib, before: tuple[int, int]) -> tuple[int, int]:
    """The launches (_launches) since `before`."""
    now = _launches(lib)
    return now[0] - before[0], now[1] - before[1]


def _launcher(source: str, name: str) -> str:
    """The text of launcher `name` (up to the next exported function)."""
    return source.split(f"KF_EXPORT cudaError_t {name}(")[1].split("KF_EXPORT")[0]


def test_tma_form_only_where_it_applies(model_and_graph, monkeypatch):
    """Carried where tma_shape holds: by default not at these sizes (fewer tiles than TMA_MIN_TILES), and with that
    limit lowered for the five with 32-multiple channels (stride 2 and dilation 2 too), not for 48 channels; rounding
    or not; nothing where DenseConfig.tma is off. The TMA kernel has its own launchers ({k}_launch_tma, and where it
    rounds {k}_launch_tma_prerounded beside the copy that rounds, kf_nchw_to_nhwc_float32_rna), which the binding
    chooses from with a channels-last input; the dense kernel's ({k}_launch) never launches either."""
    _, _, graph = model_and_graph
    plan = owned_tf32_plan(graph)
    assert not any(carries_tma(plan.graph, s) for s in plan.fused) and "_kernel_tma" not in generate(plan).cuda
    _with_tma(monkeypatch)
    assert [carries_tma(plan.graph, s) for s in plan.fused] == TAKES_TMA
    assert [dense_kernel(plan.graph, s) for s in plan.fused] == [True] * 5 + [False]
    sources = generate(plan)
    source = sources.cuda
    assert source.count("_kernel_tma<<<") == 5 and source.count("KF_EXPORT long long kf_conv_tma_launches") == 1
    assert source.count("_kernel_tma_prerounded<<<") == 5 and source.count("kf_tma::rounded_fragments(frag") == 5
    assert source.count("KF_EXPORT int kf_conv_tma_ready") == 1
    assert source.count("KF_EXPORT cudaError_t kf_nchw_to_nhwc_float32_rna(") == 1
    assert 'self._to_nhwc_tf32 = {torch.float32: self._function("kf_nchw_to_nhwc_float32_rna"' in sources.binding
    for step, tma in zip(plan.fused, TAKES_TMA, strict=True):
        k = step.kernel
        assert "_kernel_tma" not in _launcher(source, f"{k}_launch")
        assert (f"{k}_launch_tma(" in source) == tma and (f"{k}_launch_tma_prerounded(" in source) == tma
        if tma:
            assert f"{k}_kernel_tma_prerounded<<<" in _launcher(source, f"{k}_launch_tma_prerounded")
            assert "kf_conv_tma_prerounded_count" not in _launcher(source, f"{k}_launch_tma")
        method = sources.binding.split(f"def {k}(")[1].split("\n    def ")[0]
        assert (f"self._conv_tma_input(x, torch.contiguous_format, self._{k}, self._{k}_tma, "
                f"self._{k}_tma_prerounded)" in method) == tma, method
        assert ("self._launch(launcher," in method) == tma, method
        assert (f'if launcher is not self._{k}:\n            w = self._tf32_weight(w, "{k}")' in method) == tma, method
    assert "kf_tma::rounded_fragments" in source and "kf_tma::round_in_place" not in source  # B: the binding's
    # the pre-rounded form is the truncating form's text (A and B by descriptor), under its own name
    step = plan.fused[1]
    shape = conv_shape(plan.graph, step)
    texts = {form: conv_tma.render_dense_tma(step.kernel, shape, form, "", "") for form in conv_tma.TMA_FORMS}
    assert texts["prerounded"].replace("_tma_prerounded", "_tma") == texts["truncating"] != texts["rounding"]
    _with_tma(monkeypatch, round_tf32=False)
    assert [carries_tma(plan.graph, s) for s in plan.fused] == TAKES_TMA
    sources = generate(plan)
    source = sources.cuda
    assert "kf_tma::rounded_fragments" not in source and "kf_tma::round_in_place" not in source
    assert "_kernel_tma_prerounded" not in source and "kf_nchw_to_nhwc_float32_rna" not in source
    assert "self._to_nhwc_tf32 = {}" in sources.binding
    k = plan.fused[0].kernel
    assert f"self._conv_tma_input(x, torch.contiguous_format, self._{k}, self._{k}_tma)" in sources.binding
    assert "_tf32_weight" not in sources.binding  # a truncating file reads the weight as it is
    base = conv_igemm.dense_config
    monkeypatch.setattr(conv_igemm, "dense_config", lambda s: replace(base(s), tma=False))
    assert not any(carries_tma(plan.graph, s) for s in plan.fused)


@pytest.mark.parametrize(("layout", "round_tf32"), [("nchw", True), ("nhwc", True), ("nchw", False)])
def test_emulated_tma_form_matches_float64_on_tf32_operands(model_and_graph, tmp_path, monkeypatch, layout,
                                                            round_tf32):
    """Every convolution through its binding with the loader's switch on: the TMA kernel runs for exactly the five
    it applies to, the other takes its old kernel. An NCHW input: the binding's copy makes it channels-last,
    rounded to nearest TF32 where the form rounds, for the pre-rounded form (A read as it is); a channels-last
    input: no copy, the rounding form (A rounded in registers), or the truncating one. All match float64 on the
    operands rounded to nearest TF32 (truncated for round_tf32 off), within 2e-5 (either operand left unrounded:
    5e-4 off), both forms alike. With the switch off the dense kernel runs for the five, on the NCHW input, and
    matches too."""
    model, inputs, graph = model_and_graph
    _with_tma(monkeypatch, round_tf32)
    _with_out_layout(monkeypatch, layout)
    plan = owned_tf32_plan(graph)
    emu = emulated(plan, tmp_path)
    state = {k: v.detach().double() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    env = run_env(plan, state, [t.double() for t in inputs])
    for on in (True, False):
        emu.kernels._allow_wgmma(on)
        for step, tma in zip(plan.fused, TAKES_TMA, strict=True):
            node = step.anchor.node
            x, w = env[node.args[0].name].float(), env[node.args[1].name].float()
            b = env[node.args[2].name].float() if node.args[2] is not None else None
            operands = [env[o.ref.name].float() for o in step.epilogue.operands]
            ref_env = dict(env)
            exact = not dense_kernel(plan.graph, step)  # the general kernel: 3xTF32 or rounding, fp32-close
            ref_env[node.args[0].name] = (x if exact else _tf32(x, round_tf32)).double()
            ref_env[node.args[1].name] = (w if exact else _tf32(w, round_tf32)).double()
            ref = run_fused(plan.graph, step, ref_env)
            tol = 2e-3 if exact else 2e-5
            # an NCHW input (the binding's copy), then where the TMA kernel runs a channels-last one (none)
            inputs_of = [x, x.contiguous(memory_format=torch.channels_last)] if tma and on else [x]
            for x_in, expected in zip(inputs_of, [(1, int(round_tf32)), (1, 0)], strict=False):
                before = _launches(emu.lib)
                out = getattr(emu.kernels, step.kernel)(x_in, w, b, *operands)
                assert _counted(emu.lib, before) == (expected if tma and on else (0, 0)), (step.kernel, on)
                if layout == "nhwc" and out.dim() == 4:
                    assert out.is_contiguous(memory_format=torch.channels_last)
                torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol,
                                           msg=lambda m: f"{step.kernel} on={on}: {m}")  # noqa: B023


class OneConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(32, 64, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))


# fp32 bit patterns and what cvt.rna.tf32.f32 makes of them (ptxas's SASS: the half ulp 0x1000 added where finite,
# then the low 13 bits cleared from every value): ties away from zero, the top of the range to infinity, NaNs
# keep their sign and high payload bits
RNA_CASES = [
    (0x3F800000, 0x3F800000),  # 1.0: exact
    (0x3F800FFF, 0x3F800000),  # below the tie: down
    (0x3F801000, 0x3F802000),  # a tie: away from zero (to even would keep 0x3f800000)
    (0x3F803000, 0x3F804000),  # a tie from an odd last bit: away (as to even)
    (0x3F801FFF, 0x3F802000),  # above the tie: up
    (0xBF801000, 0xBF802000),  # a negative tie: away from zero
    (0xBF800FFF, 0xBF800000),
    (0x3FFFF000, 0x40000000),  # the carry into the exponent
    (0x00000000, 0x00000000), (0x80000000, 0x80000000),  # zeros
    (0x00000FFF, 0x00000000), (0x00001000, 0x00002000), (0x807FF000, 0x80800000),  # subnormals, to the normals
    (0x7F7FE000, 0x7F7FE000),  # the largest TF32 value
    (0x7F7FEFFF, 0x7F7FE000),  # below its tie with infinity
    (0x7F7FF000, 0x7F800000),  # the tie: infinity
    (0x7F7FFFFF, 0x7F800000),  # the largest fp32 value: infinity
    (0xFF7FFFFF, 0xFF800000),  # ... and its negative
    (0x7F800000, 0x7F800000), (0xFF800000, 0xFF800000),  # infinities pass
    (0x7FC00000, 0x7FC00000), (0xFFC00000, 0xFFC00000),  # quiet NaNs pass
    (0x7FC01234, 0x7FC00000),  # a NaN's low payload bits cleared
    (0x7F800001, 0x7F800000),  # a NaN whose payload is all low bits: an infinity
]


def _signed(bits: int) -> int:
    """A 32-bit pattern as torch.int32 holds it."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


@pytest.mark.parametrize("shape", [(2, 8, 4, 7), (1, 40, 9, 8), (2, 6, 3, 3)], ids=["v4", "v4-tiles", "scalar"])
def test_emulated_rounding_copy_rounds_to_nearest_tf32(tmp_path, monkeypatch, shape):
    """`to_channels_last(x, round_tf32=True)`, the copy that feeds the pre-rounded form, against the torch
    reference of cvt.rna (test_conv_igemm._tf32) bit for bit, in its 16-byte form (channels and plane multiples of
    4, one block or several) and its scalar one: ties, negatives, zeros and subnormals, the top of the range
    (RNA_CASES) and random values, with ties made often. The plain copy keeps every bit (NaN payloads too)."""
    _with_tma(monkeypatch)
    plan = owned_tf32_plan(capture_module(OneConv().eval(), [torch.rand(1, 32, 5, 5)]))
    assert carries_tma(plan.graph, plan.fused[0])
    emu = emulated(plan, tmp_path)
    torch.manual_seed(1)
    bits = torch.randn(shape).view(torch.int32)
    bits = torch.where(torch.rand(shape) < 0.25, (bits & ~0x1FFF) | 0x1000, bits).flatten()  # ties
    cases = torch.tensor([_signed(c) for c, _ in RNA_CASES], dtype=torch.int32)
    bits[:len(cases)] = cases
    x = bits.view(shape).view(torch.float32)
    rounded = emu.kernels.to_channels_last(x, round_tf32=True)
    plain = emu.kernels.to_channels_last(x)
    for y in (rounded, plain):
        assert y.shape == x.shape and y.is_contiguous(memory_format=torch.channels_last)
    got = rounded.contiguous().view(torch.int32).flatten()
    assert got[:len(cases)].tolist() == [_signed(e) for _, e in RNA_CASES]
    assert torch.equal(got, _tf32(x).view(torch.int32).flatten())
    assert torch.equal(plain.contiguous().view(torch.int32), x.view(torch.int32))
    with pytest.raises(ValueError, match=r"to_channels_last\(round_tf32=True\) needs"):
        emu.kernels.to_channels_last(x.double(), round_tf32=True)


class _Library(_KernelLibrary):
    """The binding's run-time helpers over no library: kf_conv_tma_ready answers `ready`."""

    def __init__(self, ready: bool) -> None:
        self._tma_ready, self._tf32_weights = {}, {}
        self._lib = type("Lib", (), {"kf_conv_tma_ready": staticmethod(lambda: int(ready))})()


class _CopyingLibrary(_Library):
    """... with the file's copy kernels (`rounding`: the one rounding to nearest TF32 too) as torch's copies, each
    counted, a rounded one's result remembered."""

    def __init__(self, ready: bool, rounding: bool = True) -> None:
        super().__init__(ready)
        self._to_nhwc = {torch.float32: None}
        self._to_nhwc_tf32 = {torch.float32: None} if rounding else {}
        self.copies: list[bool] = []
        self.rounded: list[torch.Tensor] = []

    @staticmethod
    def _on_device(t: torch.Tensor) -> bool:
        return True

    def to_channels_last(self, x: torch.Tensor, round_tf32: bool = False) -> torch.Tensor:
        self.copies.append(round_tf32)
        y = x.contiguous(memory_format=torch.channels_last)
        if round_tf32:
            y = _tf32(y).contiguous(memory_format=torch.channels_last)
            self.rounded.append(y)
        return y


# the launchers _conv_tma_input chooses from, as the binding passes them
LAUNCHERS = ("dense", "tma", "prerounded")


def test_binding_gives_each_kernel_its_layout() -> None:
    """_conv_tma_input: channels-last and 16-byte aligned where the TMA kernel runs (a copy only where the input is
    not so: an aligned channels-last input passes as it is, one off the 16-byte grain is copied), else the dense
    kernel's layout; the answer asked once a device."""
    nchw = torch.rand(2, 32, 5, 6)
    cl = nchw.contiguous(memory_format=torch.channels_last)
    flat = torch.empty(cl.numel() + 1)
    flat[1:].copy_(cl.permute(0, 2, 3, 1).reshape(-1))
    off_grain = flat[1:].view(2, 5, 6, 32).permute(0, 3, 1, 2)  # channels-last, 4 bytes past the grain
    assert off_grain.is_contiguous(memory_format=torch.channels_last) and off_grain.data_ptr() % 16
    tma = _Library(True)
    for x in (nchw, cl, off_grain):
        got, fmt, launcher = tma._conv_tma_input(x, torch.contiguous_format, *LAUNCHERS)
        assert launcher == "tma" and fmt is torch.channels_last and got.is_contiguous(memory_format=fmt)
        assert got.data_ptr() % 16 == 0 and torch.equal(got, nchw)
        assert (got.data_ptr() == x.data_ptr()) == (x is cl)
    assert tma._tma_ready == {-1: True}
    dense = _Library(False)
    for other in (torch.contiguous_format, torch.channels_last):
        got, fmt, launcher = dense._conv_tma_input(cl, other, *LAUNCHERS)
        assert launcher == "dense" and fmt is other and got.is_contiguous(memory_format=other)
        assert torch.equal(got, nchw)
    assert dense._conv_tma_input(nchw[0], torch.contiguous_format, *LAUNCHERS)[2] == "dense"  # 3-d: as it is


def test_binding_runs_the_prerounded_form_only_on_its_rounding_copy() -> None:
    """Where the TMA kernel runs: a contiguous NCHW fp32 input goes through the file's copy rounded to nearest
    TF32 and the pre-rounded form; every other input to the form that takes it as it is (rounding A in registers,
    or truncating): a channels-last input (no copy), an input the copy kernel does not take (torch's copy, which
    does not round), any input where the file has no pre-rounded form (a truncating file: the plain copy) or no
    rounding copy. The pre-rounded launcher never sees an input the rounding copy did not make."""
    nchw = torch.rand(2, 32, 5, 6) * 3
    cl = nchw.contiguous(memory_format=torch.channels_last)
    strided = torch.rand(2, 32, 5, 12)[..., ::2]  # neither NCHW- nor channels-last-dense: torch's copy
    cases = [  # (library, input, prerounded launcher passed, launcher chosen, the copies made: rounded or not)
        (_CopyingLibrary(True), nchw, True, "prerounded", [True]),
        (_CopyingLibrary(True), cl, True, "tma", []),
        (_CopyingLibrary(True), strided, True, "tma", []),
        (_CopyingLibrary(True), nchw, False, "tma", [False]),  # a truncating file
        (_CopyingLibrary(True, rounding=False), nchw, True, "tma", [False]),
        (_CopyingLibrary(False), nchw, True, "dense", []),
    ]
    for i, (lib, x, has_prerounded, launcher, copies) in enumerate(cases):
        launchers = LAUNCHERS if has_prerounded else LAUNCHERS[:2]
        got, fmt, chosen = lib._conv_tma_input(x, torch.contiguous_format, *launchers)
        assert chosen == launcher and lib.copies == copies, (i, chosen, lib.copies)
        assert got.is_contiguous(memory_format=fmt) and got.data_ptr() % 16 == 0, i
        if chosen == "prerounded":
            assert lib.rounded and got is lib.rounded[-1] and torch.equal(got, _tf32(x)), i
        else:
            assert torch.equal(got, x), i


def test_binding_rounds_the_weight_once_a_version() -> None:
    """_tf32_weight: the weight the TMA forms read, rounded to nearest TF32 bit for bit as cvt.rna (RNA_CASES and
    random values with ties, against test_conv_igemm._tf32) in the tap-major strides it came in; cached per
    convolution: the same weight gives the same copy, an in-place update (w.add_) a new one, another weight (or
    the same one for another convolution) its own; the weight itself untouched. An inference tensor (no version
    counter) is rounded at every call, and so is any weight inside a CUDA graph capture (the graph's own copy)."""
    torch.manual_seed(2)
    bits = torch.randn(64, 3, 3, 32).view(torch.int32)
    bits = torch.where(torch.rand(bits.shape) < 0.25, (bits & ~0x1FFF) | 0x1000, bits).flatten()  # ties
    cases = torch.tensor([_signed(c) for c, _ in RNA_CASES], dtype=torch.int32)
    bits[:len(cases)] = cases
    w = bits.view(64, 3, 3, 32).view(torch.float32).permute(0, 3, 1, 2)  # tap-major (K, C, R, S)
    original = w.clone()
    lib = _Library(True)
    rounded = lib._tf32_weight(w, "k0")
    assert rounded.stride() == w.stride() and rounded.data_ptr() % 16 == 0
    got = rounded.permute(0, 2, 3, 1).reshape(-1).view(torch.int32)
    assert got[:len(cases)].tolist() == [_signed(e) for _, e in RNA_CASES]
    assert torch.equal(got, _tf32(w).permute(0, 2, 3, 1).reshape(-1).view(torch.int32))
    assert torch.equal(w.view(torch.int32), original.view(torch.int32))  # not rounded in place
    assert lib._tf32_weight(w, "k0") is rounded  # the same weight, the same version: the cached copy
    w = torch.randn(64, 3, 3, 32).permute(0, 3, 1, 2)
    first = lib._tf32_weight(w, "k0")
    assert first is not rounded and lib._tf32_weight(w, "k0") is first
    w.add_(1)  # in place: a new version
    second = lib._tf32_weight(w, "k0")
    assert second is not first and torch.equal(second, _tf32(w)) and not torch.equal(second, first)
    assert lib._tf32_weight(w, "k0") is second
    other = w.clone(memory_format=torch.preserve_format)  # the same values, another tensor
    assert lib._tf32_weight(other, "k0") is not second and torch.equal(lib._tf32_weight(other, "k0"), second)
    assert lib._tf32_weight(w, "k1") is not second  # each convolution its own entry
    with torch.inference_mode():
        frozen = torch.randn(64, 32, 3, 3)
    assert torch.equal(lib._tf32_weight(frozen, "k2"), _tf32(frozen)) and "k2" not in lib._tf32_weights
    lib._capturing = lambda t: True  # a CUDA graph capture: the graph's own copy, no cache
    assert torch.equal(lib._tf32_weight(w, "k3"), second) and lib._tf32_weight(w, "k3") is not second
    assert "k3" not in lib._tf32_weights


def tma_ptxas_reports(nvcc: str, cu: Path, tmp_path: Path, kernels: int) -> str:
    """ptxas -v (sm_90a) on `cu`: it builds, holds `kernels` TMA convolution kernels, none spilling and no wgmma
    serialized; the stderr (the reports) for further checks."""
    import re
    import subprocess

    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-O3", "-c", "-Xptxas", "-v", str(cu), "-o",
                             str(tmp_path / f"{cu.stem}.o")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [r for r in result.stderr.split("Compiling entry function") if "_kernel_tma" in r.split("\n")[0]]
    assert len(reports) == kernels, result.stderr[-3000:]
    for report in reports:
        assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", report), report
    assert "serialized" not in result.stderr
    return result.stderr


def test_tma_form_compiles_for_sm_90a_and_sm_80(model_and_graph, tmp_path, monkeypatch):
    """nvcc builds the file for sm_90a (the loader's Hopper target: ptxas takes the TMA kernels, every form,
    without spills or serialized products, the PTX holds the im2col copies, m64n64/m64n128 products, A from
    rounded registers in the two rounding kernels, by descriptor in their pre-rounded forms and in the truncating
    kernel, which round nothing; B by descriptor in all, no kernel writing the ring: no proxy fence) and for sm_80
    (the kernel body is a trap there)."""
    import re
    import subprocess

    from test_nvcc_compile import _nvcc

    nvcc = _nvcc()
    _with_tma(monkeypatch)
    base = conv_igemm.dense_config  # the oblong convolution truncates: both forms in one file
    monkeypatch.setattr(conv_igemm, "dense_config", lambda s: replace(base(s), round_tf32=s.kernel != (3, 2)))
    plan = owned_tf32_plan(model_and_graph[2])
    cu = tmp_path / "tma.cu"
    cu.write_text(generate(plan).cuda)
    tma_ptxas_reports(nvcc, cu, tmp_path, kernels=9)
    ptx = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-ptx", str(cu), "-o", "-"], capture_output=True,
                         text=True, timeout=600).stdout
    assert ptx.count("cp.async.bulk.tensor.4d.shared::cluster.global.im2col") >= 3  # (unrolled copies: more)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k8\.f32\.tf32\.tf32", ptx)) >= {"64", "128"}
    register_a = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k8\.f32\.tf32\.tf32\s*\{[^}]*\},\s*\{"
    forms = {m.group(1): ("cvt.rna.tf32.f32" in body, bool(re.search(register_a, body)))
             for body in ptx.split(".entry ")[1:] if (m := re.match(r"_Z\d+(k\d+_kernel_tma(_prerounded)?)", body))}
    assert forms == {"k0_kernel_tma": (True, True), "k1_kernel_tma": (True, True), "k2_kernel_tma": (False, False),
                     "k3_kernel_tma": (True, True), "k4_kernel_tma": (True, True),
                     "k0_kernel_tma_prerounded": (False, False), "k1_kernel_tma_prerounded": (False, False),
                     "k3_kernel_tma_prerounded": (False, False), "k4_kernel_tma_prerounded": (False, False)}, forms
    for body in ptx.split(".entry ")[1:]:  # no generic-proxy writes of the ring (B is rounded by the binding)
        assert "_kernel_tma" not in body.split("(")[0] or "fence.proxy.async" not in body, body.split("(")[0]
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-O3", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


class BigConvs(torch.nn.Module):
    """Level-2 54's convolution at a quarter of its batch (no padding, bias + mish(mish); 4033 tiles) and a padded
    128-channel one with a non-square kernel (277 tiles at batch 16): the TMA form on real sizes, as dense_config
    gives it (both past TMA_MIN_TILES)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(64, 64, 3)
        self.b = torch.nn.Conv2d(64, 128, (3, 5), padding=(1, 2))

    def forward(self, x, y):
        return F.mish(F.mish(self.a(x))), torch.relu(self.b(y))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tma_form_runs_and_matches_eager_on_hopper(monkeypatch, layout) -> None:
    """On an H100/H200 (the loader builds sm_90a) the default plan carries the rounding TMA form for both
    convolutions, each binding runs its pre-rounded form (the launch counters) on the copy of the forward's NCHW
    input it makes channels-last and rounds, and the outputs pass the judge's rule against eager and float64. Each
    kernel called on a channels-last input runs the rounding form (A rounded in registers) instead, and agrees."""
    from test_conv_igemm_gpu import _check
    from test_conv_igemm_gpu import _plan as _gpu_plan

    from kernelfuse.emit.module import build_module, load_kernels

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA form runs on compute capability 9.0")
    torch.manual_seed(0)
    model = BigConvs().cuda().eval()
    inputs = [torch.rand(16, 64, 256, 256, device="cuda"), torch.rand(16, 64, 66, 67, device="cuda")]
    _with_out_layout(monkeypatch, layout)
    plan = _gpu_plan(capture_module(model, inputs), model, inputs)
    tma = [s.kernel for s in plan.fused if carries_tma(plan.graph, s)]
    assert len(tma) == 2, plan.summary()
    sources = generate(plan)
    assert sources.cuda.count("kf_tma::rounded_fragments(") == 2
    fused = build_module(model, plan, sources)
    _check(model, fused, inputs, torch.channels_last if layout == "nhwc" else torch.contiguous_format)
    kernels = load_kernels(sources, type(model).__name__.lower())  # the same library: its launch counters
    total, prerounded = _launches(kernels._lib)
    assert total >= 2 and prerounded == total, (total, prerounded)
    state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    with torch.no_grad():
        env = run_env(plan, state, inputs)  # the tap-major weights the kernels read
        for step in plan.fused:
            if step.kernel not in tma:
                continue
            node = step.anchor.node
            x, w = env[node.args[0].name], env[node.args[1].name]
            b = env[node.args[2].name] if node.args[2] is not None else None
            operands = [env[o.ref.name] for o in step.epilogue.operands]
            before = _launches(kernels._lib)
            pre = getattr(kernels, step.kernel)(x, w, b, *operands)
            assert _counted(kernels._lib, before) == (1, 1), step.kernel
            before = _launches(kernels._lib)
            rounding = getattr(kernels, step.kernel)(x.contiguous(memory_format=torch.channels_last), w, b, *operands)
            assert _counted(kernels._lib, before) == (1, 0), step.kernel
            torch.testing.assert_close(rounding, pre, atol=1e-5, rtol=1e-5)
