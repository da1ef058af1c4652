"""Scan kernels (kernelfuse.codegen.scan): the plan takes cumsum/cumprod/cummax/cummin/logcumsumexp, their
reverse and exclusive forms and a fused prologue and epilogue; the interpreter equals the model; the generated CUDA,
run in a CPU emulation, equals the interpreter; it compiles with nvcc; and its sum's error stays within the bound
of an fp32 scan against float64."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated, emulated_and_interpreted
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.codegen import generate
from kernelfuse.codegen.scan import TILE, scan_strategy
from kernelfuse.ops.scans import ONE_ROW_MAX, SCAN_KINDS

SCANS = """
def forward(self, x, w, y):
    return (
        torch.cumsum(x, 1),                                        # inner dim, rows longer than one tile
        torch.cumprod(x * 0.5 + 1.0, 1) * 2.0,                     # prologue and epilogue fused
        torch.cumsum(x.flip(1), 1).flip(1),                        # reverse
        torch.cat((torch.zeros_like(x.select(1, 0).unsqueeze(1)),
                   torch.cumsum(x.narrow(1, 0, x.size(1) - 1), 1)), 1),  # exclusive, as dev level-1 92 writes it
        torch.cummax(x, 1)[0],                                     # values only
        torch.cummin(y, 0)[0],                                     # a strided dim: a thread per column
        torch.logcumsumexp(y, 2),
        torch.cumsum(x * w, 1),                                    # a masked scan: the product is the prologue
    )
"""
GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "scans.cu"
INPUTS = "[torch.randn(6, 2500), (torch.rand(6, 2500) > 0.5).float(), torch.randn(5, 7, 33)]"


@pytest.fixture(scope="module")
def scan_plan(tmp_path_factory):
    path = write_problem(tmp_path_factory.mktemp("scans"), "scans", SCANS, INPUTS)
    problem, _, variants = pipeline(path)
    assert len(variants) == 1
    return problem, variants[0]


def _scans(plan):
    return [g for g in plan.generated if g.spec is not None and g.spec.kind in SCAN_KINDS]


def test_every_scan_is_one_generated_kernel(scan_plan):
    _, plan = scan_plan
    scans = _scans(plan)
    kinds = [(g.spec.kind, g.spec.reverse, g.spec.exclusive) for g in scans]
    assert kinds == [("cumsum", False, False), ("cumprod", False, False), ("cumsum", True, False),
                     ("cumsum", False, True), ("cummax", False, False), ("cummin", False, False),
                     ("logcumsumexp", False, False), ("cumsum", False, False)]
    assert [scan_strategy(g) for g in scans] == ["tile"] * 5 + ["column", "tile", "tile"]
    assert len(scans[1].prologue.statements) == 2 and len(scans[1].epilogue.statements) == 1
    assert len(scans[7].prologue.statements) == 1  # x * w
    assert not [s for s in plan.unfused if s.node.op.split(".")[0] in ("cumsum", "cat", "flip", "zeros_like")]
    assert 2500 > TILE  # the carry between tiles is exercised


def test_one_long_row_stays_atens_device_scan(tmp_path):
    """A single row longer than ONE_ROW_MAX keeps ATen's scan, with the decision as its reason; a shorter one and
    many long rows are kernels."""
    path = write_problem(tmp_path, "one_row", """
def forward(self, x, y):
    return torch.cumsum(x, 0), torch.cumsum(x[:ONE_ROW_MAX], 0), torch.cumsum(y, 1)
""".replace("ONE_ROW_MAX", str(ONE_ROW_MAX)), f"[torch.randn({ONE_ROW_MAX + 1}), torch.randn(2, {ONE_ROW_MAX + 1})]")
    _, _, (plan,) = pipeline(path)
    (kept,) = plan.unfused
    assert kept.node.op == "cumsum.default" and kept.reason.startswith("library at the floor: one row of")
    assert len(_scans(plan)) == 2


EDGES = """
def forward(self, x, y):
    return (
        torch.cumsum(x, 0),                                  # one row: no kept dim
        torch.logcumsumexp(y.flip(1), 1).flip(1),            # reverse over a strided middle dim
        torch.cumprod(y.transpose(1, 2), 2),                 # a transposed source: the scanned dim strided
        torch.cummin(y, 2)[0] + torch.cumsum(y, 1),          # values of cummin, an epilogue reading another scan
    )
"""


def test_scan_edge_shapes_run_in_a_cpu_emulation(tmp_path):
    path = write_problem(tmp_path, "edges", EDGES, "[torch.randn(3000), torch.randn(3, 70, 5)]")
    _, _, (plan,) = pipeline(path)
    assert len(_scans(plan)) == 5
    emu = emulated(plan, tmp_path)
    for g in _scans(plan):
        out, expected = emulated_and_interpreted(emu, plan, g)
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-4, equal_nan=True,
                                   msg=lambda m, k=g.kernel: f"{k}: {m}")


def test_interpreter_equals_the_model(scan_plan):
    problem, plan = scan_plan
    assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)


def test_scan_kernels_run_in_a_cpu_emulation(scan_plan, tmp_path):
    """The generated CUDA of every scan equals the plan interpreter's scan of the same random values (float sums
    in another order: within fp32 rounding of the row's magnitude)."""
    _, plan = scan_plan
    emu = emulated(plan, tmp_path)
    for g in _scans(plan):
        out, expected = emulated_and_interpreted(emu, plan, g)
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-4, equal_nan=True,
                                   msg=lambda m, k=g.kernel: f"{k}: {m}")


def test_scan_error_bound_against_float64(scan_plan, tmp_path):
    """The kernel's fp32 cumsum of n terms errs by less than sqrt(n) * eps * sum|x| against float64 (a random-walk
    bound for rounding errors; eager's CUDA scan, a tree within a block and a carry between blocks, has the same)."""
    _, plan = scan_plan
    emu = emulated(plan, tmp_path)
    g = _scans(plan)[0]
    out, _ = emulated_and_interpreted(emu, plan, g, seed=3)
    torch.manual_seed(3)
    x = torch.randn(g.source.meta.shape).double()
    exact = x.cumsum(1)
    n = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)
    bound = n.sqrt() * torch.finfo(torch.float32).eps * x.abs().cumsum(1)
    assert ((out.double() - exact).abs() <= bound).all()


def test_scan_kernels_match_the_golden_snapshot(scan_plan):
    """A refactor that changes no scan kernel changes no byte here; regenerate with KERNELFUSE_UPDATE_GOLDEN=1."""
    sources = generate(scan_plan[1])
    text = sources.cuda + "\n// ---- bindings ----\n" + sources.binding
    if os.environ.get("KERNELFUSE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_scan_kernels_compile_with_nvcc(scan_plan, tmp_path):
    nvcc = _nvcc()
    cu = tmp_path / "scans.cu"
    cu.write_text(generate(scan_plan[1]).cuda)
    cmd = [nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(cu.with_suffix(".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


# drawn as KernelBench draws its scans: positive
LARGE_INPUTS = "[torch.rand(256, 32768), (torch.rand(256, 32768) > 0.5).float(), torch.rand(64, 96, 300)]"


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", [INPUTS, LARGE_INPUTS], ids=["small", "large"])
def test_scans_match_eager_on_the_gpu(tmp_path, inputs):
    """Every scan's emitted ModelNew against eager's CUDA scans under the strict rule (atol = rtol = 1e-4)."""
    import runpy

    from kernelfuse.emit import emit_modelnew

    path = write_problem(tmp_path, "scans_gpu", SCANS, inputs)
    problem, _, (plan,) = pipeline(path)
    emitted = tmp_path / "scans_gpu_new.py"
    emitted.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    ns = runpy.run_path(str(emitted))
    torch.manual_seed(1)
    xs = [t.cuda() for t in ns["get_inputs"]()]
    with torch.no_grad():
        expected, got = problem.make_model().cuda()(*xs), ns["ModelNew"]().cuda()(*xs)
    bad = [f"output {i}: max abs err {(g - e).abs().max().item():.3g}" for i, (e, g) in
           enumerate(zip(expected, got, strict=True)) if not torch.allclose(g, e, atol=1e-4, rtol=1e-4, equal_nan=True)]
    assert not bad, bad


MASKED = """
def forward(self, x, mask):
    return torch.cumsum(x * mask, dim=1), torch.relu(mask * x) + x
"""
MASKED_INPUTS = "[torch.randn(8, 3000), torch.randint(0, 2, (8, 3000)).bool()]"


def test_masked_scan_reads_the_bool_mask_in_the_kernel(tmp_path):
    """`cumsum(x * mask)` with a bool mask (dev level-1 93's form): one kernel whose prologue loads the mask as
    1.0f/0.0f (ATen's promotion) through a bool pointer; the binding checks its dtype; the CPU emulation equals
    the interpreter; nvcc compiles it. A pointwise chain reading the mask first still takes x as its source."""
    path = write_problem(tmp_path, "masked", MASKED, MASKED_INPUTS)
    _, _, (plan,) = pipeline(path)
    assert plan.unfused == [] and [g.family for g in plan.generated] == ["cumsum", "pointwise"]
    for g in plan.generated:
        assert g.source.meta.dtype == torch.float32
        assert [o.meta.dtype for o in g.prologue.operands] == [torch.bool]
    sources = generate(plan)
    assert "const bool* __restrict__ p_in0_p" in sources.cuda and "torch.bool)" in sources.binding
    emu = emulated(plan, tmp_path)
    for g in plan.generated:
        out, expected = emulated_and_interpreted(emu, plan, g)
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-4, msg=lambda m, k=g.kernel: f"{k}: {m}")
    cu = tmp_path / "masked.cu"
    cu.write_text(sources.cuda)
    result = subprocess.run([_nvcc(), "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(tmp_path / "m.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
def test_masked_scan_matches_eager_on_the_gpu(tmp_path):
    import runpy

    from kernelfuse.emit import emit_modelnew

    path = write_problem(tmp_path, "masked_gpu", MASKED, "[torch.rand(512, 32768), "
                         "torch.randint(0, 2, (512, 32768)).bool()]")
    problem, _, (plan,) = pipeline(path)
    emitted = tmp_path / "masked_gpu_new.py"
    emitted.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    ns = runpy.run_path(str(emitted))
    xs = [t.cuda() for t in ns["get_inputs"]()]
    with torch.no_grad():
        expected, got = problem.make_model().cuda()(*xs), ns["ModelNew"]().cuda()(*xs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
