"""The timing phase inside the worker: candidate, eager and torch.compile alternating over a pool of input sets.

Each requested torch.compile baseline (default mode, reduce-overhead, max-autotune-no-cudagraphs) is compiled first
(its compile time measured), then every version gets warm-up calls, then rounds of timed calls in a Williams order
(bench.alternate: each version runs after every other equally often). The candidate's timed calls are checked as
they happen (judge.timedcheck: fresh inputs, plain outputs, device state, sampled comparison with the reference).
Afterwards:
the host-time cross-check and the floor estimate; a runtime below `implausible_margin` x the floor is a verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernelfuse.bench import (
    Floor,
    Timer,
    below_floor,
    capped_by,
    escaped_work,
    floor_estimate,
    measure_ceilings,
    summarize,
    time_alternating,
)
from kernelfuse.bench.anchors import record_anchors, time_anchors
from kernelfuse.judge.calls import Models, TrialSettings
from kernelfuse.judge.guard import Snapshot, new_threads, python_threads
from kernelfuse.judge.options import COMPILE_MODES
from kernelfuse.judge.timedcheck import TimedInputs
from kernelfuse.judge.trials import Probe
from kernelfuse.load import Problem


@dataclass(frozen=True)
class TimingReport:
    """Per-version statistics (ms), compile seconds, and what the cross-checks found."""

    stats: dict[str, dict[str, float]]
    compile_s: float | None
    compile_error: str | None
    escape: str | None
    threads: tuple[str, ...]
    patched: tuple[str, ...]
    floor: dict[str, Any] | None
    warnings: tuple[str, ...] = field(default=())
    input_sets: int = 1
    checked_calls: int = 0
    failure: tuple[str, str] | None = None
    implausible: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # where the stage's time went: compile, samples, floor
    compile_seconds: dict[str, float] = field(default_factory=dict)  # first-call seconds of each compile baseline
    anchors: dict[str, Any] | None = None  # the forward's library anchors timed alone (kernelfuse.bench.anchors)

    def to_dict(self) -> dict[str, Any]:
        return {"stats": self.stats, "compile_s": self.compile_s, "compile_error": self.compile_error,
                "escape": self.escape, "threads": list(self.threads), "patched": list(self.patched),
                "floor": self.floor, "warnings": list(self.warnings), "input_sets": self.input_sets,
                "checked_calls": self.checked_calls, "failure": list(self.failure) if self.failure else None,
                "implausible": self.implausible, "seconds": self.seconds, "compile_seconds": self.compile_seconds,
                "anchors": self.anchors}


def run_timing(problem: Problem, models: Models, settings: TrialSettings, probe: Probe, timer: Timer,
               baselines: tuple[str, ...], reps: int, warmup: int, input_sets: int = 4,
               implausible_margin: float = 0.5) -> TimingReport:
    """Time the candidate and the requested baselines (options.BASELINES) alternating, then cross-check."""
    device = settings.device
    clock = time.perf_counter()
    seconds: dict[str, float] = {}
    pool = TimedInputs(problem, models, settings, ["candidate", *baselines], input_sets, reps)
    own = {name: pool.own[name][0] for name in pool.own}
    runners: dict[str, Callable[[], Any]] = {"candidate": lambda: models.candidate(*own["candidate"])}
    flags = {"candidate": settings.candidate_flags}
    warnings: list[str] = []
    # under the bf16 policy the baselines run as the candidate was made: eager and torch.compile under CUDA autocast
    autocast = settings.policy.autocast if device.type == "cuda" else None

    def under_autocast(run: Callable[[], Any]) -> Callable[[], Any]:
        if autocast is None:
            return run

        def autocast_run() -> Any:
            with torch.autocast(device.type, dtype=autocast):
                return run()
        return autocast_run

    if "eager" in baselines:
        runners["eager"] = under_autocast(lambda: models.reference(*own["eager"]))
        flags["eager"] = settings.default_flags
    compile_error = None
    compile_seconds: dict[str, float] = {}
    for name in (b for b in baselines if b in COMPILE_MODES):
        settings.default_flags.apply()
        compiled = torch.compile(models.reference, mode=COMPILE_MODES[name])
        try:
            start = time.perf_counter()
            under_autocast(lambda compiled=compiled, name=name: compiled(*own[name]))()
            timer.clock.synchronize()
            compile_seconds[name] = round(time.perf_counter() - start, 3)
            runners[name] = under_autocast(lambda compiled=compiled, name=name: compiled(*own[name]))
            flags[name] = settings.default_flags
        except Exception as err:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            error = f"{type(err).__name__}: {str(err)[:500]}"
            compile_error = compile_error or f"{name}: {error}"
            warnings.append(f"torch.compile baseline {name} (mode {COMPILE_MODES[name] or 'default'}) failed: {error}")

    seconds["inputs_and_compile"] = round(time.perf_counter() - clock, 3)
    clock = time.perf_counter()
    snapshot = Snapshot.take()
    threads_seen: list[str] = []
    before = python_threads()

    # the same work around every version's timed call (what it leaves in caches is then the same for all);
    # only the candidate's threads and device state are judged
    def before_call(name: str) -> None:
        flags[name].apply()
        own[name] = pool.inputs(name)
        pool.before_call(name)

    def after_call(name: str) -> None:
        threads = new_threads(before)
        if name == "candidate":
            threads_seen.extend(t for t in threads if t not in threads_seen)
        pool.after_call(name)

    def on_result(name: str, result: Any) -> None:
        if name == "candidate":
            pool.check_result(result)

    samples = time_alternating(runners, timer, reps, warmup, after_call=after_call, before_call=before_call,
                               on_result=on_result)
    settings.default_flags.apply()
    patched = tuple(snapshot.changes())
    stats = {name: summarize([s.event_ms for s in values]).to_dict() for name, values in samples.items()}
    for name, values in samples.items():
        stats[name]["host_median"] = summarize([s.host_ms for s in values]).median
    escape = escaped_work(samples["candidate"], samples.get("eager", []))
    seconds["samples"] = round(time.perf_counter() - clock, 3)
    clock = time.perf_counter()

    floor: Floor | None = None
    if device.type == "cuda":
        kind = {"strict": "tf32" if settings.uses_tf32 else "fp32", "tf32": "tf32", "bf16": "bf16"}.get(
            settings.policy.name, "fp32")
        try:
            floor = floor_estimate(probe.flops, probe.min_bytes, measure_ceilings(timer, kind))
            for name in ("eager", *COMPILE_MODES):
                if name in stats:
                    floor = capped_by(floor, stats[name]["median"])
        except Exception as err:  # noqa: BLE001 - no floor is a missing number, not a failure
            warnings.append(f"floor estimate failed: {type(err).__name__}: {err}")
    seconds["floor"] = round(time.perf_counter() - clock, 3)
    clock = time.perf_counter()
    anchors = None
    if device.type == "cuda":
        try:  # on the inputs eager was timed with, under eager's flags (restored after the samples)
            calls = record_anchors(lambda: models.reference(*own.get("eager", own["candidate"])))
            anchors = time_anchors(calls, timer, device) if calls else None
        except Exception as err:  # noqa: BLE001 - a missing reference number, not a failure
            warnings.append(f"timing the bare anchors failed: {type(err).__name__}: {err}")
    seconds["anchors"] = round(time.perf_counter() - clock, 3)
    implausible = None
    if floor is not None:
        implausible = below_floor(stats["candidate"]["median"], floor, implausible_margin, "implausible")
        slow = None if implausible else below_floor(stats["candidate"]["median"], floor)
        if slow:
            warnings.append(slow)
    return TimingReport(stats, compile_seconds.get("compile"), compile_error, escape, tuple(threads_seen), patched,
                        floor.to_dict() if floor else None, tuple(warnings), pool.sets, pool.n_checked,
                        pool.failure, implausible, seconds, compile_seconds, anchors)
