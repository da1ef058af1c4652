"""The CPU check compares outputs a chunk at a time and reports running out of memory as `skipped`.

A level-2 problem (a 3-d transposed convolution) has a 434 MB output even at the check's batch of 2: comparing
it through float64 copies took 3.5 GB more and ended in an internal error under a 4 GB limit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import kernelfuse.cpucheck as cpucheck
from kernelfuse.capture import build_model, capture
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

FIXTURES = Path(__file__).parent / "fixtures" / "problems"


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cpucheck, "COMPARE_CHUNK", 7)  # several chunks and a ragged last one


def test_max_abs_diff_matches_the_whole_tensor_computation(small_chunks):
    torch.manual_seed(0)
    a = torch.randn(5, 9).t()  # not contiguous
    b = torch.randn(9, 5)
    expected = (a.double() - b.double()).abs().max().item()
    assert cpucheck.max_abs_diff(a, b) == expected
    assert cpucheck.max_abs_diff(a, None) == a.double().abs().max().item()
    assert cpucheck.max_abs_diff(a[:0], b[:0]) == 0.0


def test_max_abs_diff_nan_and_inf(small_chunks):
    a, b = torch.zeros(20), torch.zeros(20)
    a[3], a[17] = float("nan"), 5.0
    assert math.isnan(cpucheck.max_abs_diff(a, b))
    assert cpucheck.max_abs_diff(a, b, ignore_nan=True) == 5.0
    a[11] = float("inf")
    assert cpucheck.max_abs_diff(a, b, ignore_nan=True) == torch.finfo(torch.float64).max


def test_compare_finds_a_mismatch_in_the_last_chunk(small_chunks):
    e = torch.rand(4, 6)
    g = e.clone()
    g[3, 5] += 1e-3
    check = cpucheck.compare("v", e, [g], [e])
    assert not check.ok and "mismatch" in check.note and check.max_abs_err == pytest.approx(1e-3, rel=1e-3)
    assert cpucheck.compare("v", e, [e.clone()], [e]).ok


def test_running_out_of_memory_anywhere_in_the_check_is_a_skip(monkeypatch):
    problem = load_problem(FIXTURES / "tiny_forward_constant.py")
    model = build_model(problem)
    graph = rewrite(capture(problem, model))
    plans = plan_variants(graph)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(cpucheck, "compare", no_memory)
    checks = cpucheck.check_plans(problem, model, graph, plans)
    assert checks and all(c.skipped and not c.ok and "ran out of memory" in c.note for c in checks)
    monkeypatch.setattr(cpucheck, "compare", lambda *a: (_ for _ in ()).throw(RuntimeError("a real bug")))
    checks = cpucheck.check_plans(problem, model, graph, plans)  # a bug of the check: skipped (never a pass)
    assert checks and all(c.skipped and not c.ok and "raised RuntimeError: a real bug" in c.note for c in checks)
