"""Pooling of every shape as generated kernels: a 1-d max pool (traced as a 2-d pool whose indices are squeezed
and dropped) is one kernel, not the original op; 1-, 2- and 3-d max and average pools with padding, dilation,
ceil_mode, count_include_pad and a divisor override, computed several outputs per thread (1-d ones from
an input span staged in shared memory), and adaptive 1-3-d pools
agree with the interpreter in a CPU emulation of the CUDA (max pools bit for bit)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from emulation_helpers import emulated, emulated_and_interpreted
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.load import load_problem
from kernelfuse.rewrite import apply_rules
from kernelfuse.rewrite.rules import RULE_NAMES

POOLS = """
def forward(self, x, x2, x3):
    return (
        F.max_pool1d(x, 8, stride=1, padding=4, dilation=3),
        F.max_pool1d(x, 4, stride=3, padding=2, ceil_mode=True),
        F.avg_pool1d(x, 5, stride=2, padding=2, count_include_pad=False, ceil_mode=True),
        F.max_pool2d(x2, 4, stride=1, padding=1),
        F.max_pool2d(x2, (3, 2), stride=(2, 3), padding=(1, 1), dilation=(2, 1), ceil_mode=True),
        F.avg_pool2d(x2, 3, stride=1, padding=1, divisor_override=5),
        F.max_pool3d(x3, 3, stride=2, padding=1, dilation=2),
        F.avg_pool3d(x3, (2, 3, 3), stride=(1, 2, 1), padding=(1, 1, 0), count_include_pad=True),
        F.adaptive_avg_pool2d(x2, (3, 5)),
        F.adaptive_max_pool2d(x2, 4),
        F.adaptive_avg_pool1d(x, 7),
        F.adaptive_avg_pool3d(x3, (2, 4, 5)),
        F.adaptive_max_pool3d(x3, (3, 2, 6)),
        F.avg_pool1d(x, 8, stride=1, padding=4),  # dev level-1 44's form: 4 outputs per thread
    )
"""
INPUTS = "[torch.randn(3, 5, 101), torch.randn(2, 3, 17, 23), torch.randn(2, 2, 9, 11, 13)]"
KINDS = ["max_pool", "max_pool", "avg_pool", "max_pool", "max_pool", "avg_pool", "max_pool", "avg_pool",
         "avg_pool", "max_pool", "avg_pool", "avg_pool", "max_pool", "avg_pool"]


@pytest.fixture(scope="module")
def pool_plan(tmp_path_factory):
    path = write_problem(tmp_path_factory.mktemp("pools"), "pools", POOLS, INPUTS,
                         header="import torch.nn.functional as F")
    problem, _, (plan,) = pipeline(path)
    return problem, plan


def test_unused_pool_indices_are_dropped_even_without_rewrites(pool_plan):
    """The trace squeezes the 1-d pool's indices though nothing reads them: they are dropped before planning,
    also with every rewrite rule switched off, so the pool's value alone is read and the kernel takes it."""
    problem, plan = pool_plan
    assert [g.spec.kind for g in plan.generated] == KINDS
    cuda = generate(plan).cuda
    assert cuda.count("a thread per 4 neighbouring outputs along the last dim") == 3  # stride and dilation 1
    assert cuda.count("its input span in shared memory") == 4  # the 1-d pools: a window along the last dim only
    assert plan.unfused == []
    bare = apply_rules(capture(load_problem(problem.path)), RULE_NAMES).graph
    assert not [n for n in bare.nodes if n.op == "getitem" and n.args[1] == 1]


def test_interpreter_equals_the_model(pool_plan):
    problem, plan = pool_plan
    assert_interpreter_matches(problem, plan)


def test_pool_kernels_run_in_a_cpu_emulation(pool_plan, tmp_path):
    _, plan = pool_plan
    emu = emulated(plan, tmp_path)
    for g in plan.generated:
        out, expected = emulated_and_interpreted(emu, plan, g)
        exact = g.spec.kind == "max_pool"  # a max is exact; a sum's order is the window's, as ATen's CUDA kernel
        tol = 0.0 if exact else 1e-6
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m, k=g.kernel: f"{k}: {m}")


def test_pool_kernels_compile_with_nvcc(pool_plan, tmp_path):
    nvcc = _nvcc()
    cu = tmp_path / "pools.cu"
    cu.write_text(generate(pool_plan[1]).cuda)
    cmd = [nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(cu.with_suffix(".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", [INPUTS, "[torch.rand(16, 32, 8192), torch.rand(8, 16, 130, 150), "
                                            "torch.rand(2, 8, 20, 34, 40)]"], ids=["small", "large"])
def test_pools_match_eager_on_the_gpu(tmp_path, inputs):
    """Every pool's emitted ModelNew against eager's CUDA pools: max pools exactly, averages at 1e-5."""
    import runpy

    from kernelfuse.emit import emit_modelnew

    path = write_problem(tmp_path, "pools_gpu", POOLS, inputs, header="import torch.nn.functional as F")
    problem, _, (plan,) = pipeline(path)
    emitted = tmp_path / "pools_gpu_new.py"
    emitted.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    ns = runpy.run_path(str(emitted))
    torch.manual_seed(1)
    xs = [t.cuda() for t in ns["get_inputs"]()]
    with torch.no_grad():
        expected, got = problem.make_model().cuda()(*xs), ns["ModelNew"]().cuda()(*xs)
    for kind, e, g in zip(KINDS, expected, got, strict=True):
        tol = 0.0 if kind == "max_pool" else 1e-5
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)


def test_a_window_too_wide_for_shared_memory_keeps_the_per_thread_kernel():
    """A 1-d window whose input span per 32 outputs exceeds the staged 12288 floats (stride 400) is not tiled."""
    from kernelfuse.codegen.pool import MAX_TILE_SPAN, last_dim_only
    from kernelfuse.ops.reductions import PoolWindow

    narrow = PoolWindow((1, 8), (1, 4), (0, 0), (1, 1))
    wide = PoolWindow((1, 8), (1, 400), (0, 0), (1, 1))
    assert last_dim_only(narrow, (2, 3, 1, 20000), (2, 3, 1, 4999))
    assert not last_dim_only(wide, (2, 3, 1, 20000), (2, 3, 1, 50)) and 31 * 400 + 8 > MAX_TILE_SPAN
