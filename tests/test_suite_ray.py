"""`bench --ray` on a local CPU cluster: the same records as the local pool; a clear error without Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from suite_support import EXPECTED_STATUS, candidates_folder, kernelbench_tree

from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.ray_pool import import_ray
from kernelfuse.suite.records import read_records
from kernelfuse.suite.run import SuiteOptions, run_suite


def test_missing_ray_is_a_one_line_error_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(SuiteError, match=r"pip install 'kernelfuse\[ray\]'"):
        import_ray()


def test_ray_local_cpu_cluster_gives_the_same_records(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'kernelfuse[ray]'")
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "cands")
    options = SuiteOptions(jsonl=tmp_path / "ray.jsonl", candidates=cands, ray=True, cpu_only=True,
                           baselines=("eager",), timeout_s=120)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        records, summary = run_suite([root], options, log=lambda s: None)
    finally:
        ray.shutdown()
    assert {r["key"]: r["status"] for r in read_records(options.jsonl)} == EXPECTED_STATUS
    ran = [r for r in records if r["status"] != "no_candidate"]
    assert all(r["worker"].startswith("ray:") for r in ran)
    assert {r["judge_started"] for r in ran} == {"forked"}  # warm, from the node's zygote
    assert all(r["problem_path"].startswith(str(root)) for r in records)  # the suite's paths, not the node's copy
    assert {s.level: s.correct for s in summary.levels} == {"level1": 2, "level2": 0, "all": 2}


def test_ray_builds_run_as_tasks_of_their_own_then_judges_on_their_node(tmp_path: Path) -> None:
    """The GPU path's scheduling, on a CPU cluster that declares one (absent) GPU: every problem gets a build
    task and then a judge task (both phases recorded), so builds can run ahead of the GPUs as in the local pool.
    Without CUDA the judges cannot time anything; what is checked is that each problem has its record."""
    ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'kernelfuse[ray]'")
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "cands")
    options = SuiteOptions(jsonl=tmp_path / "ray.jsonl", candidates=cands, ray=True, baselines=("eager",),
                           timeout_s=120)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        records, _ = run_suite([root], options, log=lambda s: None)
    finally:
        ray.shutdown()
    ran = [r for r in records if r["status"] != "no_candidate"]
    assert ran and len(records) == len(EXPECTED_STATUS)
    assert all(r["worker"].startswith("ray:") for r in ran)
    assert all(r["build_phase"] is not None for r in ran), [r["build_phase"] for r in ran]
