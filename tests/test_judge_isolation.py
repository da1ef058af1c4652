"""Child-process isolation: candidates that raise, exit, crash or hang become verdicts; the judge carries on.

Runs on the CPU (device="cpu"): the child is the same one the GPU judge uses. The evaluations run concurrently in a
module fixture (each is its own child process), the tests then read their verdicts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from judge_support import TINY, candidate, evaluate_many

from kernelfuse.judge import EXIT_INCORRECT, EXIT_NOT_BUILT, EXIT_OK, EvalOptions
from kernelfuse.judge.runner import NO_ZYGOTE_ENV, ZYGOTE_ENV, judge_zygote

CPU = EvalOptions(device="cpu", baselines=("eager",), timing_reps=3, warmup=1, trials=2, timeout_s=120)
NAMES = ["raise_at_import", "exit_at_import", "hard_exit_in_init", "segfault_at_import", "raise_in_forward",
         "syntax_error", "no_model_new"]


@pytest.fixture(scope="module", params=["spawned", "forked"])
def verdicts(request):
    """Every candidate judged by workers started with `python -m`, then by workers forked from the warm server
    (kernelfuse.judge.zygote): a crash, exit or hang must end the same way."""
    jobs = {name: (TINY, candidate(name), CPU) for name in NAMES}
    # the limit leaves room for setup (importing torch) even on a loaded machine
    jobs["hang_at_import"] = (TINY, candidate("hang_at_import"), replace(CPU, timeout_s=30))
    jobs["crash_then_good"] = [(TINY, candidate("segfault_at_import"), CPU), (TINY, candidate("good"), CPU)]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(ZYGOTE_ENV, raising=False)
        if request.param == "spawned":
            patch.setenv(NO_ZYGOTE_ENV, "1")
        with judge_zygote():
            results = evaluate_many(jobs)
    ran = {v.details.get("worker") for v in results.values()} - {None}  # a syntax error starts no worker
    assert ran == {request.param}
    return results


def test_raise_at_import_names_the_line(verdicts):
    v = verdicts["raise_at_import"]
    assert (v.status, v.built, v.exit_code) == ("not_built", False, EXIT_NOT_BUILT)
    assert v.reason.startswith("import failed at line 14") and "ValueError: kernel table is empty" in v.reason


def test_sys_exit_at_import(verdicts):
    v = verdicts["exit_at_import"]
    assert v.status == "not_built" and "sys.exit(3)" in v.reason


def test_hard_exit_in_constructor(verdicts):
    v = verdicts["hard_exit_in_init"]
    assert v.status == "not_built" and "exited with status 7" in v.reason and "construction" in v.reason


def test_segfault_at_import(verdicts):
    v = verdicts["segfault_at_import"]
    assert v.status == "not_built" and "SIGSEGV" in v.reason
    assert "line 6" in v.reason  # faulthandler's frame in the candidate


def test_hang_is_killed_at_the_timeout(verdicts):
    v = verdicts["hang_at_import"]
    assert v.status == "not_built" and v.reason.startswith("timed out after 30 s during import")


def test_raise_in_forward_is_a_runtime_error_after_a_build(verdicts):
    v = verdicts["raise_in_forward"]
    assert (v.status, v.built, v.exit_code) == ("runtime_error", True, EXIT_INCORRECT)
    assert "trial 0, run before the reference" in v.reason and "fused kernel not implemented" in v.reason


@pytest.mark.parametrize("name", ["syntax_error", "no_model_new"])
def test_static_failures_start_no_child(verdicts, name):
    v = verdicts[name]
    assert v.status == "not_built" and v.details == {}


def test_judge_carries_on_after_a_crash(verdicts):
    assert verdicts[("crash_then_good", 0)].status == "not_built"
    v = verdicts[("crash_then_good", 1)]
    assert (v.status, v.correct, v.exit_code) == ("ok", True, EXIT_OK)
    assert v.trials_passed == 2 and v.runtime_ms is not None and v.eager_ms is not None


def test_an_unreachable_fork_server_leaves_the_worker_spawned(monkeypatch):
    monkeypatch.setenv(ZYGOTE_ENV, "999999999:/nonexistent/kernelfuse_zygote.socket")
    v = evaluate_many({"good": (TINY, candidate("good"), CPU)})["good"]
    assert v.status == "ok" and v.details["worker"] == "spawned"
