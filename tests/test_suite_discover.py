"""Which problems a suite holds, and which candidate file answers which problem."""

from __future__ import annotations

from pathlib import Path

import pytest
from judge_support import TINY
from suite_support import kernelbench_tree

from kernelfuse.suite.candidates import find_candidate, sample_id
from kernelfuse.suite.discover import SuiteError, discover


def test_kernelbench_checkout_gives_levels_ids_and_stable_keys(tmp_path: Path) -> None:
    root = kernelbench_tree(tmp_path / "KernelBench")
    problems = discover([root])
    assert [p.key for p in problems] == ["level1/1_TinyGemmA", "level1/2_TinyGemmB", "level2/1_TinyGemmC",
                                         "level2/3_TinyGemmD"]
    assert [(p.level, p.problem_id) for p in problems] == [(1, 1), (1, 2), (2, 1), (2, 3)]
    assert [p.key for p in discover([tmp_path])] == [p.key for p in problems]  # the repo root above KernelBench/
    assert [p.key for p in discover([root], levels=(2,))] == ["level2/1_TinyGemmC", "level2/3_TinyGemmD"]


def test_files_and_plain_folders_and_duplicates(tmp_path: Path) -> None:
    root = kernelbench_tree(tmp_path)
    single = discover([root / "level2" / "3_TinyGemmD.py", root / "level2"])  # named twice: listed once
    assert [p.key for p in single] == ["level2/1_TinyGemmC", "level2/3_TinyGemmD"]
    plain = discover([TINY])
    assert plain[0].level is None and plain[0].problem_id is None and plain[0].key == "tiny_gemm_add_relu"


def test_nothing_found_or_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="does not exist"):
        discover([tmp_path / "nope"])
    with pytest.raises(SuiteError, match="no problem files"):
        discover([kernelbench_tree(tmp_path)], levels=(3,))
    assert SuiteError("x").exit_code == 2


def test_candidate_naming_kernelbench_runs_then_plain(tmp_path: Path) -> None:
    problems = {p.key: p for p in discover([kernelbench_tree(tmp_path / "kb")])}
    cands = tmp_path / "cands"
    cands.mkdir()
    for name in ("level_1_problem_1_sample_3_kernel.py", "level_1_problem_1_sample_1_kernel.py",
                 "level_1_problem_11_sample_0_kernel.py", "level_2_problem_1_sample_0_kernel.txt",
                 "2_TinyGemmB.py", "3_TinyGemmD.txt"):
        (cands / name).write_text("")
    got = {key: find_candidate(p, cands) for key, p in problems.items()}
    assert got["level1/1_TinyGemmA"].name == "level_1_problem_1_sample_1_kernel.py"  # lowest sample, not id 11
    assert sample_id(got["level1/1_TinyGemmA"]) == 1
    assert got["level2/1_TinyGemmC"].name == "level_2_problem_1_sample_0_kernel.txt"
    assert got["level1/2_TinyGemmB"].name == "2_TinyGemmB.py" and sample_id(got["level1/2_TinyGemmB"]) is None
    assert got["level2/3_TinyGemmD"].name == "3_TinyGemmD.txt"
    (cands / "level2").mkdir()
    (cands / "level2" / "3_TinyGemmD.py").write_text("")  # a per-level subfolder wins over the flat name
    assert find_candidate(problems["level2/3_TinyGemmD"], cands) == cands / "level2" / "3_TinyGemmD.py"
    assert find_candidate(discover([TINY])[0], cands) is None
