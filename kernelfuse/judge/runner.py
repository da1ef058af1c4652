"""Run the worker in a child process with a wall-clock limit; kill its whole process group when time is up.

The child runs in a new session, so the compiler processes of an extension build and anything the candidate spawns
are in its process group: one `killpg` ends them all. It is also killed after a normal exit, in case the candidate
left a process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kernelfuse
from kernelfuse.judge.protocol import read_outcome

KILL_WAIT_S = 60.0


@dataclass(frozen=True)
class ChildRun:
    """How the child ended: exit status (negative: signal), whether the judge killed it, and what it reported."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    log_path: Path
    outcome: dict[str, Any] = field(default_factory=dict)


def package_root() -> Path:
    """The folder that holds the `kernelfuse` package (put on the child's PYTHONPATH)."""
    return Path(kernelfuse.__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The parent's environment plus the package root on PYTHONPATH, unbuffered output and faulthandler."""
    env = dict(os.environ)
    root = str(package_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_worker(request_path: Path, outcome_path: Path, log_path: Path, timeout_s: float) -> ChildRun:
    """Start `python -m kernelfuse.judge.worker REQUEST`, wait at most `timeout_s`, and collect its outcome."""
    start = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernelfuse.judge.worker", str(request_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=str(request_path.parent),
            env=child_env(), start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            try:
                returncode = proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                returncode = None
        _kill_group(proc.pid)
    return ChildRun(returncode, timed_out, time.monotonic() - start, log_path, read_outcome(outcome_path))
