"""The bf16 flash-attention kernel on wgmma (kernelfuse.codegen.attention_wgmma), kf_attention_tc's Hopper branch:
on the CPU (tests/fixtures/cuda_emulation.h, kf_wg's bf16 descriptors and products emulated from the tensor cores'
addressing in each swizzle mode, shared memory NaN-poisoned) against float64 and against the mma.sync flash kernel, at
every head dim it takes (32, 40 padded to 48, 64, 80 padded to 96, 96, 128), causal and not, S != L, ragged lengths,
grouped-query heads and strided heads and rows, and with explicit masks (bool keep and drop, additive, broadcast
strides, a causal mask as a tensor, rows with every key masked); the fallbacks (a mask whose keys are not contiguous,
a head dim it does not take, a misaligned base: the mma.sync kernels run); nvcc builds for sm_90a (no spills, no
serialized wgmma) and sm_80; on an H100/H200 the kernel runs (its launch counter) and matches float64 and SDPA."""

from __future__ import annotations

import ctypes
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F
from attention_cases import Fn, bool_mask
from emulation_helpers import emulated, node_values
from test_attention_flash import poisoned_shared  # noqa: F401 (a fixture)

from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.codegen.attention import input_strides
from kernelfuse.codegen.attention_wgmma import WGA_CONFIG
from kernelfuse.plan import make_plan
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.ir import AttnStep
from kernelfuse.rewrite import rewrite


def _sdpa(causal: bool, q_bshd: bool = False, kv_bshd: bool = False, out_bshd: bool = False, **kw):
    """SDPA with q (and k, v) given as (batch, seq, heads, d) and transposed inside (the kernel reads them through
    their strides), the output moved back to (batch, seq, heads, d) where out_bshd."""
    def fn(m, q, k, v, *mask):
        if q_bshd:
            q = q.transpose(1, 2)
        if kv_bshd:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, *mask, is_causal=causal, **kw)
        return y.transpose(1, 2) if out_bshd else y
    return fn


def _planned(fn, inputs: list[torch.Tensor], device: str = "cpu"):
    """(each attention step's input values, the plan) of `fn` on bf16 `inputs`: the steps read views of the graph's
    inputs (a transpose is its strides), computed here by the ATen ops themselves."""
    torch.manual_seed(0)
    model = Fn(fn).to(torch.bfloat16)
    inputs = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
    graph = rewrite(capture_module(model, inputs))
    plan = make_plan(graph)
    with torch.no_grad():
        env = node_values(graph, model.to(device), [t.to(device) for t in inputs])
    return [[env[i.ref.name] for i in step.inputs] for step in plan.attention], plan


def _plan(fn, inputs: list[torch.Tensor], device: str = "cpu"):
    """(the first attention step's input values, the plan): `_planned` of a single attention."""
    steps, plan = _planned(fn, inputs, device)
    return steps[0], plan


def _launches(lib) -> int:
    lib.kf_attention_wgmma_launches.restype = ctypes.c_longlong
    return lib.kf_attention_wgmma_launches()


def _run(emu, step: AttnStep, inputs: list[torch.Tensor], wgmma: bool) -> torch.Tensor:
    """The step's kernel on `inputs` (the graph's inputs are the step's here), with the wgmma switch as given."""
    emu.lib.kf_wgmma_enable(int(wgmma))
    before = _launches(emu.lib)
    out = getattr(emu.kernels, step.kernel)(*inputs)
    assert _launches(emu.lib) - before == int(wgmma), "the wgmma kernel ran" if not wgmma else "it did not run"
    return out


def _reference(step: AttnStep, inputs: list[torch.Tensor]) -> torch.Tensor:
    return attention_reference(step, *(t.double() for t in inputs[:3]), inputs[3] if len(inputs) > 3 else None)


# (B, H, H kv, S, L, d, causal, q (b, s, h, d), k and v (b, s, h, d), output (b, s, h, d), scale): ragged S and L
# (not multiples of 64), S != L, grouped-query heads, strided heads and rows, the causal diagonal over two query
# blocks and masked tiles processed first; every head dim of WGA_CONFIG (40 and 80 over zero pad columns)
WGMMA_CASES = {
    "d32_causal_gqa_q_bshd": (1, 4, 2, 130, 150, 32, True, True, False, False, None),
    "d40_kv_bshd_out_bshd_scale": (1, 2, 2, 70, 200, 40, False, False, True, True, 0.3),
    "d64_causal_gqa_q_bshd": (1, 4, 2, 130, 150, 64, True, True, False, False, None),
    "d64_kv_bshd_out_bshd_scale": (1, 2, 2, 70, 200, 64, False, False, True, True, 0.3),
    "d80_causal_s200_l130_gqa": (1, 2, 1, 200, 130, 80, True, False, False, False, None),
    "d96_causal_s200_q_bshd": (1, 2, 2, 200, 200, 96, True, True, False, False, None),
    "d96_gqa_s70_l200_kv_bshd_out_bshd": (1, 2, 1, 70, 200, 96, False, False, True, True, None),
    "d128_causal_s130": (1, 1, 1, 130, 130, 128, True, False, False, False, None),
    "d128_gqa_s70_l200_kv_bshd": (1, 2, 1, 70, 200, 128, False, True, True, False, None),
}


@pytest.mark.parametrize("name", sorted(WGMMA_CASES))
def test_emulated_wgmma_attention_matches_float64_and_the_flash_kernel(name, tmp_path, poisoned_shared):  # noqa: F811
    """The wgmma kernel (kf_wgmma_enable(1), as the loader sets it for an sm_90a build on a 9.0 device) within bf16
    tolerance of the float64 reference and of the mma.sync flash kernel (the switch off) on the same inputs."""
    b, h, hk, s, length, d, causal, q_bshd, kv_bshd, out_bshd, scale = WGMMA_CASES[name]
    torch.manual_seed(1)
    q = torch.randn(b, s, h, d) if q_bshd else torch.randn(b, h, s, d)
    k, v = ((torch.randn(b, length, hk, d) if kv_bshd else torch.randn(b, hk, length, d)) for _ in range(2))
    kw = {"enable_gqa": True} if h != hk else {}
    if scale is not None:
        kw["scale"] = scale
    inputs, plan = _plan(_sdpa(causal, q_bshd, kv_bshd, out_bshd, **kw), [q, k, v])
    step: AttnStep = plan.attention[0]
    assert step.dims == (b, h, hk, s, length, d) and step.causal == causal and step.mask is None
    strides = input_strides(step)
    assert strides["q"][2] == (h * d if q_bshd else d) and strides["k"][2] == (hk * d if kv_bshd else d)
    emu = emulated(plan, tmp_path)
    got = _run(emu, step, inputs, wgmma=True)
    flash = _run(emu, step, inputs, wgmma=False)
    reference = _reference(step, inputs)
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape and got.stride() == flash.stride()
    torch.testing.assert_close(got.double(), reference, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), flash.float(), rtol=2e-2, atol=2e-2)


def _masked_fill(m, q, k, v, mask):
    """minGPT's attention with its mask a tensor: the scores' masked_fill by a bool (true masked, MASK 2), a row with
    every key masked NaN (the step's empty_nan)."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    return torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v


def _padding(batch: int, length: int, valid: int) -> torch.Tensor:
    """BERT's additive padding mask (batch, 1, 1, L): 0 for the first `valid` keys of batch 0, bf16's lowest after
    them (as transformers fills it); batch 1 and on every key -inf (every row empty: SDPA's zeros)."""
    mask = torch.full((batch, 1, 1, length), -math.inf)
    mask[0, ..., :valid] = 0.0
    mask[0, ..., valid:] = torch.finfo(torch.bfloat16).min
    return mask


# name: (form, q, k and v shapes, the mask, its kind, the rows (batch, row) whose every key is masked): broadcast
# strides (BERT's (B, 1, 1, L), (1, 1, S, L), a per-head (H, S, L), a 2-d (S, L)), a causal mask as a tensor (its
# key tiles past the block's rows skipped), S != L, grouped-query heads, every head dim's layout
MASK_CASES = {
    "d64_sdpa_add_bert_padding": (_sdpa(False), (2, 2, 150, 64), (2, 2, 150, 64), _padding(2, 150, 100), "add",
                                  [(1, r) for r in range(150)]),
    "d96_sdpa_keep_gqa_s70_l150": (_sdpa(False, enable_gqa=True), (1, 4, 70, 96), (1, 2, 150, 96),
                                   bool_mask(1, 1, 70, 150), "keep", [(0, 1)]),
    "d32_masked_fill_causal_tensor_s200": (_masked_fill, (1, 2, 200, 32), (1, 2, 200, 32),
                                           torch.ones(200, 200).triu(1).bool(), "drop", []),
    "d32_sdpa_keep_padding": (_sdpa(False), (2, 2, 150, 32), (2, 2, 150, 32), _padding(2, 150, 90) == 0, "keep",
                              [(1, r) for r in range(150)]),  # batch 1: no tile taken, every row empty
    "d40_masked_fill_empty_row": (_masked_fill, (2, 2, 70, 40), (2, 2, 77, 40), ~bool_mask(2, 1, 70, 77), "drop",
                                  [(0, 1), (1, 1)]),
    "d80_sdpa_add_per_head": (_sdpa(False), (2, 2, 100, 80), (2, 2, 100, 80), torch.randn(2, 100, 100), "add", []),
    "d128_sdpa_keep_causal_tensor_s260": (_sdpa(False), (1, 1, 260, 128), (1, 1, 260, 128),
                                          torch.ones(260, 260).tril().bool(), "keep", []),
}


def _mask_plan(device: str = "cpu"):
    """(the case names, each step's input values, the plan) of every MASK_CASES form in one plan."""
    torch.manual_seed(4)
    names = sorted(MASK_CASES)
    tensors = []
    for name in names:
        _, q_shape, kv_shape, mask, _, _ = MASK_CASES[name]
        tensors += [torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape), mask]

    def forms(m, *xs):
        return tuple(MASK_CASES[name][0](m, *xs[4 * i:4 * i + 4]) for i, name in enumerate(names))

    steps, plan = _planned(forms, tensors, device)
    return names, steps, plan


def test_emulated_wgmma_attention_with_masks(tmp_path, poisoned_shared):  # noqa: F811
    """Explicit masks as the mma.sync kernels read them (MASK 1 keep, 2 drop, 3 additive, through the plan's
    strides) on the wgmma kernel, within bf16 tolerance of float64 and of the flash kernel; a row whose every key is
    masked is zeros for SDPA and NaN for the hand-written form, as the flash kernel gives it. One plan, one build."""
    names, steps, plan = _mask_plan()
    emu = emulated(plan, tmp_path)
    for name, step, inputs in zip(names, plan.attention, steps, strict=True):
        _, q_shape, kv_shape, _, kind, empty = MASK_CASES[name]
        assert step.mask_kind == kind and step.dims[3:] == (q_shape[2], kv_shape[2], q_shape[3]), name
        assert input_strides(step)["mask"][3] == 1, name
        got = _run(emu, step, inputs, wgmma=True)
        flash = _run(emu, step, inputs, wgmma=False)
        reference = _reference(step, inputs)
        torch.testing.assert_close(got.double(), reference, rtol=2e-2, atol=2e-2, equal_nan=True, msg=name)
        torch.testing.assert_close(got.float(), flash.float(), rtol=2e-2, atol=2e-2, equal_nan=True, msg=name)
        empty_rows = torch.zeros(got.shape[0], got.shape[2], dtype=torch.bool)  # (batch, row)
        for batch, row in empty:
            empty_rows[batch, row] = True
        out = got.transpose(1, 2)  # (batch, row, head, d)
        assert (out[empty_rows].isnan() if step.empty_nan else out[empty_rows] == 0).all(), name
        assert not out[~empty_rows].isnan().any(), name


def test_emulated_fallbacks_run_the_mma_sync_kernels(tmp_path, poisoned_shared):  # noqa: F811
    """With the switch on, a mask whose keys are not contiguous (a transposed one) and a misaligned base (q 2 bytes
    past 16-byte alignment: the first tensor-core kernel) run the mma.sync kernels, correctly; head dim 48 has no
    wgmma branch at all."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    inputs, plan = _plan(_sdpa(False), [q, k, v, bool_mask(40, 40, empty_row=False).t()])
    step = plan.attention[0]
    assert input_strides(step)["mask"][3] == 40 and "kf_attention_tc<" in generate(plan).cuda
    emu = emulated(plan, tmp_path)
    emu.lib.kf_wgmma_enable(1)
    got = getattr(emu.kernels, step.kernel)(*inputs)
    assert _launches(emu.lib) == 0
    torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2)

    inputs, plan = _plan(_sdpa(True), [q, k, v])
    step = plan.attention[0]
    (tmp_path / "misaligned").mkdir()
    emu = emulated(plan, tmp_path / "misaligned")
    emu.lib.kf_wgmma_enable(1)
    shifted = torch.empty(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape).copy_(inputs[0])
    assert shifted.data_ptr() % 16 == 2
    got = getattr(emu.kernels, step.kernel)(shifted, *inputs[1:])
    assert _launches(emu.lib) == 0
    torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2)
    getattr(emu.kernels, step.kernel)(*inputs)  # aligned: the wgmma kernel
    assert _launches(emu.lib) == 1

    _, plan = _plan(_sdpa(False), [torch.randn(1, 2, 40, 48) for _ in range(3)])
    text = generate(plan).cuda
    dims = " || ".join(f"D == {d}" for d in WGA_CONFIG)
    assert "kf_attention_tc<unsigned char, 48, 0," in text and f"({dims}) && !RELU" in text and 48 not in WGA_CONFIG


def _build(plan, tmp_path, arch: str) -> str:
    """nvcc's -Xptxas -v log of the plan's file for `arch`; for sm_90a every wgmma kernel without spills and without
    a wgmma serialization or compiler-inserted arrive (C75xx)."""
    from test_nvcc_compile import _nvcc

    cu = tmp_path / "attention.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([_nvcc(), "-std=c++17", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-c", str(cu), "-o",
                             str(tmp_path / f"{arch}.o")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stderr
    if arch == "sm_90a":
        for entry in log.split("Compiling entry function"):
            if "wgmma_kernel" in entry.split("\n")[0]:
                assert " 0 bytes spill stores" in entry, entry
        flagged = [line for line in log.splitlines() if "(C75" in line and "wgmma_kernel" in line]
        assert not flagged, flagged
    return log


def test_wgmma_attention_builds_with_nvcc_for_sm90a_and_sm80(tmp_path):
    """Head dims 64 and 128 (causal and not) in one file: for sm_90a as _build checks, for sm_80 with the kernel's
    body a trap."""
    def both(m, q, k, v, q2, k2, v2):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q2, k2, v2)

    _, plan = _plan(both, [torch.randn(1, 2, 70, d) for d in (64, 64, 64, 128, 128, 128)])
    assert sorted((a.dims[5], a.causal) for a in plan.attention) == [(64, True), (128, False)]
    log = _build(plan, tmp_path, "sm_90a")
    for kernel in ("IhLi64ELi0ELb1ELb0E", "IhLi128ELi0ELb0ELb0E"):
        assert f"kf_attention_wgmma_kernel{kernel}" in log, kernel
    _build(plan, tmp_path, "sm_80")


def test_wgmma_attention_head_dims_and_masks_build_for_sm90a(tmp_path):
    """The other head dims and the masks for sm_90a, as _build checks: 32 with a bool mask, 40 (UNet's), 80 with an
    additive one, 96 causal (minGPT's SDPA) and with its mask a tensor, 64 with BERT's additive padding, 128 with a
    bool mask."""
    def forms(m, *xs):
        return (F.scaled_dot_product_attention(*xs[0:4]), F.scaled_dot_product_attention(*xs[4:7]),
                F.scaled_dot_product_attention(*xs[7:11]), F.scaled_dot_product_attention(*xs[11:14], is_causal=True),
                _masked_fill(m, *xs[14:18]), F.scaled_dot_product_attention(*xs[18:22]),
                F.scaled_dot_product_attention(*xs[22:26]))

    def qkv(d: int) -> list[torch.Tensor]:
        return [torch.randn(1, 2, 70, d) for _ in range(3)]

    keep, add = torch.rand(70, 70) > 0.5, torch.randn(1, 1, 1, 70)
    _, plan = _plan(forms, [*qkv(32), keep, *qkv(40), *qkv(80), add, *qkv(96), *qkv(96), ~keep, *qkv(64), add,
                            *qkv(128), keep])
    kinds = [(a.dims[5], a.mask_kind, a.causal) for a in plan.attention]
    assert kinds == [(32, "keep", False), (40, "none", False), (80, "add", False), (96, "none", True),
                     (96, "drop", False), (64, "add", False), (128, "keep", False)], kinds
    log = _build(plan, tmp_path, "sm_90a")
    for kernel in ("IhLi32ELi1ELb0ELb0E", "IhLi40ELi0ELb0ELb0E", "ItLi80ELi3ELb0ELb0E", "IhLi96ELi0ELb1ELb0E",
                   "IhLi96ELi2ELb0ELb1E", "ItLi64ELi3ELb0ELb0E", "IhLi128ELi1ELb0ELb0E"):
        assert f"kf_attention_wgmma_kernel{kernel}" in log, kernel


def _gpu_kernels(plan, name: str):
    """The plan's library on the GPU through the loader, and whether the wgmma kernel should run (a 9.0 device)."""
    from kernelfuse.emit.module import load_kernels

    return load_kernels(generate(plan), name), torch.cuda.get_device_capability() == (9, 0)


def _flash_twin(kernels, step: AttnStep, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The mma.sync flash kernel on the same inputs (the wgmma switch off for the call)."""
    kernels._allow_wgmma(False)
    try:
        return getattr(kernels, step.kernel)(*inputs)
    finally:
        kernels._allow_wgmma(True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, gqa", [((2, 4, 300, 64), True, False), ((2, 8, 1100, 128), False, False),
                                                ((2, 8, 300, 64), True, True), ((1, 8, 520, 128), True, True),
                                                ((2, 4, 300, 32), True, False), ((2, 4, 1100, 40), False, False),
                                                ((1, 8, 520, 80), True, True), ((2, 4, 300, 96), True, False),
                                                ((2, 8, 1100, 96), False, True)])
def test_gpu_wgmma_attention_matches_torch_sdpa(shape, causal, gqa):
    """On a GPU through the loader (an sm_90a build on a 9.0 device): the wgmma kernel ran (its launch counter,
    and not with kf_wgmma_enable(0)), within bf16 tolerance of float64 and of torch's SDPA."""
    b, h, s, d = shape
    hk = h // 4 if gqa else h
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    inputs, plan = _plan(_sdpa(causal, enable_gqa=gqa), [q, k, v], "cuda")
    step = plan.attention[0]
    kernels, hopper = _gpu_kernels(plan, f"attention_wgmma_{d}_{s}_{int(causal)}_{int(gqa)}")
    before = _launches(kernels._lib)
    got = getattr(kernels, step.kernel)(*inputs)
    torch.cuda.synchronize()
    assert _launches(kernels._lib) - before == int(hopper), "the wgmma kernel runs exactly on a 9.0 device"
    sdpa = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=gqa)
    torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=3e-2, atol=3e-2)
    if hopper:  # the mma.sync flash kernel on the same inputs: close, and not the same kernel's bits
        flash = _flash_twin(kernels, step, inputs)
        assert _launches(kernels._lib) - before == 1
        torch.testing.assert_close(got.float(), flash.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_gpu_wgmma_attention_with_masks():
    """MASK_CASES on the GPU (one plan): each step took the wgmma kernel on a 9.0 device, within bf16 tolerance of
    float64 and of the mma.sync flash kernel, its empty rows zeros (SDPA) or NaN (the hand-written form)."""
    names, steps, plan = _mask_plan("cuda")
    kernels, hopper = _gpu_kernels(plan, "attention_wgmma_masks")
    for name, step, inputs in zip(names, plan.attention, steps, strict=True):
        before = _launches(kernels._lib)
        got = getattr(kernels, step.kernel)(*inputs)
        torch.cuda.synchronize()
        assert _launches(kernels._lib) - before == int(hopper), name
        torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2, equal_nan=True,
                                   msg=name)
        torch.testing.assert_close(got.float(), _flash_twin(kernels, step, inputs).float(), rtol=3e-2, atol=3e-2,
                                   equal_nan=True, msg=name)
