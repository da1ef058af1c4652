"""The outcome file a judge worker rewrites at every stage, and how a candidate's error is described in it.

Apart from the worker so the stages it calls (judge.sidechecks) record into the same outcome.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from kernelfuse.judge.diagnose import is_cuda_fault
from kernelfuse.judge.protocol import WorkerRequest, write_outcome


class Failed(Exception):
    """Stop the worker with a failure of `kind` (the outcome already says what)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Outcome:
    """The outcome dict under construction, written to disk at every stage."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"stage": "start", "stages": [], "warnings": [], "failure": None}

    def stage(self, name: str) -> None:
        self.data["stage"] = name
        self.data["stages"].append([name, round(time.time(), 3)])
        self.save()

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def warn(self, message: str) -> None:
        if message not in self.data["warnings"]:
            self.data["warnings"].append(message)
        self.save()

    def fail(self, kind: str, message: str, **extra: Any) -> Failed:
        self.data["failure"] = {"kind": kind, "stage": self.data["stage"], "message": message, **extra}
        self.save()
        return Failed(kind, message)

    def save(self) -> None:
        write_outcome(self.path, self.data)


def describe_error(err: BaseException, candidate_path: str, line_offset: int) -> dict[str, Any]:
    """Message plus the candidate's deepest frame (with its line in the original reply) and a short traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    where = None
    for frame in reversed(frames):
        if frame.filename == candidate_path:
            where = {"line": frame.lineno, "reply_line": (frame.lineno or 0) + line_offset,
                     "code": (frame.line or "").strip()}
            break
    if isinstance(err, SystemExit):
        message = f"the candidate called sys.exit({err.code!r})"
    else:
        message = f"{type(err).__name__}: {err}"
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__)[-12:])
    return {"message": message[:4000], "where": where, "traceback": tb[-6000:]}


def runtime_failure(out: Outcome, request: WorkerRequest, err: BaseException, when: str | None = None) -> Failed:
    info = describe_error(err, request.candidate_path, request.line_offset)
    kind = "cuda_fault" if is_cuda_fault(info["message"]) else "runtime_error"
    if when:
        info["when"] = when
    return out.fail(kind, **info)
