"""Small suites for the bench tests, built in a temporary folder from the judge's own fixtures (never from
KernelBench files): a KernelBench-shaped tree with levels, and a candidates folder in its run-folder naming."""

from __future__ import annotations

import shutil
from pathlib import Path

from judge_support import CANDIDATES, TINY

GOOD = (CANDIDATES / "good.py").read_text()


def kernelbench_tree(root: Path) -> Path:
    """root/level1/{1,2}_*.py and root/level2/{1,3}_*.py, all the tiny gemm+add+relu problem."""
    for level, names in ((1, ("1_TinyGemmA", "2_TinyGemmB")), (2, ("1_TinyGemmC", "3_TinyGemmD"))):
        folder = root / f"level{level}"
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(TINY, folder / f"{name}.py")
    return root


def candidates_folder(root: Path) -> Path:
    """Candidates for kernelbench_tree: a good file, a good text reply, a wrong one; level 2 problem 3 has none."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "level_1_problem_1_sample_0_kernel.py").write_text(GOOD)
    (root / "level_1_problem_2_sample_0_kernel.txt").write_text(f"Here is my kernel:\n```python\n{GOOD}```\n")
    shutil.copy(CANDIDATES / "wrong_output.py", root / "level_2_problem_1_sample_0_kernel.py")
    return root


EXPECTED_STATUS = {"level1/1_TinyGemmA": "ok", "level1/2_TinyGemmB": "ok", "level2/1_TinyGemmC": "incorrect",
                   "level2/3_TinyGemmD": "no_candidate"}
