"""`kernelfuse bench` end to end on the CPU: candidates judged in their own processes, a crash or hang of one
problem recorded while the suite goes on, and a run killed midway resumed with no record lost or doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from judge_support import EXAMPLES, REPO, TINY
from suite_support import EXPECTED_STATUS, candidates_folder, kernelbench_tree

from kernelfuse.cli import main
from kernelfuse.suite.records import read_records


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "kernelfuse", "bench", *args]


def test_killed_midway_then_resumed_gives_every_record_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "cands")
    jsonl = tmp_path / "out.jsonl"
    args = [str(root), "--candidates", str(cands), "--jsonl", str(jsonl), "--cpu-only", "--baselines", "eager",
            "--timeout", "120"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(_bench(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # kill the whole suite (its children too) as soon as the first record has landed
        deadline = time.monotonic() + 240
        while not (jsonl.exists() and read_records(jsonl)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = read_records(jsonl)
    assert 1 <= len(first) < len(EXPECTED_STATUS)
    with open(jsonl, "a") as f:  # as if the kill had cut a write short
        f.write('{"key": "level2/3_Tiny')
    assert main(["bench", *args]) == 2  # an existing JSONL is never overwritten without --resume
    assert "--resume" in capsys.readouterr().err
    assert main(["bench", *args, "--resume"]) == 0
    out = capsys.readouterr()
    records = read_records(jsonl)
    assert sorted(r["key"] for r in records) == sorted(EXPECTED_STATUS)  # each problem exactly once
    assert {r["key"]: r["status"] for r in records} == EXPECTED_STATUS
    assert records[: len(first)] == first  # finished records kept as they were
    by_key = {r["key"]: r for r in records}
    good = by_key["level1/2_TinyGemmB"]
    assert good["correctness"] is True and good["compiled"] is True and good["code_from"] != "-"
    assert good["candidate_path"].endswith("level_1_problem_2_sample_0_kernel.txt") and good["sample_id"] == 0
    assert good["runtime"] > 0 and good["ref_runtime"] > 0 and good["speedup_eager"] > 0  # CPU timings recorded
    assert (good["level"], good["problem_id"], good["mode"]) == (1, 2, "judge")
    missing = by_key["level2/3_TinyGemmD"]
    assert missing["correctness"] is False and "level_2_problem_3_sample_0_kernel.py" in missing["reason"]
    assert "level1" in out.out and "fast_1.5" in out.out and "no_candidate 1" in out.out
    assert f"[{len(EXPECTED_STATUS) - len(first)}/{len(EXPECTED_STATUS) - len(first)}]" in out.err  # one per problem


def test_a_problem_that_crashes_or_hangs_its_process_becomes_its_record(tmp_path: Path) -> None:
    probs = tmp_path / "probs"
    probs.mkdir()
    (probs / "a_crashes.py").write_text("import ctypes\nctypes.string_at(0)\n")
    (probs / "b_hangs.py").write_text("while True:\n    pass\n")
    cands = tmp_path / "cands"
    cands.mkdir()
    for name in ("a_crashes", "b_hangs"):
        (cands / f"{name}.py").write_text("")
    jsonl = tmp_path / "r.jsonl"
    started = time.monotonic()
    code = main(["bench", str(probs), str(TINY), "--candidates", str(cands), "--jsonl", str(jsonl), "--cpu-only",
                 "--gpus", "2", "--timeout", "6", "--baselines", ""])
    assert code == 0
    records = {r["key"]: r for r in read_records(jsonl)}
    assert records["a_crashes"]["status"] == "crashed" and "SIGSEGV" in records["a_crashes"]["reason"]
    assert records["b_hangs"]["status"] == "timeout" and records["b_hangs"]["correctness"] is False
    assert records["tiny_gemm_add_relu"]["status"] == "no_candidate"
    # the job processes were forked warm from the judge's server: a crash and a hang still end as their records
    assert records["a_crashes"]["judge_started"] == records["b_hangs"]["judge_started"] == "forked"
    assert time.monotonic() - started < 120  # the hang was cut at its limit, not waited out
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
                .splitlines() if "kernelfuse.suite.job" in line and str(tmp_path) in line]


def test_optimize_without_gpu_writes_files_and_says_not_verified(tmp_path: Path) -> None:
    jsonl = tmp_path / "opt.jsonl"
    assert main(["bench", str(EXAMPLES / "gemm_add_relu.py"), "--jsonl", str(jsonl), "--cpu-only"]) == 0
    (record,) = read_records(jsonl)
    assert record["mode"] == "optimize" and record["status"] == "not_verified"
    assert record["correctness"] is False and record["runtime"] == -1.0
    written = Path(record["output"])
    assert written.parent == tmp_path / "opt_modelnew" and "class ModelNew" in written.read_text()
    assert json.loads(json.dumps(record)) == record


def test_usage_errors_are_one_line_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", str(tmp_path / "missing"), "--cpu-only"]) == 2
    assert main(["bench", str(TINY), "--cpu-only", "--baselines", "eager,jit"]) == 2
    assert main(["bench", str(TINY), "--cpu-only", "--gpus", "all"]) == 2
    assert main(["bench", str(TINY), "--candidates", str(tmp_path / "nope"), "--cpu-only"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 4 and all(line.startswith("kernelfuse: error: ") for line in errors)
    assert "does not exist" in errors[0] and "jit" in errors[1] and "--cpu-only" in errors[2]


def test_the_build_phase_yields_the_cpu_to_the_timing_judge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # builds run ahead on every core while another child times on the GPU: the build child lowers its priority
    # (its compilers inherit it); the judge phase keeps its own
    from kernelfuse.suite import job

    calls: list[int] = []
    monkeypatch.setattr(job.os, "nice", calls.append)
    monkeypatch.setattr(job, "build", lambda spec: {"prebuilt": 0})
    monkeypatch.setattr(job, "judge", lambda spec: {"verdict": None})
    spec = job.JobSpec(str(tmp_path / "p.py"), None, str(tmp_path / "out.py"))
    assert job.run_phase(spec, "judge")["verdict"] is None and calls == []
    assert job.run_phase(spec, "build")["prebuilt"] == 0 and calls == [job.BUILD_NICENESS]
