"""Verdict formatting, JSON (with KernelBench's record fields), exit codes, the CLI and the no-device path."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from judge_support import SEED_PROBLEMS, TINY, candidate, evaluate_many, seed_path

from kernelfuse.judge import EXIT_NO_DEVICE, EXIT_NOT_BUILT, EXIT_OK, EXIT_USAGE, EvalOptions, Verdict
from kernelfuse.judge.cli import add_eval_arguments, run_eval

STATS = {"n": 20, "median": 2.8, "mean": 2.81, "std": 0.01, "min": 2.78, "max": 2.85, "p25": 2.79, "p75": 2.82,
         "iqr": 0.03}


def sample_verdict(**changes) -> Verdict:
    fields = dict(problem="p.py", candidate="c.txt", code_from="reply: python block 1 of 1 (lines 3-9)",
                  precision="strict", status="ok", built=True, correct=True, build_s=41.5, trials=5, trials_run=5,
                  trials_passed=5, max_abs_err=0.0, max_rel_err=0.0, err64_ours=1.2e-5, err64_eager=1.2e-5,
                  err64_base=1.2e-5, uses_tf32=False, params_match=True, runtime_ms=2.8, eager_ms=2.73,
                  compile_ms=2.72, ours_stats=STATS, eager_stats={**STATS, "median": 2.73},
                  compile_stats={**STATS, "median": 2.72}, compile_s=12.3, speedup_eager=2.73 / 2.8,
                  speedup_compile=2.72 / 2.8, floor_ms=2.1, device="NVIDIA H100", torch_version="2.11.0",
                  details={"trials": [{"max_abs": 0.0, "mean_abs": 0.0}], "floor": {"bound": "compute"},
                           "device_type": "cuda"})
    fields.update(changes)
    return Verdict(**fields)


def test_table_shows_result_errors_and_timings():
    table = sample_verdict(warnings=("something odd",)).format_table()
    for text in ("CORRECT (built, 5/5 trials, 0.975x eager)", "vs float64  ours 1.2e-05", "torch.compile",
                 "(compile 12.3 s)", "floor estimate", "compute-bound", "- something odd", "precision   strict"):
        assert text in table


def test_table_shows_the_bare_anchors_where_timed():
    assert "bare anchors" not in sample_verdict().format_table()
    v = sample_verdict(anchor_ms=1.95, anchor_calls=[{"op": "mm [64, 64] x [64, 64]", "count": 1, "ms": 1.95}])
    assert "bare anchors         1.950" in v.format_table()
    assert v.to_json()["anchor_ms"] == 1.95


def test_table_of_a_build_failure_lists_key_lines():
    v = sample_verdict(status="not_built", built=False, correct=False, reason="build failed (x): cause",
                       build_cause="cause", build_errors=("a.h:5: error: #error C++17",), runtime_ms=None,
                       eager_ms=None, compile_ms=None, ours_stats=None, eager_stats=None, compile_stats=None)
    table = v.format_table()
    assert "NOT BUILT" in table and "| a.h:5: error: #error C++17" in table and v.exit_code == EXIT_NOT_BUILT


def test_json_has_kernelbench_fields_and_no_nan():
    v = sample_verdict(status="incorrect", correct=False, max_abs_err=float("nan"), reason="mismatch",
                       details={"trials": [{"max_abs": float("nan"), "mean_abs": 1.0}]})
    data = json.loads(json.dumps(v.to_json()))
    assert data["compiled"] is True and data["correctness"] is False
    assert data["runtime"] == -1.0 and data["ref_runtime"] == 2.73
    assert data["metadata"]["correctness_trials"] == "(5 / 5)"
    assert data["metadata"]["correctness_issue"] == "mismatch"
    assert data["metadata"]["max_difference"] == ["nan"]
    assert data["max_abs_err"] is None and data["exit_code"] == 1
    assert data["runtime_stats"]["num_trials"] == 20


def test_exit_codes():
    assert sample_verdict().exit_code == EXIT_OK
    assert sample_verdict(status="no_device").exit_code == EXIT_NO_DEVICE
    assert sample_verdict(status="timeout").exit_code == 1


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    return parser.parse_args(argv)


def test_cli_writes_json_and_returns_the_exit_code(tmp_path, capsys):
    out = tmp_path / "v.json"
    code = run_eval(_parse([str(TINY), str(candidate("good")), "--device", "cpu", "--baselines", "eager",
                            "--reps", "3", "--trials", "2", "--json", str(out)]))
    assert code == EXIT_OK and "CORRECT" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["correctness"] is True and data["metadata"]["correctness_trials"] == "(2 / 2)"


def test_cli_usage_errors(tmp_path, capsys):
    assert run_eval(_parse([str(tmp_path / "missing.py"), str(candidate("good"))])) == EXIT_USAGE
    assert run_eval(_parse([str(TINY), str(candidate("good")), "--baselines", "nope"])) == EXIT_USAGE
    assert "unknown baseline" in capsys.readouterr().err


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-device path needs a machine without CUDA")
SEED_EXTENSIONS = {"002": "fused_add_relu", "003": "fused_sigmoid_scale_add", "004": "fused_relu_add"}


@pytest.fixture(scope="module")
def seed_verdicts():
    jobs = {number: (SEED_PROBLEMS[number], seed_path(number), EvalOptions(timeout_s=300))
            for number in SEED_EXTENSIONS}
    return evaluate_many(jobs)


@NO_CUDA
@pytest.mark.parametrize("number", sorted(SEED_EXTENSIONS))
def test_no_device_verdict_for_the_seeds(seed_verdicts, number):
    v = seed_verdicts[number]
    assert (v.status, v.built, v.correct, v.exit_code) == ("no_device", False, False, EXIT_NO_DEVICE)
    assert v.reason == "no CUDA device: not built or run"
    assert v.params_match is True
    assert [e["name"] for e in v.details["extensions"]] == [SEED_EXTENSIONS[number]]
    data = v.to_json()
    assert data["compiled"] is False and data["correctness"] is False
    if number == "003":
        assert any("-std=c++14" in w for w in v.warnings)


@NO_CUDA
def test_no_device_cli_exit_code(tmp_path):
    out = tmp_path / "v.json"
    code = run_eval(_parse([str(TINY), str(candidate("good")), "--json", str(out)]))
    assert code == EXIT_NO_DEVICE
    assert json.loads(out.read_text())["metadata"]["skipped"] == "no CUDA device: not built or run"
