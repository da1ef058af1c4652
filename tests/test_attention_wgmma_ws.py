"""The warp-specialized wgmma attention (kernelfuse.codegen.attention_wgmma_ws: a TMA producer warpgroup, consumers
on wgmma, full and empty mbarriers) with its gate switched on (WS_MIN_KEYS; by default at head dim 64 from 4096
keys, at 128 from 1024): on the CPU
(tests/fixtures/cuda_emulation.h: the TMA copies, mbarriers and named barriers emulated by tma_prelude, shared memory
NaN-poisoned) against float64 and against the wgmma kernel (its run-time switch off, same library), at head dims 64
and 128, causal and not, ragged S and L (not multiples of the tiles), S != L, grouped-query heads, strided heads and
rows, ping-pong on and off, persistent blocks; the gate (off: the file does not carry the form; a threshold: only
steps reaching it, masked steps never); nvcc builds for sm_90a (no spills, no serialized wgmma) and sm_80; on an
H100/H200 the form runs (its launch counter) and matches float64 and SDPA."""

from __future__ import annotations

import ctypes
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from attention_cases import bool_mask
from emulation_helpers import emulated
from test_attention_flash import poisoned_shared  # noqa: F401 (a fixture)
from test_attention_wgmma import _build, _gpu_kernels, _plan, _reference, _sdpa

from kernelfuse.codegen import attention_wgmma_ws, generate
from kernelfuse.codegen.attention_wgmma_ws import WS_CONFIG, WsConfig
from kernelfuse.plan.ir import AttnStep


@pytest.fixture
def ws_on(monkeypatch):
    """The gate on for every head dim of WS_CONFIG, from one key."""
    monkeypatch.setattr(attention_wgmma_ws, "WS_MIN_KEYS", {d: 1 for d in WS_CONFIG})


def _counter(lib, name: str) -> int:
    fn = getattr(lib, name)
    fn.restype = ctypes.c_longlong
    return fn()


def _run(emu, step: AttnStep, inputs: list[torch.Tensor], ws: bool) -> torch.Tensor:
    """The step's kernel with the wgmma switch on and the form's switch as given: the form ran exactly where `ws`,
    the wgmma kernel otherwise (both count as Hopper launches)."""
    emu.lib.kf_wgmma_enable(1)
    emu.lib.kf_attention_ws_enable(int(ws))
    before = _counter(emu.lib, "kf_attention_ws_launches"), _counter(emu.lib, "kf_attention_wgmma_launches")
    out = getattr(emu.kernels, step.kernel)(*inputs)
    assert _counter(emu.lib, "kf_attention_ws_launches") - before[0] == int(ws), "the form ran" if not ws else "not"
    assert _counter(emu.lib, "kf_attention_wgmma_launches") - before[1] == 1
    return out


# (B, H, H kv, S, L, d, causal, q (b, s, h, d), k and v (b, s, h, d), output (b, s, h, d), scale): ragged S and L,
# S != L (more and fewer keys than queries), grouped-query heads, strided layouts, the causal diagonal across query
# blocks, two and more key tiles (the rings wrap at L > stages x 128)
WS_CASES = {
    "d64_causal_gqa_q_bshd": (1, 4, 2, 200, 230, 64, True, True, False, False, None),
    "d64_s70_l300_kv_bshd_out_bshd_scale": (1, 2, 2, 70, 300, 64, False, False, True, True, 0.3),
    "d64_s250_l90": (2, 1, 1, 250, 90, 64, False, False, False, False, None),
    "d128_causal_s300": (1, 1, 1, 300, 300, 128, True, False, False, False, None),
    "d128_gqa_s70_l400_kv_bshd": (1, 2, 1, 70, 400, 128, False, True, True, False, None),
}


def _inputs(case):
    b, h, hk, s, length, d, causal, q_bshd, kv_bshd, out_bshd, scale = case
    torch.manual_seed(1)
    q = torch.randn(b, s, h, d) if q_bshd else torch.randn(b, h, s, d)
    k, v = ((torch.randn(b, length, hk, d) if kv_bshd else torch.randn(b, hk, length, d)) for _ in range(2))
    kw = {"enable_gqa": True} if h != hk else {}
    if scale is not None:
        kw["scale"] = scale
    return _sdpa(causal, q_bshd, kv_bshd, out_bshd, **kw), [q, k, v]


def _check(emu, step, inputs) -> None:
    got = _run(emu, step, inputs, ws=True)
    wgmma = _run(emu, step, inputs, ws=False)
    reference = _reference(step, inputs)
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape and got.stride() == wgmma.stride()
    torch.testing.assert_close(got.double(), reference, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), wgmma.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", sorted(WS_CASES))
def test_emulated_ws_attention_matches_float64_and_the_wgmma_kernel(name, tmp_path, poisoned_shared, ws_on):  # noqa: F811
    """The form within bf16 tolerance of float64 and of the wgmma kernel on the same inputs."""
    fn, tensors = _inputs(WS_CASES[name])
    inputs, plan = _plan(fn, tensors)
    step: AttnStep = plan.attention[0]
    assert step.dims == WS_CASES[name][:6] and step.mask is None
    assert "kf_attention_ws_kernel" in generate(plan).cuda
    _check(emulated(plan, tmp_path), step, inputs)


@pytest.mark.parametrize("d", sorted(WS_CONFIG))
def test_emulated_ws_attention_pingpong_toggled(d, tmp_path, poisoned_shared, ws_on, monkeypatch):  # noqa: F811
    """Each head dim's config with ping-pong flipped (and three consumer warpgroups of 64-key tiles at 128), and
    persistent (two blocks here, each over several work tiles: the ring's and the query tile's barrier phases and
    the ping-pong turns run on across them): neither hangs nor changes the result."""
    config = WS_CONFIG[d]
    other = replace(config, pingpong=not config.pingpong, persistent=True)
    if d == 128:
        other = replace(other, consumers=3, consumer_regs=160, stages=2, keys=64)
    monkeypatch.setitem(WS_CONFIG, d, other)
    fn, tensors = _inputs((2, 2, 1, 200, 330, d, True, False, False, False, None))
    inputs, plan = _plan(fn, tensors)
    _check(emulated(plan, tmp_path), plan.attention[0], inputs)


@pytest.mark.parametrize("d, config", [
    (64, WsConfig(consumers=2, keys=128, stages=3, producer_regs=24, consumer_regs=240, pingpong=True)),
    (128, WsConfig(consumers=2, keys=176, stages=2, producer_regs=24, consumer_regs=240, pingpong=True))])
def test_emulated_ws_attention_probe_tilings(d, config, tmp_path, poisoned_shared, ws_on, monkeypatch):  # noqa: F811
    """Tilings the probe times beside the defaults (benchmarks/ws_attention_probe.py): two consumer warpgroups at 64,
    176-key tiles at 128 (an m64n176 S, 11 k16 steps of P V; L not a multiple of 176)."""
    monkeypatch.setitem(WS_CONFIG, d, config)
    fn, tensors = _inputs((1, 2, 2, 150, 390, d, False, False, False, False, None))
    inputs, plan = _plan(fn, tensors)
    _check(emulated(plan, tmp_path), plan.attention[0], inputs)


def test_ws_gate(monkeypatch):
    """Off (the default): no file carries the form. A threshold: only the steps whose L reaches it, and never a
    masked step or a head dim without a config."""
    def three(m, q, k, v, q2, k2, v2, mask):
        return (F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q2, k2, v2),
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    tensors = [torch.randn(1, 2, 70, 64) for _ in range(3)] + [torch.randn(1, 2, 300, 64) for _ in range(3)]
    _, plan = _plan(three, tensors + [bool_mask(70, 70)])
    assert attention_wgmma_ws.WS_MIN_KEYS == {64: 4096, 128: 1024}  # the measured gate: 300 keys stay on wgmma
    assert "kf_attention_ws_kernel" not in generate(plan).cuda
    monkeypatch.setattr(attention_wgmma_ws, "WS_MIN_KEYS", {64: 100, 128: None})
    steps = plan.attention
    assert [attention_wgmma_ws.carries_ws(a.dims, a.mask_kind) for a in steps] == [False, True, False]
    text = generate(plan).cuda
    assert "kf_attention_ws_kernel" in text and "MIN_KEYS = 100;" in text and "struct config<128>" not in text
    _, plan = _plan(_sdpa(False), [torch.randn(1, 2, 300, 96) for _ in range(3)])
    assert "kf_attention_ws_kernel" not in generate(plan).cuda


def test_emulated_ws_gate_at_run_time(tmp_path, poisoned_shared, monkeypatch):  # noqa: F811
    """In one file, the step below the threshold runs the wgmma kernel, the one above it the form."""
    monkeypatch.setattr(attention_wgmma_ws, "WS_MIN_KEYS", {64: 200, 128: None})

    def two(m, q, k, v, q2, k2, v2):
        return F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q2, k2, v2, is_causal=True)

    from test_attention_wgmma import _planned
    steps, plan = _planned(two, [torch.randn(1, 2, 70, 64) for _ in range(3)] +
                           [torch.randn(1, 2, 260, 64) for _ in range(3)])
    emu = emulated(plan, tmp_path)
    emu.lib.kf_wgmma_enable(1)
    for step, inputs, ws in zip(plan.attention, steps, (False, True), strict=True):
        before = _counter(emu.lib, "kf_attention_ws_launches")
        got = getattr(emu.kernels, step.kernel)(*inputs)
        assert _counter(emu.lib, "kf_attention_ws_launches") - before == int(ws)
        torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2)


def test_ws_attention_builds_with_nvcc_for_sm90a_and_sm80(tmp_path, ws_on):
    """Head dims 64 (causal) and 128 in one file: for sm_90a as test_attention_wgmma's _build checks the wgmma
    kernels, and the form's the same way (no spills, no serialized wgmma, no compiler-inserted fence: C75xx), for
    sm_80 with the kernels' bodies traps."""
    def both(m, q, k, v, q2, k2, v2):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q2, k2, v2)

    _, plan = _plan(both, [torch.randn(1, 2, 300, d) for d in (64, 64, 64, 128, 128, 128)])
    log = _build(plan, tmp_path, "sm_90a")
    for kernel in ("kf_attention_ws_kernelILi64ELb1ELb0E", "kf_attention_ws_kernelILi128ELb0ELb0E"):
        assert kernel in log, kernel
    for entry in log.split("Compiling entry function")[1:]:
        if "ws_kernel" in entry.split("\n")[0]:  # the entry's name; its ptxas lines follow
            assert " 0 bytes spill stores" in entry and " 0 bytes spill loads" in entry, entry
            # the launch's registers a thread: the whole 64K over the block (the pool setmaxnreg redistributes: fewer
            # and the consumers' increase would wait forever)
            d = int(re.search(r"ws_kernelILi(\d+)E", entry)[1])
            threads = WS_CONFIG[d].threads
            assert f"Used {65536 // threads // 8 * 8} registers" in entry, entry
    flagged = [line for line in log.splitlines() if "(C75" in line and "ws_kernel" in line]
    assert not flagged, flagged  # no wgmma serialized, no arrive (fence) the compiler had to add
    _build(plan, tmp_path, "sm_80")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, gqa, flipped", [
    ((2, 4, 300, 64), True, False, False), ((2, 8, 1100, 128), False, False, False),
    ((2, 8, 700, 64), False, True, False), ((1, 8, 520, 128), True, True, False),
    ((1, 4, 2048, 64), True, False, False), ((1, 4, 2048, 128), False, False, False),
    ((4, 8, 1100, 64), True, False, True), ((4, 8, 1100, 128), False, True, True)])
def test_gpu_ws_attention_matches_torch_sdpa(shape, causal, gqa, flipped, ws_on, monkeypatch):
    """On a GPU through the loader (an sm_90a build on a 9.0 device): the form ran (its launch counter), within bf16
    tolerance of float64, of torch's SDPA and of the wgmma kernel (the form's switch off). `flipped`: the head dim's
    config with ping-pong flipped and persistent blocks (more work tiles than SMs: 4 x 8 x 9 or 6 tiles)."""
    b, h, s, d = shape
    if flipped:
        config = WS_CONFIG[d]
        monkeypatch.setitem(WS_CONFIG, d, replace(config, pingpong=not config.pingpong, persistent=True))
    hk = h // 4 if gqa else h
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    inputs, plan = _plan(_sdpa(causal, enable_gqa=gqa), [q, k, v], "cuda")
    step = plan.attention[0]
    kernels, hopper = _gpu_kernels(plan, f"attention_ws_{d}_{s}_{int(causal)}_{int(gqa)}_{int(flipped)}")
    lib = kernels._lib
    before = _counter(lib, "kf_attention_ws_launches")
    got = getattr(kernels, step.kernel)(*inputs)
    torch.cuda.synchronize()
    assert _counter(lib, "kf_attention_ws_launches") - before == int(hopper), "the form runs exactly on a 9.0 device"
    sdpa = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=gqa)
    torch.testing.assert_close(got.double(), _reference(step, inputs), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=3e-2, atol=3e-2)
    if hopper:  # the wgmma kernel on the same inputs
        lib.kf_attention_ws_enable(0)
        try:
            wgmma = getattr(kernels, step.kernel)(*inputs)
        finally:
            lib.kf_attention_ws_enable(1)
        assert _counter(lib, "kf_attention_ws_launches") - before == 1
        torch.testing.assert_close(got.float(), wgmma.float(), rtol=3e-2, atol=3e-2)
