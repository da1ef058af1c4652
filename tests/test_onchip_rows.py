"""Long rows on chip across several blocks (kernelfuse.codegen.onchip): which rows take it, that the kernels
compile for sm_80 and sm_90 without spills, and that the one-block-per-row kernel the launcher falls back to
(older GPUs, the CPU emulation) still matches the plan interpreter. The on-chip kernels themselves run in
tests/test_generated_gpu.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated, emulated_run
from optimizer_helpers import pipeline, write_problem

from kernelfuse.codegen import generate
from kernelfuse.codegen.generated import keeps_rows_on_chip
from kernelfuse.codegen.onchip import ONCHIP_MAX_BLOCKS, ONCHIP_MAX_ROW
from kernelfuse.plan import schedule

CASES = {  # forward, input shape, on-chip kernel expected
    "softmax_long": ("torch.softmax(x, dim=-1)", (4, 9000), True),
    "softmax_odd_row": ("torch.softmax(x, dim=-1)", (4, 9001), True),
    "softmax_cached": ("torch.softmax(x, dim=-1)", (4, 8000), False),  # 32 per thread: registers hold it
    "log_softmax_most_blocks": ("torch.log_softmax(x, dim=1)", (2, ONCHIP_MAX_ROW), True),
    "too_long_for_the_chip": ("torch.log_softmax(x, dim=1)", (2, ONCHIP_MAX_ROW + 4), False),
    "logsumexp": ("torch.logsumexp(x, dim=1)", (4, 50000), False),  # one value per row: nothing to read back
    "strided_softmax": ("torch.softmax(x, dim=0)", (20000, 8), False),
    "layer_norm": ("torch.nn.functional.layer_norm(x, (12000,))", (3, 12000), True),
    "mapped_l1": ("x / torch.sum(torch.abs(x), dim=1, keepdim=True)", (1024, 9000), True),
    "norm_residual": ("torch.nn.functional.group_norm(x, 2) + x", (2, 4, 5000), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_which_rows_stay_on_chip(name: str, tmp_path: Path) -> None:
    expr, shape, expected = CASES[name]
    _, _, plans = pipeline(write_problem(tmp_path, name, f"def forward(self, x):\n    return {expr}",
                                         f"[torch.randn{shape}]"))
    (step,) = plans[-1].generated
    assert keeps_rows_on_chip(step) == expected, plans[-1].summary()
    sources = generate(plans[-1])
    assert ("_onchip_kernel" in sources.cuda) == expected
    assert ("work = src.new_empty(" in sources.binding) == expected  # the partials and counters
    if expected:
        blocks = int(sources.cuda.split("sm_80+: ")[1].split(" ")[0])
        assert 2 <= blocks <= ONCHIP_MAX_BLOCKS
        assert "kf_row_cache[j * TPR + lane]" in sources.cuda and "kf_grid_reduce" in sources.cuda
        # 16-byte copies only where four neighbouring row elements are neighbours in memory
        vector = "true" if shape[-1] % 4 == 0 else "false"
        assert f"constexpr bool KF_VECTOR_COPIES = {vector};" in sources.cuda


def test_onchip_kernels_compile_for_sm80_and_sm90(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    zoo = Path(__file__).parent / "fixtures" / "problems" / "zoo_onchip.py"
    _, _, plans = pipeline(zoo)
    cu = tmp_path / "onchip.cu"
    cu.write_text(generate(plans[-1]).cuda)
    arches = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (80, 90)]
    result = subprocess.run([nvcc, "-c", "-std=c++17", *arches, "-Xptxas", "-v", str(cu), "-o",
                             str(tmp_path / "onchip.o")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("Compiling entry function '_Z") >= 4 * len(plans[-1].generated)
    assert all(f"{g.kernel}_onchip_kernel" in result.stderr for g in plans[-1].generated)
    # the on-chip kernels (512 threads, 4 blocks an SM: 32 registers) hold their statistics without spilling. The
    # row kernels beside them are not asked: one keeps the weight and bias of its first column, hoisted out of its
    # row loop, on the stack across the calls of the IEEE division's slow path (8 bytes, once a thread; sm_90)
    spills, kernel = [], ""
    for line in result.stderr.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
        elif "spill stores" in line and not line.strip().startswith("0 bytes") and "_onchip_kernel" in kernel:
            spills.append(f"{kernel}: {line.strip()}")
    assert not spills, spills


@pytest.mark.parametrize("name", ["softmax_long", "layer_norm", "mapped_l1", "norm_residual"])
def test_fallback_kernel_matches_the_interpreter(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedule, "MAPPED_MIN_ROWS", 1)  # a small emulated shape
    expr, shape, _ = CASES[name]
    shape = (2, *shape[1:]) if name == "mapped_l1" else shape
    _, _, plans = pipeline(write_problem(tmp_path, name, f"def forward(self, x):\n    return {expr}",
                                         f"[torch.randn{shape}]"))
    plan = plans[-1]
    (step,) = plan.generated
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step, seed=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("expr", "on_chip", "in_block"), [
    ("torch.nn.functional.group_norm(x, 2) + x", True, True),
    ("torch.nn.functional.group_norm(x * 2.0, 2) + x", True, False),  # the one-block kernel holds 2x, not x
    ("torch.nn.functional.group_norm(x, 2) + x.flip(2)", False, False)])
def test_residual_of_the_norms_own_input_is_not_read_again(expr: str, on_chip: bool, in_block: bool,
                                                           tmp_path: Path) -> None:
    """GroupNorm(x) + x (level-2 92): the epilogue's x is the element the kernel already holds (the on-chip
    kernel's shared-memory copy of the source; the one-block kernel's value where no prologue changed it);
    otherwise it is read from memory. Checked against the interpreter through the emulated one-block kernel."""
    _, _, plans = pipeline(write_problem(tmp_path, "res", f"def forward(self, x):\n    return {expr}",
                                         "[torch.randn(2, 4, 5000)]"))
    cuda = generate(plans[-1]).cuda
    assert ("const float e_in0 = raw;" in cuda) == on_chip
    assert ("const float e_in0 = v;" in cuda) == in_block
    plan = plans[-1]
    step = next(g for g in plan.generated if g.spec is not None and g.spec.kind == "norm")
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step, seed=3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sizes", "strides", "vector"), [
    ((8, 64, 64), (4096, 64, 1), True),  # rows of 64 x 64, contiguous
    ((8, 64, 64), (4290, 66, 1), False),  # a padded view: rows 66 apart, so a group of four can start unaligned
    ((8, 64, 62), (3968, 62, 1), False),  # 62 columns: a group of four would cross into the next row
    ((8, 4096), (4096, 1), True),
])
def test_16_byte_copies_need_every_group_of_four_aligned(sizes, strides, vector) -> None:
    from kernelfuse.codegen.iteration import Space
    from kernelfuse.codegen.onchip import copies_vectors

    space = Space(sizes, ("k",) + ("r",) * (len(sizes) - 1), {"src": strides})
    assert copies_vectors(space) is vector


def test_a_per_channel_scale_after_a_plane_softmax_is_loaded_once_a_row(tmp_path: Path) -> None:
    """softmax over each channel's volume times a per-channel scale (level-2 38): the scale's offset is the same
    for a whole row, so both row kernels load it once a row, not once an element; the on-chip kernel's statistics
    passes read groups of four. Checked against the interpreter through the emulated one-block kernel
    (the on-chip kernel runs in tests/test_generated_gpu.py)."""
    body = """
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5)

    def forward(self, x):
        return torch.softmax(x.view(2, 4, -1), dim=2).view(x.shape) * self.scale
    """
    _, _, plans = pipeline(write_problem(tmp_path, "plane_softmax", body, "[torch.randn(2, 4, 100, 96)]"))
    plan = plans[-1]
    (step,) = plan.generated
    cuda = generate(plan).cuda
    assert "const float e_in0 = e_in0_row;" in cuda and "kf_load(e_in0_p[(((row_out) / 9600) % 4)])" in cuda
    assert "_onchip_kernel" in cuda and "const float4 kf_raw4 = " in cuda
    out, expected, _, _ = emulated_run(emulated(plan, tmp_path), plan, step, seed=2)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("shape", "hoisted"), [((2, 4, 9600), True), ((2, 9600, 4), False)])
def test_only_operands_constant_over_a_row_are_hoisted(shape: tuple[int, ...], hoisted: bool, tmp_path: Path) -> None:
    """A scale along the reduced dim changes within the row: it stays a load per element."""
    scale = "(1, 4, 1)" if hoisted else "(1, 1, 4)"
    body = f"""
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand{scale})

    def forward(self, x):
        return torch.softmax(x, dim={2 if hoisted else 1}) * self.scale
    """
    _, _, plans = pipeline(write_problem(tmp_path, "scaled", body, f"[torch.randn{shape}]"))
    assert ("e_in0_row" in generate(plans[-1]).cuda) == hoisted


def test_a_group_loads_the_operands_its_four_elements_share(tmp_path: Path) -> None:
    """A biased input's group norm and a scaled residual (as level-2 92): the per-channel bias (prologue), the
    norm's weight and shift and the residual's scale (epilogue) are the same for four neighbouring elements of a
    plane of a multiple of 4, so the on-chip passes load them once a group, and the write pass stores the group in
    one 16-byte store where the output is aligned. A softmax divides each element (the IEEE division's slow path),
    and a log_softmax's four elements share no operand (groups measured slower there): their write passes stay one
    element at a time. The on-chip kernels run in tests/test_generated_gpu.py (zoo_onchip)."""
    body = """
    def __init__(self):
        super().__init__()
        self.channel_bias = nn.Parameter(torch.randn(1, 32, 1, 1))
        self.gn = nn.GroupNorm(8, 32)

    def forward(self, x):
        flat = x.flatten(1)
        return torch.tanh(self.gn(x + self.channel_bias)) + x * self.channel_bias, torch.softmax(flat, 1), \
            torch.log_softmax(flat, 1)
    """
    _, _, plans = pipeline(write_problem(tmp_path, "grouped", body, "[torch.randn(8, 32, 64, 64)]"))
    cuda = generate(plans[-1]).cuda
    norm, softmax, log_softmax = (
        cuda.split(f"__global__ void __launch_bounds__(512, 4) {k}_onchip_kernel")[1].split("KF_EXPORT")[0]
        for k in ("k0", "k1", "k2"))
    assert "_softmax" in cuda.split("// k1:")[1].split("\n")[0] and "_log_softmax" in cuda.split("// k2:")[1]
    # once a group in both statistics passes and the write pass
    assert norm.count("const float h_in0 = kf_load(p_in0_p[row_in0 + g_in0]);") == 3
    assert "const float v = value_at_g(r, raw, h_in0);" in norm and "value_at(r, raw)" not in norm
    assert "const float y = ((v - mean) * rstd) * h_weight + h_bias;" in norm
    assert "const float e_in1 = e_in1_g;" in norm and "const float e_in0 = raw;" in norm
    assert "*reinterpret_cast<float4*>(&out[row_out + g_out]) = make_float4(" in norm
    for single in (softmax, log_softmax):
        assert "kf_res[t]" not in single and "out[row_out + o_out] = " in single
