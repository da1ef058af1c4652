"""Which candidate file answers which problem (`bench --candidates DIR`).

Two namings are accepted: KernelBench's run folders (`level_2_problem_56_sample_0_kernel.py`, the lowest sample
when several exist) and a plain `<problem-stem>.py`. Either may be a `.txt` model reply instead: the judge takes
its last fenced python block.
"""

from __future__ import annotations

import re
from pathlib import Path

from kernelfuse.suite.discover import SuiteProblem

SUFFIXES = (".py", ".txt")
KB_NAME = re.compile(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.(py|txt)$")


def find_candidate(problem: SuiteProblem, folder: Path) -> Path | None:
    """The candidate for `problem` in `folder` (KernelBench naming first, then `<stem>.py|.txt`), or None."""
    if problem.level is not None and problem.problem_id is not None:
        samples = []
        for path in folder.glob(f"level_{problem.level}_problem_{problem.problem_id}_sample_*_kernel.*"):
            match = KB_NAME.match(path.name)
            if match and int(match.group(1)) == problem.level and int(match.group(2)) == problem.problem_id:
                samples.append((int(match.group(3)), match.group(4) != "py", path))
        if samples:
            return min(samples)[2]
    for folder_try in (folder / f"level{problem.level}", folder) if problem.level is not None else (folder,):
        for suffix in SUFFIXES:
            path = folder_try / f"{problem.name}{suffix}"
            if path.is_file():
                return path
    return None


def sample_id(candidate: Path | None) -> int | None:
    """The KernelBench sample id of a run-folder candidate, else None."""
    match = KB_NAME.match(candidate.name) if candidate is not None else None
    return int(match.group(3)) if match else None
