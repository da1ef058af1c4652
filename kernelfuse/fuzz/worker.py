"""A long-lived child process answering JSON lines: the fuzzer's guard against a model that kills or hangs the
process running it (a segfault inside torch itself has been seen). torch is imported once per child; a child that
dies or stops answering costs only the one task it was on, and the next task starts a fresh one.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from kernelfuse.judge.runner import child_env, kill_group


class Worker:
    """`python -m MODULE`: one JSON task per stdin line, one JSON answer per stdout line; its stderr goes to LOG."""

    def __init__(self, module: str, log: Path) -> None:
        self.module, self.log = module, log
        self.proc: subprocess.Popen | None = None

    def ask(self, task: dict, timeout: float) -> dict | str:
        """The child's answer to `task`, or (a str) why none came: its exit status, or the timeout."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log, "a")  # noqa: SIM115 - the child's stderr, kept open while it runs
            proc = self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, env=child_env(), start_new_session=True)
        ready = True
        try:
            proc.stdin.write(json.dumps(task) + "\n")
            proc.stdin.flush()
            ready = bool(select.select([proc.stdout], [], [], timeout)[0])
            line = proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError):
            line = ""
        if line:
            return json.loads(line)
        if ready:  # the child closed its end: it is exiting, let it say how
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.close()
        return describe_exit(proc.returncode) if ready else f"no answer within {timeout:.0f} s"

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            kill_group(self.proc.pid)
            self.proc.wait()
            self.proc = None


def describe_exit(code: int | None) -> str:
    """`exit 3`, or `killed by signal 11 (SIGSEGV)` for a negative return code."""
    if code is None or code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    return f"killed by signal {-code} ({name})"


def serve(handle: Callable[[dict], tuple[dict, bool]]) -> int:
    """The child's side: answer each stdin task with `handle(task)` -> (answer, go on); 0 at end of input, 3 when
    `handle` says the process is no longer fit to go on. Whatever else prints goes to stderr (the log), never into
    the answers."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    warnings.simplefilter("ignore")
    for line in sys.stdin:
        answer, go_on = handle(json.loads(line))
        answers.write(json.dumps(answer) + "\n")
        if not go_on:
            return 3
    return 0
