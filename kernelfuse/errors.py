"""Errors a user can act on: each carries the exit code the CLI returns and a one-line cause."""

from __future__ import annotations

from dataclasses import dataclass


class KernelfuseError(Exception):
    """Base class: `str(err)` is the one-line message the CLI prints; `exit_code` is what it exits with."""

    exit_code = 1


class ProblemError(KernelfuseError):
    """The problem file cannot be used (missing, syntax error, missing names, constructor raises)."""

    exit_code = 2


class CaptureError(KernelfuseError):
    """The model's forward could not be traced to ATen ops."""

    exit_code = 3


class UsageError(KernelfuseError):
    """The command line names something unusable (an output path that cannot be written, a missing candidate)."""

    exit_code = 2


@dataclass(frozen=True)
class Fallback:
    """A part of the model kernelfuse does not compile: that part runs the original ops (never a refusal).
    `stage` found it (load, capture, ...), `what` names the part, `reason` says why."""

    stage: str
    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.stage}: {self.what}: {self.reason}"


class Unsupported(CaptureError):
    """Capture met something it does not compile (an argument or output type, a large tensor made in forward): the
    original module ships for it, with `fallback` as the reason printed and reported."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(str(fallback))
        self.fallback = fallback
