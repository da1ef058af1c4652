"""Run one phase of one problem (`kernelfuse.suite.job`) in a child process with a wall-clock limit.

The child gets its own session, so a hung compiler or a faulting candidate is killed with its whole process group
and the suite goes on. What the child reported, how it ended and the tail of its log come back as a ChildResult.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelfuse.judge.runner import child_env, kill_group, run_module
from kernelfuse.suite.job import JobSpec

LOG_TAIL_CHARS = 2000
MARGIN_S = 60.0  # past the judge's own limit (at most half of it), so a timed-out candidate still gets a verdict


@dataclass(frozen=True)
class ChildResult:
    """How one phase ended: its exit status (negative: a signal), whether it was killed at the limit, what it
    wrote (empty when it died first) and the end of its output."""

    phase: str
    returncode: int | None
    timed_out: bool
    wall_s: float
    result: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""
    started: str = "spawned"  # "forked" from the judge's zygote, or "spawned" with python -m

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ChildResult:
        return ChildResult(**data)


class Children:
    """The running children of a suite, so an interrupted suite kills them all (each by its process group)."""

    def __init__(self) -> None:
        self._groups: set[int] = set()
        self._lock = threading.Lock()
        self.cancelled = False

    def run(self, spec: JobSpec, phase: str, workdir: Path, timeout_s: float,
            cuda_devices: str | None = None) -> ChildResult:
        """Run `phase` of `spec` in a child (forked warm from the judge's zygote where one is up); CUDA_VISIBLE_DEVICES
        is set to `cuda_devices` when given."""
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path, result_path, log_path = workdir / "spec.json", workdir / f"{phase}.json", workdir / f"{phase}.log"
        spec.save(spec_path)
        result_path.unlink(missing_ok=True)
        env = child_env()
        if cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices
        if self.cancelled:
            return ChildResult(phase, None, False, 0.0, {"error": "cancelled"})
        groups: list[int] = []

        def started(pid: int) -> None:
            with self._lock:
                self._groups.add(pid)
                groups.append(pid)
                if self.cancelled:
                    kill_group(pid)

        start = time.monotonic()
        try:
            ended = run_module("kernelfuse.suite.job", [str(spec_path), str(result_path), phase], workdir, env,
                               log_path, timeout_s + min(MARGIN_S, timeout_s / 2), started)
        finally:
            with self._lock:
                self._groups.difference_update(groups)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return ChildResult(phase, ended.returncode, ended.timed_out, round(time.monotonic() - start, 3), result, tail,
                           ended.started)

    def cancel(self) -> None:
        """Kill every running child and start no new one."""
        with self._lock:
            self.cancelled = True
            for pid in list(self._groups):
                kill_group(pid)
