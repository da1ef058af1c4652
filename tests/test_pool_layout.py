"""Pooling kernels that read a channels-last convolution's output pool tiles through shared memory (reads along
the channels, writes along the NCHW positions: both coalesced): checked on the plan, the CUDA text, and the CUDA itself
run in a CPU emulation against the plan interpreter."""

from __future__ import annotations

import subprocess

import pytest
import torch
from emulation_helpers import emulated, emulated_and_interpreted
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.codegen import generate
from kernelfuse.codegen.pool import reads_channels_last

POOLS = """
def __init__(self):
    super().__init__()
    self.c2 = nn.Conv2d(3, 12, 3)
    self.c3 = nn.Conv3d(3, 8, 3, bias=False)

def forward(self, x2, x3):
    return (
        F.avg_pool2d(torch.tanh(self.c2(x2)) - 0.5, 2),  # bias, tanh, sub, then the pool: one kernel
        F.max_pool3d(self.c3(x3), 2, stride=2, padding=1),  # padded windows, a 3-d channels-last source
        F.avg_pool2d(x2, 3, stride=2, padding=1, count_include_pad=False),  # an NCHW input: output order
    )
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    path = write_problem(tmp_path_factory.mktemp("pools"), "pools", POOLS,
                         "[torch.randn(2, 3, 11, 13), torch.randn(2, 3, 7, 8, 6)]",
                         header="import torch.nn.functional as F")
    problem, _, variants = pipeline(path)
    return problem, {p.variant: p for p in variants}


def _pools(plan):
    return [g for g in plan.generated if g.spec is not None and g.spec.kind.endswith("_pool")]


def test_channels_last_sources_pool_through_shared_memory(plans):
    _, by_variant = plans
    assert set(by_variant) == {"fused-nhwc", "fused-nchw"}
    assert [reads_channels_last(g) for g in _pools(by_variant["fused-nhwc"])] == [True, True, False]
    assert [reads_channels_last(g) for g in _pools(by_variant["fused-nchw"])] == [False, False, False]
    cuda = generate(by_variant["fused-nhwc"]).cuda
    assert cuda.count("a channels-last source, staged through shared memory into NCHW") == 2
    assert cuda.count("threads in output order") == 1  # the NCHW input (stride 2: a thread per output)


def test_both_layouts_compute_what_the_model_computes(plans):
    problem, by_variant = plans
    for plan in by_variant.values():  # the CPU convolution adds its bias inside its sum: fp32 rounding apart
        assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_pool_kernels_run_in_a_cpu_emulation(plans, tmp_path):
    """The generated CUDA of every pool, on random sources in the layout the plan gives them, equals the plan
    interpreter's pool of the same values (the same fp32 operations in the same order)."""
    _, by_variant = plans
    for plan in by_variant.values():
        lib = emulated(plan, tmp_path)
        for g in _pools(plan):
            out, expected = emulated_and_interpreted(lib, plan, g)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6, msg=lambda m, k=g.kernel: f"{k}: {m}")


def test_channels_last_pool_kernels_compile_with_nvcc(plans, tmp_path):
    nvcc = _nvcc()
    cu = tmp_path / "pools.cu"
    cu.write_text(generate(plans[1]["fused-nhwc"]).cuda)
    cmd = [nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(cu.with_suffix(".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
