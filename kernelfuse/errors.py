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
    """A part of the model that ships as its original ops (a stage failed on it, or capture met something it does not
    compile): which stage, what it was working on, and the one-line reason. Never a refusal: the run still succeeds;
    the CLI prints each one and `--json` lists them under `fallbacks`."""

    stage: str  # "load", "capture", "rewrite", "plan", "codegen", "emit" or "compile"
    what: str  # the rule, kernel, variant, argument or model the stage gave up on
    reason: str

    def describe(self) -> str:
        return f"{self.stage} fell back on {self.what}: {self.reason}"

    def __str__(self) -> str:
        return self.describe()


def one_line(err: BaseException) -> str:
    """`Type: first line of the message` (an AssertionError without a message still says what raised)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class Unsupported(CaptureError):
    """Capture met something it does not compile (an argument or output type, a large tensor made in forward): the
    original module ships for it, with `fallback` as the reason printed and reported."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(str(fallback))
        self.fallback = fallback
