"""`bench --ray` on a local CPU cluster: the same records as the local pool; a clear error without Ray."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from suite_support import EXPECTED_STATUS, candidates_folder, kernelbench_tree

from kernelfuse.suite import ray_pool
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
        # a worker serves more than one task holding a GPU share (Ray's default retires it after one): one
        # build's process also runs the next build and the judges, instead of a fresh Python importing torch
        shares = ray_pool.task_options(cpu_only=False)
        pids = [ray.get(ray.remote(**shares[phase])(lambda: os.getpid()).remote())
                for phase in ("build", "build", "judge")]
        assert len(set(pids)) == 1, pids
    finally:
        ray.shutdown()
    ran = [r for r in records if r["status"] != "no_candidate"]
    assert ran and len(records) == len(EXPECTED_STATUS)
    assert all(r["worker"].startswith("ray:") for r in ran)
    assert all(r["build_phase"] is not None for r in ran), [r["build_phase"] for r in ran]


def test_phase_children_get_the_drivers_threads_not_rays_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray sets OMP_NUM_THREADS to a task's CPU count (1 for a judge); a phase's child must run as in the local
    pool, with the driver's setting (here none)."""
    ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'kernelfuse[ray]'")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    import subprocess

    from kernelfuse.judge.runner import child_env

    def child_threads(undo: bool) -> str:
        if undo:
            ray_pool._threads_as_driver(None)
        code = "import os; print(os.environ.get('OMP_NUM_THREADS'))"
        return subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                              check=True).stdout.strip()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(ray_pool.__file__).parents[2])}})
    try:
        task = ray.remote(num_cpus=1)(child_threads)
        assert ray.get(task.remote(False)) == "1"  # Ray's setting, which the fix undoes
        assert ray.get(task.remote(True)) == "None"
    finally:
        ray.shutdown()
