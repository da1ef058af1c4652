"""Path checks that run before any work: a bad output path is found in milliseconds, not after the capture."""

from __future__ import annotations

import os
from pathlib import Path

from kernelfuse.errors import ProblemError, UsageError


def check_output_path(problem: Path, out: Path) -> Path:
    """`out` if a file can be written there (its missing parent folders are created), else a UsageError."""
    if out.exists() and out.is_dir():
        raise UsageError(f"-o {out}: is a directory; give a file name, e.g. -o {out / (problem.stem + '_new.py')}")
    if out.exists() and problem.exists() and out.resolve() == problem.resolve():
        raise UsageError(f"-o {out}: is the problem file itself; refusing to overwrite it (choose another name)")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"-o {out}: {parent} is a file, not a folder; choose an output path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"-o {out}: not writable (permission denied); choose a path you can write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"-o {out}: cannot create its folder ({err.strerror}); choose another path") from None
    return out


def read_source(path: Path, what: str = "problem file") -> str:
    """The UTF-8 text of a Python file, or a ProblemError saying why it cannot be one."""
    if path.is_dir():
        raise ProblemError(f"{path}: is a directory, not a {what}")
    if not path.is_file():
        raise ProblemError(f"{path}: no such file (check the path)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ProblemError(f"{path}: cannot read the {what} ({err.strerror}); check its permissions") from None
    if b"\0" in data:
        raise ProblemError(f"{path}: is a binary file, not a Python {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProblemError(f"{path}: not UTF-8 text (byte {err.start}); save the {what} as UTF-8") from None
