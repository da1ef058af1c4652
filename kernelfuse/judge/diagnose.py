"""Turn a child's log and exit status into a cause a person can act on.

A failed torch extension build prints tens of thousands of compiler lines (seed 003: ~30,000 "error:" lines, all
consequences of one flag). The key lines are the few that name the cause: `#error` directives first, then fatal
errors, then the first distinct errors; a table of known causes turns them into one sentence.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MAX_KEY_LINES = 8
_ERROR = re.compile(r"(\berror\b\s*:|\berror #|fatal error|undefined reference|undefined symbol|ninja: build stopped)",
                    re.IGNORECASE)
_DIRECTIVE = re.compile(r"#error\s+(?P<msg>.*)")
_NEEDS_STD = re.compile(r"C\+\+(?P<std>\d+) or later")
_STD_FLAG = re.compile(r"-std=(?:c|gnu)\+\+(?P<std>\w+)")
_SITE = re.compile(r"\S*?/(?:site|dist)-packages/")
_CUDA_FAULT = re.compile(
    r"illegal memory access|illegal address|unspecified launch failure|device-side assert|misaligned address|"
    r"an illegal instruction|CUDA error|cudaError|CUBLAS_STATUS_EXECUTION_FAILED|CUDNN_STATUS_EXECUTION_FAILED|"
    r"launch timed out|uncorrectable ECC", re.IGNORECASE)
_STD_ORDER = {"98": 1998, "03": 2003, "0x": 2011, "11": 2011, "1y": 2014, "14": 2014, "1z": 2017, "17": 2017,
              "2a": 2020, "20": 2020, "2b": 2023, "23": 2023}


@dataclass(frozen=True)
class BuildDiagnosis:
    """One-sentence cause and the compiler lines that show it."""

    cause: str
    key_lines: tuple[str, ...]


def _shorten(line: str) -> str:
    line = _SITE.sub("", line.strip())
    return line if len(line) <= 240 else line[:237] + "..."


def _std_year(tag: str) -> int:
    return _STD_ORDER.get(tag, 0)


def key_error_lines(lines: Iterable[str], limit: int = MAX_KEY_LINES) -> tuple[list[str], list[str]]:
    """(key lines, failed compile commands) of a build log, streaming (logs can be tens of MB)."""
    directives: list[str] = []
    fatal: list[str] = []
    errors: list[str] = []
    commands: list[str] = []
    seen: set[str] = set()
    expect_command = False
    for raw in lines:
        line = raw.rstrip("\n")
        if expect_command:
            commands.append(line.strip())
            expect_command = False
        if line.startswith("FAILED:"):
            expect_command = True
            continue
        if not _ERROR.search(line):
            continue
        short = _shorten(line)
        message = short.split("error", 1)[-1]
        if message in seen:
            continue
        seen.add(message)
        if _DIRECTIVE.search(line):
            directives.append(short)
        elif "fatal error" in line.lower():
            fatal.append(short)
        elif len(errors) < limit:
            errors.append(short)
    key = (directives + fatal + errors)[:limit]
    return key, commands


def diagnose_build(lines: Iterable[str], flags: Iterable[str] = ()) -> BuildDiagnosis:
    """Key lines of a failed build and the most likely cause; `flags` are the extra flags the candidate passed."""
    key, commands = key_error_lines(lines)
    std_flags = [m.group(0) for text in list(flags) + commands for m in _STD_FLAG.finditer(text)]
    for line in key:
        needs = _NEEDS_STD.search(line)
        if needs:
            need = needs.group("std")
            old = [f for f in std_flags if 0 < _std_year(_STD_FLAG.search(f).group("std")) < _std_year(need)]
            if old:
                return BuildDiagnosis(
                    f"torch's headers require C++{need} or later, but the candidate's compiler flags force {old[-1]} "
                    f"(the last -std flag wins): the extension cannot build", tuple(key))
            return BuildDiagnosis(f"torch's headers require C++{need} or later; the compiler used an older standard",
                                  tuple(key))
    for line in key:
        if "undefined symbol" in line or "undefined reference" in line:
            return BuildDiagnosis(f"link error: {line}", tuple(key))
    if key:
        return BuildDiagnosis(f"compiler error: {key[0]}", tuple(key))
    return BuildDiagnosis("the extension build failed (no compiler error line found; see the log tail)", ())


def diagnose_build_file(path: Path, flags: Iterable[str] = ()) -> BuildDiagnosis:
    """`diagnose_build` over a log file, read line by line."""
    try:
        with open(path, errors="replace") as f:
            return diagnose_build(f, flags)
    except OSError:
        return BuildDiagnosis("the extension build failed (no log)", ())


def is_cuda_fault(message: str) -> bool:
    """Whether an exception message is a CUDA runtime fault (the context is lost; nothing else can run)."""
    return bool(_CUDA_FAULT.search(message))


def describe_exit(returncode: int) -> str:
    """`killed by SIGSEGV (segmentation fault)` or `exited with status 3`."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        meaning = {
            signal.SIGSEGV: "segmentation fault", signal.SIGABRT: "aborted", signal.SIGBUS: "bus error",
            signal.SIGFPE: "floating-point exception", signal.SIGILL: "illegal instruction",
            signal.SIGKILL: "killed: out of memory or by the judge",
        }.get(sig)
        return f"killed by {sig.name}" + (f" ({meaning})" if meaning else "")
    return f"exited with status {returncode}"


def tail(path: Path, n: int = 40, max_bytes: int = 1 << 20) -> str:
    """The last `n` lines of a (possibly huge) log file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-n:])


def fatal_python_lines(log: str, candidate_name: str) -> list[str]:
    """From a faulthandler dump: the "Fatal Python error" line and the candidate's frames."""
    out = [line.strip() for line in log.splitlines() if line.startswith("Fatal Python error")]
    out += [line.strip() for line in log.splitlines() if candidate_name in line and "line" in line][:3]
    return out
