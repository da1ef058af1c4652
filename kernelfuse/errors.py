"""Errors a user can act on: each carries the exit code the CLI returns and a one-line cause."""

from __future__ import annotations


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
