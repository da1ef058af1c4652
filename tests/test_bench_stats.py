"""Timing helpers on fake numbers and the CPU timer: statistics, rotation, cross-check, floor."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kernelfuse.bench import (
    Ceilings,
    Clock,
    Sample,
    Timer,
    balanced_orders,
    below_floor,
    count_flops,
    escaped_work,
    floor_estimate,
    min_bytes,
    percentile,
    speedup,
    summarize,
    time_alternating,
)


def test_summarize_matches_numpy_style_percentiles():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    s = summarize(values)
    assert (s.n, s.median, s.min, s.max) == (6, 3.5, 1.0, 10.0)
    assert s.p25 == pytest.approx(2.25) and s.p75 == pytest.approx(4.75)
    assert s.iqr == pytest.approx(2.5) and s.spread_pct == pytest.approx(100 * 2.5 / 3.5)
    assert s.std == pytest.approx(math.sqrt(sum((v - 25 / 6) ** 2 for v in values) / 5))
    assert "3.500 ms (IQR 2.250-4.750" in s.describe()
    assert summarize([2.0]).std == 0.0
    with pytest.raises(ValueError):
        summarize([])


def test_percentile_and_speedup():
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([1.0, 3.0], 25) == 1.5
    assert speedup(2.0, 1.0) == 2.0 and speedup(None, 1.0) is None and speedup(1.0, 0.0) is None


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_version_runs_first_and_after_every_other_equally_often(n):
    names = [f"v{i}" for i in range(n)]
    orders = balanced_orders(names)
    assert all(sorted(order) == names for order in orders)
    assert len({order[0] for order in orders}) == n and len(orders) % n == 0
    after = Counter((a, b) for order in orders for a, b in zip(order, order[1:], strict=False))
    assert set(after) == {(a, b) for a in names for b in names if a != b}
    assert len(set(after.values())) == 1  # a rotation of [c, e, k] puts c after k in every round


def test_identical_versions_time_alike_when_the_previous_call_slows_the_next():
    """The host-cache effect of a heavy version (torch.compile's Python) on the call after it, simulated: a version
    run after `heavy` takes 2 units, otherwise 1. Two identical versions must get the same mean time."""
    previous: list[str] = ["heavy"]
    clock = {"t": 0.0}

    def runner(name: str):
        def run() -> None:
            clock["t"] += 2.0 if previous[0] == "heavy" and name != "heavy" else 1.0
            previous[0] = name
        return run

    fake = Clock(lambda: clock["t"] / 1e3, lambda: None, None, None, None)
    runners = {name: runner(name) for name in ("candidate", "eager", "heavy")}
    samples = time_alternating(runners, Timer(torch.device("cpu"), clock=fake, flush=False), reps=24, warmup=1)
    mean = {name: sum(s.host_ms for s in values) / len(values) for name, values in samples.items()}
    assert mean["candidate"] == pytest.approx(mean["eager"])


def test_escape_cross_check():
    eager = [Sample(2.70, 2.73)] * 20
    honest = [Sample(2.80, 2.83)] * 20
    side_stream = [Sample(0.04, 2.75)] * 20
    assert escaped_work(honest, eager) is None
    message = escaped_work(side_stream, eager)
    assert message.startswith("timing escape: CUDA events measured 0.040 ms") and "side stream" in message
    assert escaped_work([], eager) is None
    assert escaped_work(honest, []) is None  # no baseline: the gap is compared with zero
    assert "more than a synchronise takes" in escaped_work(side_stream, [])


def test_floor_and_the_suspicion_margin():
    ceilings = Ceilings(flops_per_s=50e12, bytes_per_s=3e12, flop_kind="fp32")
    floor = floor_estimate(flops=2 * 1024 * 8192 * 8192, nbytes=300_000_000, ceilings=ceilings)
    assert floor.bound == "compute" and floor.ms == pytest.approx(2.749, rel=1e-3)
    assert floor.memory_ms == pytest.approx(0.1)
    assert below_floor(2.8, floor) is None
    assert below_floor(0.05, floor).startswith("suspiciously fast: 0.050 ms")
    assert floor.to_dict()["bound"] == "compute" and "GFLOP" in floor.describe()


def test_the_fp32_ceiling_counts_3xtf32_where_it_beats_sgemm():
    """H200 (stop 45): SGEMM 50 TFLOP/s, TF32 385: fp32-accurate products run at 128 (3xTF32), and a correct 3xTF32
    GEMM at 1.65 ms is then above the floor of 1024 x 8192 x 8192 (1.07 ms), not below an SGEMM floor of 2.75."""
    from kernelfuse.bench.floor import fp32_accurate_rate

    flops, kind = fp32_accurate_rate(50e12, 385e12)
    assert kind == "fp32 (3xTF32)" and flops == pytest.approx(128.3e12, rel=1e-3)
    floor = floor_estimate(2 * 1024 * 8192 * 8192, 300_000_000, Ceilings(flops, 3e12, kind))
    assert below_floor(1.65, floor) is None and floor.ms == pytest.approx(1.071, rel=1e-3)
    assert fp32_accurate_rate(50e12, 120e12) == (50e12, "fp32")  # a GPU whose TF32 is under 3x its FMA rate


def test_flops_and_bytes_of_a_linear():
    model = torch.nn.Linear(64, 32, bias=False)
    x = torch.rand(16, 64)
    assert count_flops(lambda: model(x)) == 2 * 16 * 64 * 32
    assert min_bytes(model, [x], model(x)) == 4 * (16 * 64 + 64 * 32 + 16 * 32)


def test_alternating_timer_on_the_cpu():
    calls: list[str] = []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("candidate", "eager")}
    seen: list[str] = []
    samples = time_alternating(runners, Timer(torch.device("cpu"), flush=False), reps=4, warmup=2,
                               after_call=seen.append, before_call=lambda name: None)
    assert {k: len(v) for k, v in samples.items()} == {"candidate": 4, "eager": 4}
    assert calls[:4] == ["candidate", "candidate", "eager", "eager"]  # warm-up
    assert calls[4:] == ["candidate", "eager", "eager", "candidate", "candidate", "eager", "eager", "candidate"]
    assert len(seen) == len(calls)
    assert all(s.event_ms == s.host_ms >= 0 for s in samples["eager"])
