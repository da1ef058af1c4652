"""Find the problems of a suite: problem files, folders of them, or a KernelBench checkout (levelN subfolders).

KernelBench names a problem `<id>_<Name>.py` inside `level<L>/`; level and id come from there (they key the
KernelBench run-folder naming of candidates and the per-level summary). Any other `.py` file is a problem with no
level or id. Files are only named here, never imported: a broken problem becomes that problem's record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kernelfuse.errors import KernelfuseError

LEVEL_DIR = re.compile(r"^level_?(\d+)$")
PROBLEM_FILE = re.compile(r"^(\d+)_(.+)\.py$")


class SuiteError(KernelfuseError):
    """The suite cannot start (no problems found, a path that does not exist, bad options)."""

    exit_code = 2


@dataclass(frozen=True)
class SuiteProblem:
    """One problem of a suite. `key` identifies its record (stable across runs, used by --resume)."""

    path: Path
    level: int | None
    problem_id: int | None

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def key(self) -> str:
        return f"level{self.level}/{self.name}" if self.level is not None else self.name


def discover(paths: list[Path], levels: tuple[int, ...] = ()) -> list[SuiteProblem]:
    """The problems under `paths` in a stable order (level, id, name); `levels` keeps only those levels."""
    found: dict[Path, SuiteProblem] = {}
    for path in paths:
        if not path.exists():
            raise SuiteError(f"{path} does not exist: give problem files, folders or a KernelBench checkout")
        for problem in _problems_under(path):
            found.setdefault(problem.path.resolve(), problem)
    problems = [p for p in found.values() if not levels or p.level in levels]
    if not problems:
        where = ", ".join(str(p) for p in paths)
        only = f" at level(s) {','.join(map(str, levels))}" if levels else ""
        raise SuiteError(f"no problem files (.py){only} under {where}: check the paths and --levels")
    return sorted(problems, key=lambda p: (p.level or 0, p.problem_id or 0, p.name))


def _problems_under(path: Path) -> list[SuiteProblem]:
    if path.is_file():
        return [_problem(path)]
    level_dirs = sorted(d for d in path.iterdir() if d.is_dir() and LEVEL_DIR.match(d.name))
    if level_dirs:  # a KernelBench checkout root (or its KernelBench/ folder)
        return [_problem(f) for d in level_dirs for f in sorted(d.glob("*.py"))]
    nested = path / "KernelBench"
    if nested.is_dir():
        return _problems_under(nested)
    return [_problem(f) for f in sorted(path.glob("*.py")) if not f.name.startswith("__")]


def _problem(path: Path) -> SuiteProblem:
    level_match = LEVEL_DIR.match(path.parent.name)
    file_match = PROBLEM_FILE.match(path.name)
    level = int(level_match.group(1)) if level_match else None
    problem_id = int(file_match.group(1)) if file_match and level is not None else None
    return SuiteProblem(path, level, problem_id)
