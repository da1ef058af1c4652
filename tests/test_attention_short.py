"""The fp32 short-rows attention form (kernelfuse.codegen.attention_short: S, L <= 64, windows packed a block, one
plain softmax, float4 operands; on by default) on the CPU (tests/fixtures/cuda_emulation.h, shared memory
NaN-poisoned) against float64 in every tiling: Swin's 49 x 49 windows at head dim 32 with a per-head bias (copied to
shared memory once a block) and with the shifted-window mask (the planner's hand-written Swin form), S != L with a
per-batch mask read from global memory, bool masks and causal rows, head dim 64, batch counts that leave the last
block's windows ragged; its launch counter, the fallback to the flash kernel on a misaligned base, the switch and its
rule; nvcc builds for sm_90a and sm_80 without spills; on a GPU against float64 and torch's SDPA."""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from attention_cases import Fn, sdpa_fn
from emulation_helpers import emulated, node_values
from test_attention_flash import poisoned_shared  # noqa: F401 (a fixture)
from test_attention_kernels import _shifted_windows

from kernelfuse.capture import capture_module
from kernelfuse.codegen import attention, attention_short, generate
from kernelfuse.codegen.attention_short import ShortRows
from kernelfuse.plan import PlanOptions, make_plan
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.ir import AttnStep
from kernelfuse.rewrite import rewrite

# windows a block, row tiles a warp: one window of 4 warps, several windows a block, two row tiles a warp (two warps
# a 49-row window; three windows for ragged batches), a register cap; exact FMAs in the same tilings
TILINGS = [ShortRows(1, 1), ShortRows(2, 1), ShortRows(4, 1), ShortRows(2, 2), ShortRows(3, 2), ShortRows(2, 1, 3),
           ShortRows(3, 1, fma=True), ShortRows(3, 2, fma=True)]
OTHERS = [ShortRows(2, 1), ShortRows(3, 2), ShortRows(2, 2, fma=True)]  # the other cases' tilings


_SEEDED = torch.Generator().manual_seed(0)  # the cases' values, the same at every run


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_SEEDED)


def _qkv(b: int, h: int, s: int, length: int, d: int) -> list[torch.Tensor]:
    return [_randn(b, h, s, d), _randn(b, h, length, d) + 0.5, _randn(b, h, length, d) - 0.5]


def _keep(s: int, length: int) -> torch.Tensor:
    """A bool mask (True attends) whose row 1 attends to nothing: SDPA's zeros."""
    keep = torch.rand(s, length, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[1] = False
    return keep


def _causal(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# name: (forward, inputs, plan options): the Swin probe's form (SDPA with a per-head additive bias) at 49 x 49, a
# batch of 5 (ragged for 2, 3 and 4 windows a block); S != L with a per-batch additive mask (read from global
# memory, not shared); a bool mask with an empty row; causal rows over S != L; head dim 64 (ViT's short rows); the
# tf32 policy
CASES = {
    "swin_bias_d32": (sdpa_fn(), [*_qkv(5, 2, 49, 49, 32), _randn(2, 49, 49)], PlanOptions()),
    "s20_l37_batch_mask_d32": (sdpa_fn(), [*_qkv(3, 2, 20, 37, 32), _randn(3, 1, 20, 37)], PlanOptions()),
    "bool_mask_empty_row_d64": (sdpa_fn(), [*_qkv(3, 2, 33, 50, 64), _keep(33, 50)], PlanOptions()),
    "causal_s64_l40_d32": (_causal, _qkv(2, 2, 64, 40, 32), PlanOptions()),
    "vit_d64": (sdpa_fn(), _qkv(3, 2, 50, 50, 64), PlanOptions()),
    "swin_bias_d32_tf32": (sdpa_fn(), [*_qkv(5, 2, 49, 49, 32), _randn(2, 49, 49)], PlanOptions(matmul_tf32=True)),
}


def _launches(lib) -> int:
    lib.kf_attention_short_launches.restype = ctypes.c_longlong
    return lib.kf_attention_short_launches()


def _tiled(plan, tilings: list[ShortRows], monkeypatch):
    """The plan's attention step once per tiling, each its own kernel of one file (attention.short_rows patched to
    give each kernel its tiling); (the plan, kernel name -> tiling)."""
    (step,) = plan.attention
    by_kernel = {f"{step.kernel}_t{i}": tiling for i, tiling in enumerate(tilings)}
    monkeypatch.setattr(attention, "short_rows", lambda s, vector, config=None: by_kernel[s.kernel] if vector else None)
    return replace(plan, steps=tuple(replace(step, kernel=k) for k in by_kernel)), by_kernel


def _planned(name: str):
    fn, inputs, options = CASES[name]
    torch.manual_seed(0)
    model = Fn(fn)
    graph = rewrite(capture_module(model, inputs))
    plan = make_plan(graph, options)
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    (step,) = plan.attention
    return [env[i.ref.name] for i in step.inputs], plan


def _reference(step: AttnStep, args: list[torch.Tensor]) -> torch.Tensor:
    extra = [a.double() if a.is_floating_point() else a for a in args[3:]]
    return attention_reference(step, *(a.double() for a in args[:3]), *(extra or [None]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_short_rows_match_float64_in_every_tiling(name, tmp_path, monkeypatch, poisoned_shared):  # noqa: F811
    """The short-rows kernel within the strict rule of float64 (the tf32 policy within TF32's) in every tiling on
    Swin's case, in OTHERS on the others; the kernel taken at every call (its launch counter), rows whose every key
    is masked zeros as SDPA gives them. The FMA tilings within the strict rule at any policy."""
    args, plan = _planned(name)
    chosen = TILINGS if name == "swin_bias_d32" else OTHERS  # each case within a minute
    tiled, tilings = _tiled(plan, chosen, monkeypatch)
    source = generate(tiled).cuda
    for tiling in chosen:
        assert f", {tiling.template_args()}>(p, " in source and "kf_attention_f32tc<" in source, tiling
    emu = emulated(tiled, tmp_path)
    reference = _reference(plan.attention[0], args)
    for step in tiled.attention:
        tol = 1e-2 if plan.attention[0].math == "tf32" and not tilings[step.kernel].fma else 2e-5
        before = _launches(emu.lib)
        got = getattr(emu.kernels, step.kernel)(*args)
        assert _launches(emu.lib) - before == 1, tilings[step.kernel]
        torch.testing.assert_close(got.double(), reference, rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m, t=tilings[step.kernel]: f"{t}: {m}")
        assert not got.isnan().any()


@pytest.mark.parametrize("option, tiling, math", [("split", ShortRows(3, 1), "3xtf32"),
                                                  ("kernel", ShortRows(3, 1, fma=True), "fma")])
def test_emulated_swin_shifted_windows_take_the_short_rows_form(option, tiling, math, tmp_path, monkeypatch,
                                                                 poisoned_shared):  # noqa: F811
    """Swin's shifted-window attention as torchvision writes it (a per-head bias, then the window mask added through
    the (images, windows, heads, S, L) view), planned under the 3xTF32 variant and under the strict default (exact
    fp32: the FMA tiling): one step with the window mask (the planner's _window_mask), the short-rows kernel in
    blocks of 3 windows over 8 batch indices (a ragged last block; the windows of a block read different window
    masks) against float64 and eager."""
    torch.manual_seed(0)
    qkv = [torch.randn(8, 2, 49, 32) for _ in range(3)]
    windows = torch.where(torch.rand(4, 49, 49) > 0.3, 0.0, -100.0)
    inputs = [*qkv, torch.randn(2, 49, 49), windows]
    graph = rewrite(capture_module(Fn(_shifted_windows), inputs))
    _switch(monkeypatch, tiling)
    plan = make_plan(graph, PlanOptions(attention=option))
    (step,) = plan.attention
    assert (step.window_count, step.mask_kind, step.math) == (4, "add", math)
    assert f"kf_attention_short<float, 32, 3, false, true, {tiling.math(step)}, 7, 4, 1, 3, 0>" in generate(plan).cuda
    with torch.no_grad():
        env = node_values(graph, Fn(_shifted_windows), inputs)
        expected = Fn(_shifted_windows)(*inputs)
    args = [env[i.ref.name] for i in step.inputs]
    emu = emulated(plan, tmp_path)
    got = getattr(emu.kernels, step.kernel)(*args)
    assert _launches(emu.lib) == 1
    torch.testing.assert_close(got.double(), _reference(step, args), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, expected, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("fma", [False, True])
def test_emulated_misaligned_base_falls_back_to_the_flash_kernel(fma, tmp_path, monkeypatch):
    """q 4 bytes past 16-byte alignment: the launcher takes the step's own kernel (the flash kernel), correctly, and
    the short-rows kernel again for aligned inputs."""
    args, plan = _planned("swin_bias_d32")
    _switch(monkeypatch, ShortRows(2, 1, fma=fma))
    assert "kf_attention_f32tc<" in generate(plan).cuda
    emu = emulated(plan, tmp_path)
    step = plan.attention[0]
    shifted = torch.empty(args[0].numel() + 1)[1:].view(args[0].shape).copy_(args[0])
    assert shifted.data_ptr() % 16 == 4
    got = getattr(emu.kernels, step.kernel)(shifted, *args[1:])
    assert _launches(emu.lib) == 0
    torch.testing.assert_close(got.double(), _reference(step, args), rtol=2e-5, atol=2e-5)
    getattr(emu.kernels, step.kernel)(*args)
    assert _launches(emu.lib) == 1


def _switch(monkeypatch, tiling: ShortRows | None) -> None:
    """Both switches (tensor-core and exact-FMA steps) set to `tiling`: an FMA step takes it only where it is an
    FMA tiling, as short_rows's rule says."""
    monkeypatch.setattr(attention_short, "SHORT_ROWS", tiling)
    monkeypatch.setattr(attention_short, "SHORT_ROWS_FMA", tiling)


def test_the_switches_measured_defaults_and_the_rule(monkeypatch):
    """On by default (stop 58's measurements): tensor-core steps take ShortRows(2, 1), exact-FMA steps ShortRows(1,
    1, fma=True); off (None), the flash kernel; set, the form takes fp32 steps with S and L up to 64 at head dims
    32 and 64 whose blocks fit an H100's shared memory, and nothing else."""
    _, plan = _planned("swin_bias_d32")
    step = plan.attention[0]
    assert attention.short_rows_tiling(step) == ShortRows(2, 1)
    assert attention_short.short_rows(replace(step, math="fma"), True) == ShortRows(1, 1, fma=True)
    _switch(monkeypatch, None)
    assert attention.short_rows_tiling(step) is None and "kf_attention_short" not in generate(plan).cuda
    on = ShortRows(2, 1)
    assert attention_short.short_rows(step, True, on) == on
    b, h, hk, s, length, d = step.dims
    refused = [replace(step, dims=(b, h, hk, 65, length, d)), replace(step, dims=(b, h, hk, s, 65, d)),
               replace(step, dims=(b, h, hk, s, length, 40)), replace(step, activation="relu"),
               replace(step, softcap=(0.5, 2.0)),
               replace(step, out_meta=replace(step.out_meta, dtype=torch.bfloat16))]
    assert [attention_short.short_rows(x, True, on) for x in refused] == [None] * len(refused)
    assert attention_short.short_rows(step, False, on) is None  # q, k or v not in 16-byte rows along d
    exact = replace(step, math="fma")  # hand-written fp32 under the strict policy: the FMA tilings only
    assert attention_short.short_rows(exact, True, on) is None
    assert attention_short.short_rows(exact, True, ShortRows(2, 1, fma=True)) == ShortRows(2, 1, fma=True)
    assert [ShortRows(fma=True).math(exact), on.math(step), on.math(replace(step, math="tf32"))] == [2, 1, 0]
    # shared memory: 8 windows of Swin's d32 (168 KB with the bias) fit an H100's block, 8 of ViT's d64 (265 KB) not
    assert ShortRows(8, 1).shared_bytes(step) == 4 * (8 * 56 * 84 + 64 * 72)
    assert attention_short.short_rows(step, True, ShortRows(8, 1)) == ShortRows(8, 1)
    vit = replace(step, dims=(b, h, hk, 50, 50, 64), mask=None, mask_kind="none")
    assert ShortRows(8, 1).shared_bytes(vit) == 4 * 8 * 56 * 148 > attention_short.MAX_SHARED
    assert attention_short.short_rows(vit, True, ShortRows(8, 1)) is None
    assert attention_short.short_rows(vit, True, ShortRows(4, 1)) == ShortRows(4, 1)


def _build(plan, tmp_path, arch: str) -> str:
    """nvcc's -Xptxas -v log of the plan's file for `arch`, every short-rows kernel without spills."""
    from test_nvcc_compile import _nvcc

    cu = tmp_path / f"short_{arch}.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([_nvcc(), "-std=c++17", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-c", str(cu), "-o",
                             str(tmp_path / f"{arch}.o")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = [e for e in result.stderr.split("Compiling entry function")[1:] if "short_kernel" in e.split("\n")[0]]
    assert entries
    for entry in entries:
        assert " 0 bytes spill stores" in entry, entry
    return result.stderr


# (step of the build plan, tiling): every form in the probe's tilings of 2 and 4 windows a block of one row tile a
# warp, in 3xTF32 and FMA; two row tiles a warp at head dim 32 (at 64 they need 168-174 registers, and with a bool
# mask ptxas spilled 4 bytes); TF32
BUILDS = [(i, t) for i in range(4) for t in (ShortRows(2, 1), ShortRows(4, 1), ShortRows(2, 1, fma=True))] + \
    [(i, t) for i in range(2) for t in (ShortRows(2, 2), ShortRows(2, 2, fma=True))] + \
    [(4, ShortRows(2, 1)), (5, ShortRows(2, 1))]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_short_rows_build_without_spills(arch, tmp_path, monkeypatch):
    """Head dim 32 (Swin's bias; the window mask) and 64 (a bool mask; causal) in 3xTF32 and FMA, two of them in
    TF32, in the tilings of BUILDS: no spills for sm_90a or sm_80 (registers: the probe's SHORT_ROWS_CONFIGS)."""
    def forms(m, *xs):
        return (F.scaled_dot_product_attention(*xs[0:4]), _shifted_windows(m, *xs[4:9]),
                F.scaled_dot_product_attention(*xs[9:13]), F.scaled_dot_product_attention(*xs[13:16], is_causal=True))

    inputs = [*_qkv(4, 3, 49, 49, 32), _randn(3, 49, 49), *_qkv(8, 2, 49, 49, 32), _randn(2, 49, 49),
              torch.zeros(4, 49, 49), *_qkv(2, 2, 50, 50, 64), _keep(50, 50), *_qkv(2, 2, 64, 64, 64)]
    graph = rewrite(capture_module(Fn(forms), inputs))
    split = make_plan(graph, PlanOptions(attention="split"))
    tf32 = make_plan(graph, PlanOptions(attention="split", matmul_tf32=True))
    assert len(split.attention) == 4 and split.attention[1].window_count == 4
    steps = [*split.attention, *(replace(a, kernel=f"{a.kernel}_tf32") for a in tf32.attention[:2])]
    assert [a.math for a in steps] == ["3xtf32"] * 4 + ["tf32"] * 2
    tilings = {f"{steps[i].kernel}_t{n}": (steps[i], t) for n, (i, t) in enumerate(BUILDS)}
    monkeypatch.setattr(attention, "short_rows", lambda s, vector, config=None: tilings[s.kernel][1])
    plan = replace(split, steps=tuple(replace(a, kernel=k) for k, (a, _) in tilings.items()))
    log = _build(plan, tmp_path, arch)
    assert len(set(re.findall(r"kf_attention_short_kernel\w+", log))) == len(tilings)


GPU_SHAPES = [((640, 3, 49, 32), True), ((64, 12, 50, 64), False), ((7, 4, 49, 32), True)]  # Swin, ViT-B, ragged
GPU_TILINGS = [ShortRows(1, 1), ShortRows(2, 1), ShortRows(4, 1), ShortRows(2, 2), ShortRows(2, 1, fma=True),
               ShortRows(2, 2, fma=True)]


@pytest.fixture(scope="module")
def gpu_short_rows():
    """(kernels, {(shape index, tiling index): step}, each shape's CUDA inputs): every GPU_SHAPES case in every
    GPU_TILINGS tiling, one library (one nvcc build)."""
    from kernelfuse.emit.module import load_kernels

    torch.manual_seed(0)
    inputs = [[*_qkv(b, h, s, s, d), *([torch.randn(h, s, s)] if mask else [])] for (b, h, s, d), mask in GPU_SHAPES]

    def forms(m, *xs):
        out, at = [], 0
        for case in inputs:
            out.append(F.scaled_dot_product_attention(*xs[at:at + len(case)]))
            at += len(case)
        return tuple(out)

    plan = make_plan(rewrite(capture_module(Fn(forms), [t for case in inputs for t in case])))
    steps, by_kernel = {}, {}
    for i, step in enumerate(plan.attention):
        for n, tiling in enumerate(GPU_TILINGS):
            steps[(i, n)] = replace(step, kernel=f"{step.kernel}_t{n}")
            by_kernel[steps[(i, n)].kernel] = tiling
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(attention, "short_rows", lambda s, vector, config=None: by_kernel[s.kernel])
        kernels = load_kernels(generate(replace(plan, steps=tuple(steps.values()))), "attention_short_gpu")
    return kernels, steps, [[t.cuda() for t in case] for case in inputs]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", range(len(GPU_SHAPES)))
@pytest.mark.parametrize("tiling", range(len(GPU_TILINGS)))
def test_gpu_short_rows_match_float64_and_torch_sdpa(shape, tiling, gpu_short_rows):
    """On the GPU through the loader: the short-rows kernel ran (its launch counter), as close to float64 as torch's
    own fp32 SDPA (twice its largest error at most) and within the strict rule of it."""
    kernels, steps, inputs = gpu_short_rows
    case = inputs[shape]
    before = _launches(kernels._lib)
    got = getattr(kernels, steps[(shape, tiling)].kernel)(*case)
    torch.cuda.synchronize()
    assert _launches(kernels._lib) - before == 1, GPU_TILINGS[tiling]
    exact = F.scaled_dot_product_attention(*(t.double() for t in case))
    torchs = F.scaled_dot_product_attention(*case)
    ours, theirs = float((got.double() - exact).abs().max()), float((torchs.double() - exact).abs().max())
    assert ours <= 2 * theirs, (GPU_TILINGS[tiling], ours, theirs)
    torch.testing.assert_close(got, torchs, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("option, tiling", [("split", ShortRows(2, 1)), ("kernel", ShortRows(2, 1, fma=True))])
def test_gpu_swin_shifted_windows_take_the_short_rows_form(option, tiling, monkeypatch):
    """torchvision's shifted-window attention at Swin-T's first stage (64 windows an image, 3 heads), under the
    3xTF32 variant and the strict default (FMA): the short-rows kernel ran, within the strict rule of float64."""
    from kernelfuse.emit.module import load_kernels

    torch.manual_seed(0)
    inputs = [*_qkv(128, 3, 49, 49, 32), torch.randn(3, 49, 49), torch.where(torch.rand(64, 49, 49) > 0.3, 0.0, -100.0)]
    _switch(monkeypatch, tiling)
    graph = rewrite(capture_module(Fn(_shifted_windows), inputs))
    plan = make_plan(graph, PlanOptions(attention=option))
    (step,) = plan.attention
    assert step.window_count == 64
    kernels = load_kernels(generate(plan), f"attention_short_swin_{option}")
    with torch.no_grad():
        env = node_values(graph, Fn(_shifted_windows).cuda(), [t.cuda() for t in inputs])
    args = [env[i.ref.name] for i in step.inputs]
    before = _launches(kernels._lib)
    got = getattr(kernels, step.kernel)(*args)
    torch.cuda.synchronize()
    assert _launches(kernels._lib) - before == 1
    torch.testing.assert_close(got.double(), _reference(step, args), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, env[step.out], rtol=1e-4, atol=1e-4)
