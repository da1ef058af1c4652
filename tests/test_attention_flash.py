"""The bf16 tensor-core attention kernels on the CPU (tests/fixtures/cuda_emulation.h, shared memory NaN-poisoned):
mma.sync m16n8k16, ldmatrix and cp.async from their PTX layouts; the flash kernel in blocks of 4 or 8 warps and
every FlashConfig tiling against the float64 reference; the tilings built with nvcc for sm_90."""

from __future__ import annotations

from dataclasses import replace

import emulation_helpers
import pytest
import torch
from attention_cases import CASES, FLASH_CASES, PADDED_CASES, planned
from emulation_helpers import emulated, node_values

from kernelfuse.codegen import attention
from kernelfuse.codegen.attention import FlashConfig, flash_config, flash_warps, input_strides, uses_tensor_cores
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.ir import AttnStep

# The tilings: 4 or 8 warps, 64- or 32-key tiles, the query fragments in registers or re-read from shared memory
# (there with registers capped at 128 a thread, as the probe times them); the tests take every one but the case's
# default, which the other tests run
FLASH_TILINGS = [FlashConfig(warps, keys, q_in_registers, 0 if q_in_registers else 16 // warps)
                 for warps in (4, 8) for keys in (64, 32) for q_in_registers in (True, False)]


TENSOR_CORE_CASES = sorted([*(n for n in CASES if not n.endswith("d256")), *PADDED_CASES])  # head dims 16..128


@pytest.fixture
def poisoned_shared(tmp_path, monkeypatch):
    """The emulation with every block's dynamic shared memory NaN-filled (fp32 and bf16 alike) before its threads
    start: a kernel that computes with shared memory it never wrote (a head dim's pad columns left unzeroed) gives
    NaN where the static buffer's leftovers (zeros at first) would hide it."""
    define = "#define KF_DYNAMIC_SHARED(name) alignas(16) static float name[227 * 1024 / 4]"
    text = emulation_helpers.EMULATION.read_text()
    assert define in text
    header = tmp_path / "cuda_emulation_poisoned.h"
    header.write_text(text.replace(define, f"{define}; kf_emu_poison(name, sizeof(name))") + """
inline void kf_emu_poison(float* smem, std::size_t bytes) {
  if (threadIdx.x == 0) std::memset(smem, 0xff, bytes);
  __syncthreads();
}
""")
    monkeypatch.setattr(emulation_helpers, "EMULATION", header)


@pytest.mark.parametrize("name", TENSOR_CORE_CASES)
def test_emulated_bf16_tensor_core_kernel_matches_the_reference(name, tmp_path, poisoned_shared):
    """bf16 on tensor cores: mma.sync m16n8k16, ldmatrix and cp.async emulated from their PTX layouts, against the
    float64 reference of the same bf16 inputs (probabilities rounded to bf16 for the second product: bf16
    tolerance). q, k and v contiguous along d take the flash kernel (4 warps of 16 query rows a block at these
    sizes); q or k strided along d the first tensor-core kernel. Head dims that are odd multiples of 8 (24, 40, 72)
    run there too, over zero pad columns in shared memory that starts NaN-filled here."""
    model, inputs, graph, plan = planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert uses_tensor_cores(step)
    assert flash_warps(step, input_strides(step)) == (0 if "strided" in name else 4)
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    emu = emulated(plan, tmp_path)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emu.kernels, step.kernel)(*args)
    assert got.dtype == torch.bfloat16 and got.stride() == env[step.out].stride()
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


FLASH_128_QUERY_CASES = ["handwritten_causal_d96", "handwritten_relu_d64", "sdpa_causal_s150_l170_d32", "sdpa_gqa_d128",
                         "sdpa_causal_s150_l170_d40", *FLASH_CASES]


@pytest.mark.parametrize("device", ["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", FLASH_128_QUERY_CASES)
def test_bf16_flash_kernel_with_128_query_blocks(name, device, tmp_path, monkeypatch, poisoned_shared):
    """The flash kernel's 128-query blocks: 8 warps of 16 rows (chosen where they fill every SM: here with the SM
    count patched to 1). Warps whose rows are all past S or before a causal tile's first key sit tiles out, a bool
    mask skips tiles; head dim 40 (5 copies a row: 256 threads leave one idle) over zero pad columns."""
    monkeypatch.setattr(attention, "SMS", 1)
    model, inputs, graph, plan = planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert flash_warps(step, input_strides(step)) == 8
    if device == "cuda":
        from kernelfuse.codegen import generate
        from kernelfuse.emit.module import load_kernels

        kernels = load_kernels(generate(plan), f"attention_flash8_{name}")
        model, inputs = model.cuda(), [t.cuda() for t in inputs]
    else:
        kernels = emulated(plan, tmp_path).kernels
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


def test_flash_config_default_is_the_launch_bounds_rule():
    """The default tiling renders the template arguments the kernel had before its tiling was a FlashConfig: 64-key
    tiles, the query in registers, __launch_bounds__'s (D <= 64 ? 16 : 8) / WARPS blocks; min_blocks overrides it."""
    assert [FlashConfig(w).template_args(d) for w in (4, 8) for d in (40, 64, 96)] == [
        "4, 64, true, 4", "4, 64, true, 4", "4, 64, true, 2", "8, 64, true, 2", "8, 64, true, 2", "8, 64, true, 1"]
    assert FlashConfig(8, 32, False, 2).template_args(96) == "8, 32, false, 2"
    assert FlashConfig(0).template_args(96) == "0, 64, true, 0"  # not the flash kernel: the arguments go unused


@pytest.mark.parametrize(("name", "want"), [("sdpa_causal_s150_l170_d96", FlashConfig(4, 64, False, 4)),
                                             ("sdpa_causal_s150_l170_d40", FlashConfig(4)),
                                             ("sdpa_causal_d64", FlashConfig(4))])
def test_flash_config_reads_the_query_from_shared_memory_above_head_dim_64(name, want):
    """Head dims 65-96 re-read the query fragments from shared memory at 128 registers (two blocks of 8 warps an SM
    instead of one); up to 64 they stay in registers."""
    *_, plan = planned(name, torch.bfloat16)
    (step,) = plan.steps
    assert flash_config(step, input_strides(step)) == want


def _tiled_plan(name: str, monkeypatch):
    """(model, inputs, graph, plan, tilings) for bf16 `name`: the plan's attention once per FLASH_TILINGS tiling but
    the case's default, each its own kernel of one file (tilings: kernel name -> tiling; flash_config patched to
    give each kernel its tiling)."""
    model, inputs, graph, plan = planned(name, torch.bfloat16)
    (step,) = plan.steps
    default = flash_config(step, input_strides(step))
    tilings = {f"{step.kernel}_t{i}": tiling for i, tiling in enumerate(t for t in FLASH_TILINGS if t != default)}
    monkeypatch.setattr(attention, "flash_config", lambda s, strides: tilings[s.kernel])
    return model, inputs, graph, replace(plan, steps=tuple(replace(step, kernel=k) for k in tilings)), tilings


TILED = ["sdpa_causal_s150_l170_d96", "sdpa_causal_s150_l170_d40", "sdpa_bool_mask_d40"]


@pytest.mark.parametrize("name", TILED)
def test_emulated_bf16_flash_tilings_match_the_reference(name, tmp_path, monkeypatch, poisoned_shared):
    """Every non-default tiling of the bf16 flash kernel (8 warps, 32-key tiles, the query fragments re-read by
    ldmatrix at each k-step) against the float64 reference: the causal diagonal and the tiles a warp sits out at
    either key tile, ragged last tiles, a bool mask with a row that attends to nothing, and head dim 40's zero pad
    columns (re-read with the query fragments) in shared memory that starts NaN-filled."""
    model, inputs, graph, plan, tilings = _tiled_plan(name, monkeypatch)
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    kernels = emulated(plan, tmp_path).kernels
    args = [env[i.ref.name] for i in plan.steps[0].inputs]
    reference = attention_reference(plan.steps[0], *args[:3], args[3] if len(args) > 3 else None).float()
    for step in plan.steps:
        tiling = tilings[step.kernel]
        got = getattr(kernels, step.kernel)(*args)
        torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2, equal_nan=True,
                                   msg=lambda m, t=tiling: f"{t}: {m}")


@pytest.mark.parametrize("name", [*TILED, "sdpa_causal_d64"])
def test_bf16_flash_tilings_build_with_nvcc_for_sm90(name, tmp_path, monkeypatch):
    """Every non-default tiling, one file, at head dims 96, 40 and 64: __launch_bounds__ with min_blocks, 32-key
    tiles, the query fragments read from shared memory build for sm_90."""
    import subprocess

    from test_nvcc_compile import _nvcc

    from kernelfuse.codegen import generate

    nvcc = _nvcc()
    *_, plan, tilings = _tiled_plan(name, monkeypatch)
    cu = tmp_path / "attention.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for tiling in tilings.values():
        assert f"{tiling.template_args(plan.steps[0].dims[5])}>(p, " in cu.read_text()


_LDMATRIX_CHECK = r"""
static unsigned short tile[16 * 24];  // 16 x 16 bf16 words, rows padded to 24
static std::atomic<int> wrong{0};
inline unsigned int pair(int r0, int c0, int r1, int c1) {  // (r0, c0) low, (r1, c1) high
  return tile[r0 * 24 + c0] | (unsigned)tile[r1 * 24 + c1] << 16;
}
extern "C" int check() {
  for (int i = 0; i < 16 * 24; ++i) tile[i] = (unsigned short)(i * 7 + 1);
  kf_emu_launch(dim3(1), 32, [&] {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned int a[4], k[4], v[4];
    // the flash kernel's addressing: the tile as A (16 x 16), as keys (two groups of 8 rows, k16 along the row),
    // as values (k16 down the rows, two groups of 8 columns)
    kf_ldmatrix_x4(a, tile + lane % 16 * 24 + lane / 16 * 8);
    kf_ldmatrix_x4(k, tile + (lane % 8 + lane / 16 * 8) * 24 + lane / 8 % 2 * 8);
    kf_ldmatrix_x4_trans(v, tile + lane % 16 * 24 + lane / 16 * 8);
    // mma.m16n8k16's fragments (PTX ISA): A a0..a7 = (g, 2t..+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..);
    // B b0..b3 = (k 2t..+1, n g), (k 2t + 8.., n g); keys are B[k][n] = tile[n][k], values B[k][n] = tile[k][n]
    const unsigned int want[12] = {
        pair(g, 2 * t, g, 2 * t + 1), pair(g + 8, 2 * t, g + 8, 2 * t + 1),
        pair(g, 2 * t + 8, g, 2 * t + 9), pair(g + 8, 2 * t + 8, g + 8, 2 * t + 9),
        pair(g, 2 * t, g, 2 * t + 1), pair(g, 2 * t + 8, g, 2 * t + 9),
        pair(g + 8, 2 * t, g + 8, 2 * t + 1), pair(g + 8, 2 * t + 8, g + 8, 2 * t + 9),
        pair(2 * t, g, 2 * t + 1, g), pair(2 * t + 8, g, 2 * t + 9, g),
        pair(2 * t, g + 8, 2 * t + 1, g + 8), pair(2 * t + 8, g + 8, 2 * t + 9, g + 8)};
    for (int i = 0; i < 4; ++i) wrong += (a[i] != want[i]) + (k[i] != want[4 + i]) + (v[i] != want[8 + i]);
  });
  return wrong;
}
"""


def test_emulated_ldmatrix_gives_the_mma_fragments(tmp_path):
    """The emulated ldmatrix x4 (and .trans), addressed as the flash kernel addresses it, yields the mma.sync
    m16n8k16 operand fragments built directly from the PTX ISA's layouts."""
    import ctypes
    import shutil
    import subprocess

    from emulation_helpers import EMULATION

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) on PATH")
    cpp, lib = tmp_path / "ldmatrix.cpp", tmp_path / "ldmatrix.so"
    cpp.write_text(f'#include "{EMULATION}"\n{_LDMATRIX_CHECK}')
    result = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread", str(cpp), "-o", str(lib)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ctypes.CDLL(str(lib)).check() == 0
