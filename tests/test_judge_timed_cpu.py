"""Issue 6 on the CPU path: candidates that game timing get no CORRECT verdict, each caught by its own defence.

Classes: behaviour that changes between checked and timed calls (call count, stack, caller frame, clock), outputs
that are not plain tensors or borrow storage, memoisation on pointer or contents, nondeterminism, device state
changed inside forward; and honest candidates (one prepacking its weight) stay CORRECT. Also `--mode` and
`--robust`, and the implausible-speed verdict's pieces (the floor needs a GPU: see test_judge_gpu.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from judge_support import TINY, candidate, evaluate_many

from kernelfuse.bench import Ceilings, below_floor, floor_estimate, summarize
from kernelfuse.judge import EXIT_INCORRECT, EvalOptions
from kernelfuse.judge.evaluate import _verdict
from kernelfuse.judge.reply import extract_candidate
from kernelfuse.judge.runner import ChildRun

CPU = EvalOptions(device="cpu", baselines=("eager",), timing_reps=10, warmup=1, trials=3, timeout_s=180)
CASES = [
    ("timed_call_count", "timed_output_mismatch", "correct while checked, wrong while timed"),
    ("timed_stack_inspect", "timed_output_mismatch", "differs from the reference's for the same inputs"),
    ("timed_caller_frame", "timed_output_mismatch", "differs from the reference's for the same inputs"),
    ("timed_clock", "timed_output_mismatch", "differs from the reference's for the same inputs"),
    ("output_subclass", "output_type", "a tensor subclass"),
    ("output_torch_function", "output_type", "not a tensor overriding __torch_function__"),
    ("output_dispatch_wrapper", "output_type", "a tensor subclass overriding __torch_function__ and __torch_disp"),
    ("output_lazy_proxy", "output_type", "not a tensor"),
    ("output_alias_input", "output_alias", "shares storage with an input"),
    ("output_alias_buffer", "output_alias", "shares storage with a parameter"),
    ("memo_data_ptr", "timed_output_mismatch", "differs from the reference's for the same inputs"),
    ("memo_content_sum", "timed_output_mismatch", "differs from the reference's for the same inputs"),
    ("nondet_noise", "nondeterministic", "two runs of the candidate on the same inputs differ"),
    ("nondet_clock", "nondeterministic", "two runs of the candidate on the same inputs differ"),
    ("state_tf32_in_forward", "device_state", "matmul TF32: False -> True"),
    ("state_matmul_precision", "device_state", "matmul TF32: False -> True"),
    ("state_late_tf32", "device_state", "a timed call left the device state changed: matmul TF32: False -> True"),
]
OPTIONS = {"timed_clock": replace(CPU, timing_reps=80)}  # the timing loop must outlast its honest seconds
# Clock-keyed behaviour depends on the machine's load: if the trials already outlast the honest seconds, the switch
# is caught there, by the two runs on the same inputs disagreeing (or both wrong when it falls between two trials).
ALSO = {"timed_clock": ("nondeterministic", "mismatch")}

# A problem whose first op is the identity on torch.rand inputs, and a candidate that drops it (--robust).
RELU_FIRST = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(torch.relu(x))


def get_inputs():
    return [torch.rand(8, 16)]


def get_init_inputs():
    return [16]
"""
DROPS_RELU = RELU_FIRST.split("\n\n\ndef get_inputs")[0].replace("class Model", "class ModelNew").replace(
    "self.lin(torch.relu(x))", "self.lin(x)")
KEEPS_RELU = RELU_FIRST.split("\n\n\ndef get_inputs")[0].replace("class Model", "class ModelNew")
# Dropout: the benchmark judges as constructed (train); a candidate that always drops is wrong only in eval mode.
DROPOUT = RELU_FIRST.replace("self.lin(torch.relu(x))", "self.drop(self.lin(x))").replace(
    "self.lin = nn.Linear(n, n)", "self.lin = nn.Linear(n, n)\n        self.drop = nn.Dropout(0.5)")
ALWAYS_DROPS = DROPOUT.split("\n\n\ndef get_inputs")[0].replace("class Model", "class ModelNew").replace(
    "self.drop(self.lin(x))", "torch.nn.functional.dropout(self.lin(x), 0.5, training=True)")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("timed")
    for name, text in (("relu_first", RELU_FIRST), ("drops_relu", DROPS_RELU), ("keeps_relu", KEEPS_RELU),
                       ("dropout", DROPOUT), ("always_drops", ALWAYS_DROPS)):
        (folder / f"{name}.py").write_text(text)
    jobs = {name: (TINY, candidate(name), OPTIONS.get(name, CPU)) for name, *_ in CASES}
    jobs["good"] = (TINY, candidate("good"), CPU)
    jobs["good_prepacked"] = (TINY, candidate("good_prepacked"), CPU)
    jobs["exploit_memoize"] = (TINY, candidate("exploit_memoize"), CPU)  # fresh contents: the memo never hits
    jobs["timed_call_count unchecked"] = (TINY, candidate("timed_call_count"), replace(CPU, call_checks=False))
    robust = replace(CPU, robust=True)
    jobs["drops_relu"] = (folder / "relu_first.py", folder / "drops_relu.py", robust)
    jobs["keeps_relu"] = (folder / "relu_first.py", folder / "keeps_relu.py", robust)
    jobs["always_drops train"] = (folder / "dropout.py", folder / "always_drops.py", CPU)
    jobs["always_drops both"] = (folder / "dropout.py", folder / "always_drops.py", replace(CPU, mode="both"))
    return evaluate_many(jobs)


@pytest.mark.parametrize("name, defence, words", CASES)
def test_gaming_candidate_is_caught_by_its_defence(verdicts, name, defence, words):
    v = verdicts[name]
    assert not v.correct and v.defence in (defence, *ALSO.get(name, ())), (v.status, v.reason)
    assert v.status in ("incorrect", "rejected") and v.exit_code == EXIT_INCORRECT
    assert words in v.reason or v.defence in ALSO.get(name, ())
    kb = v.to_json()
    assert kb["correctness"] is False and kb["runtime"] == -1.0 and v.speedup_eager is None


@pytest.mark.parametrize("name", ["good", "good_prepacked", "exploit_memoize"])
def test_honest_candidates_stay_correct_with_every_timed_call_checked(verdicts, name):
    v = verdicts[name]
    assert v.correct, v.reason
    assert v.input_sets == 4 and v.checked_timed_calls == CPU.timing_reps
    assert "4 input set(s) rotated" in v.format_table()
    assert v.to_json()["input_sets"] == 4 and v.robust is None


def test_call_checks_off_only_measures_and_says_so(verdicts):
    """call_checks=False (benchmarking the judge's overhead) really turns the per-call checks off: the call-count
    gamer then passes, on one unrotated input set with no timed call checked, and the verdict says it is no verdict."""
    v = verdicts["timed_call_count unchecked"]
    assert v.correct and v.input_sets == 1 and v.checked_timed_calls == 0
    assert any(w.startswith("per-call checks off") and "not a verdict" in w for w in v.warnings), v.warnings
    assert {"trials", "timing"} <= set(v.details["stage_s"]) and v.details["stage_s"]["timing"] > 0
    assert verdicts["timed_call_count"].defence == "timed_output_mismatch"  # the same fixture, checks on


def test_robust_trials_show_a_candidate_correct_only_on_the_problems_inputs(verdicts):
    v = verdicts["drops_relu"]
    assert v.correct and v.robust is False  # the main verdict stands ...
    assert any(f.startswith("all negative") for f in v.robust_failures), v.robust_failures
    assert "correct only on the problem's input distribution" in v.format_table()
    assert v.to_json()["robust"] is False
    assert verdicts["keeps_relu"].correct and verdicts["keeps_relu"].robust is True


def test_mode_both_judges_eval_mode_too(verdicts):
    assert verdicts["always_drops train"].correct  # as the benchmark judges: train mode, same dropout masks
    v = verdicts["always_drops both"]
    assert not v.correct and v.mode == "both" and "eval" in v.format_table()
    assert any(t.get("mode") == "eval" and not t["passed"] for t in v.details["trials"])


def test_implausible_speed_is_a_verdict(tmp_path):
    floor = floor_estimate(2 * 10**12, 10**9, Ceilings(5e13, 4e12, "fp32"))  # 40 ms compute-bound
    assert below_floor(30.0, floor) is not None and below_floor(30.0, floor, 0.5, "implausible") is None
    assert below_floor(10.0, floor, 0.5, "implausible").startswith("implausible: 10.000 ms is 4.0x faster")
    assert below_floor(10.0, floor, 0.0) is None  # margin 0 turns it off
    log = tmp_path / "worker.log"
    log.write_text("")
    out = {"built": True, "finished": True, "trials": [{"passed": True, "max_abs": 0.0}] * 5,
           "timing": {"stats": {"candidate": summarize([10.0]).to_dict(), "eager": summarize([41.0]).to_dict()},
                      "floor": floor.to_dict(),
                      "input_sets": 4, "checked_calls": 6},
           "failure": {"kind": "implausible", "message": below_floor(10.0, floor, 0.5, "implausible")}}
    cand = extract_candidate(candidate("good"))
    base = {"problem": "p", "candidate": "c", "code_from": "file", "precision": "strict", "trials": 5}
    v = _verdict(ChildRun(0, False, 1.0, log, out), cand, EvalOptions(), base, [])
    assert (v.status, v.defence, v.correct, v.exit_code) == ("implausible", "implausible", False, EXIT_INCORRECT)
    assert v.to_json()["runtime"] == -1.0 and v.speedup_eager is None and v.runtime_ms == 10.0
    assert "IMPLAUSIBLE" in v.format_table() and v.input_sets == 4


def test_options_are_validated():
    with pytest.raises(ValueError, match="mode"):
        EvalOptions(mode="inference")
    with pytest.raises(ValueError, match="implausible_margin"):
        EvalOptions(implausible_margin=1.5)
