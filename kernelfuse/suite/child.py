"""Run one phase of one problem (`kernelfuse.suite.job`) in a child process with a wall-clock limit.

The child gets its own session, so a hung compiler or a faulting candidate is killed with its whole process group
and the suite goes on. What the child reported, how it ended and the tail of its log come back as a ChildResult.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelfuse.judge.runner import child_env
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ChildResult:
        return ChildResult(**data)


class Children:
    """The running children of a suite, so an interrupted suite kills them all (each by its process group)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.cancelled = False

    def run(self, spec: JobSpec, phase: str, workdir: Path, timeout_s: float,
            cuda_devices: str | None = None) -> ChildResult:
        """Run `phase` of `spec` in a child; CUDA_VISIBLE_DEVICES is set to `cuda_devices` when given."""
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path, result_path, log_path = workdir / "spec.json", workdir / f"{phase}.json", workdir / f"{phase}.log"
        spec.save(spec_path)
        result_path.unlink(missing_ok=True)
        env = child_env()
        if cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices
        start = time.monotonic()
        timed_out = False
        with open(log_path, "wb") as log:
            with self._lock:
                if self.cancelled:
                    return ChildResult(phase, None, False, 0.0, {"error": "cancelled"})
                proc = subprocess.Popen([sys.executable, "-m", "kernelfuse.suite.job", str(spec_path),
                                         str(result_path), phase], stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=str(workdir), env=env, start_new_session=True)
                self._procs.add(proc)
            try:
                returncode: int | None = proc.wait(timeout=timeout_s + min(MARGIN_S, timeout_s / 2))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                returncode = proc.wait()
            finally:
                _kill(proc)  # anything the problem left running in its group
                with self._lock:
                    self._procs.discard(proc)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return ChildResult(phase, returncode, timed_out, round(time.monotonic() - start, 3), result, tail)

    def cancel(self) -> None:
        """Kill every running child and start no new one."""
        with self._lock:
            self.cancelled = True
            for proc in list(self._procs):
                _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
