"""The bf16 flash-attention kernel on wgmma (kernelfuse.codegen.attention_wgmma), kf_attention_tc's Hopper branch:
on the CPU (tests/fixtures/cuda_emulation.h, kf_wg's bf16 descriptors and products emulated from the tensor cores'
addressing in each swizzle mode, shared memory NaN-poisoned) against float64 and against the mma.sync flash kernel, at
every head dim it takes (32, 40 padded to 48, 64, 80 padded to 96, 96, 128), causal and not, S != L, ragged lengths,
grouped-query heads and strided heads and rows; the fallbacks (a mask, a head dim it does not take, a misaligned
base: the mma.sync kernels run); nvcc builds for sm_90a (no spills, no serialized wgmma) and sm_80; on an H100/H200
the kernel runs (its launch counter) and matches float64 and SDPA."""

from __future__ import annotations

import ctypes
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


def _plan(fn, inputs: list[torch.Tensor], device: str = "cpu"):
    """(the attention step's input values, the plan) of `fn` on bf16 `inputs`: the step reads views of the graph's
    inputs (a transpose is its strides), computed here by the ATen ops themselves."""
    torch.manual_seed(0)
    model = Fn(fn).to(torch.bfloat16)
    inputs = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
    graph = rewrite(capture_module(model, inputs))
    plan = make_plan(graph)
    with torch.no_grad():
        env = node_values(graph, model.to(device), [t.to(device) for t in inputs])
    return [env[i.ref.name] for i in plan.attention[0].inputs], plan


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


def test_emulated_fallbacks_run_the_mma_sync_kernels(tmp_path, poisoned_shared):  # noqa: F811
    """With the switch on, a bool mask and a misaligned base (q 2 bytes past 16-byte alignment: the first
    tensor-core kernel) run the mma.sync kernels, correctly; head dim 48 has no wgmma branch at all."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    inputs, plan = _plan(_sdpa(False), [q, k, v, bool_mask(40, 40, empty_row=False)])
    step = plan.attention[0]
    assert step.mask is not None and "kf_attention_tc<" in generate(plan).cuda
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
    assert "kf_attention_tc<unsigned char, 48, 0," in text and f"({dims}) && MASK == 0 && !RELU" in text
    assert 48 not in WGA_CONFIG


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
    for kernel in ("ILi64ELb1E", "ILi128ELb0E"):
        assert f"kf_attention_wgmma_kernel{kernel}" in log, kernel
    _build(plan, tmp_path, "sm_80")


def test_wgmma_attention_head_dims_build_for_sm90a(tmp_path):
    """The other head dims for sm_90a, as _build checks: 32, 40 (UNet's), 80 causal, 96 causal (minGPT's) and not."""
    def forms(m, *xs):
        return (F.scaled_dot_product_attention(*xs[0:3]), F.scaled_dot_product_attention(*xs[3:6]),
                F.scaled_dot_product_attention(*xs[6:9], is_causal=True),
                F.scaled_dot_product_attention(*xs[9:12], is_causal=True), F.scaled_dot_product_attention(*xs[12:15]))

    _, plan = _plan(forms, [torch.randn(1, 2, 70, d) for d in (32, 40, 80, 96, 96) for _ in range(3)])
    assert [(a.dims[5], a.causal) for a in plan.attention] == [(32, False), (40, False), (80, True), (96, True),
                                                                (96, False)]
    log = _build(plan, tmp_path, "sm_90a")
    for kernel in ("ILi32ELb0E", "ILi40ELb0E", "ILi80ELb1E", "ILi96ELb1E", "ILi96ELb0E"):
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
