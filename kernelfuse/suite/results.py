"""A problem's record from its child runs: the judge's verdict JSON (with KernelBench's fields) plus the suite's
own fields, or, where no verdict came back (a crash, a hang, a bad problem file), a record saying why with
KernelBench's fields filled as a failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernelfuse.judge.diagnose import describe_exit
from kernelfuse.suite.candidates import sample_id
from kernelfuse.suite.child import ChildResult
from kernelfuse.suite.discover import SuiteProblem

ERROR_STATUS = {"ProblemError": "bad_problem", "CaptureError": "not_traced", "NoCandidate": "no_candidate"}


def make_record(problem: SuiteProblem, candidate: Path | None, build: ChildResult | None, judged: ChildResult,
                worker: str, timeout_s: float) -> dict[str, Any]:
    """The JSONL record of one problem."""
    verdict = judged.result.get("verdict")
    record: dict[str, Any] = dict(verdict) if verdict else _failure(judged, candidate, timeout_s)
    record.update({
        "key": problem.key, "level": problem.level, "problem_id": problem.problem_id, "problem_name": problem.name,
        "problem_path": str(problem.path), "candidate_path": str(candidate) if candidate else None,
        "sample_id": sample_id(candidate), "mode": "optimize" if candidate is None else "judge", "worker": worker,
        "judge_wall_s": judged.wall_s, "build_wall_s": build.wall_s if build else None,
        "judge_started": judged.started,  # the job process forked warm from the zygote, or spawned
        "build_phase": _phase_note(build),
    })
    for name in ("shipped", "notes", "cold_build_s", "output", "plans", "precision"):
        if name in judged.result:
            record[name] = judged.result[name]
    return record


def _phase_note(build: ChildResult | None) -> dict[str, Any] | None:
    if build is None:
        return None
    note = {k: v for k, v in build.result.items() if k != "seconds"}
    if build.timed_out:
        note["timed_out"] = True
    return note


def _failure(judged: ChildResult, candidate: Path | None, timeout_s: float) -> dict[str, Any]:
    result = judged.result
    if judged.timed_out:
        status = "timeout"
        reason = f"the problem's process ran past --timeout {timeout_s:g} s (plus a margin) and was killed"
    elif "error" in result:
        status = ERROR_STATUS.get(result.get("error_type", ""), "job_error")
        reason = result["error"]
    elif candidate is None and result.get("output"):  # optimized without a GPU: written, not verified
        status = "not_verified"
        reason = "; ".join(result.get("notes") or []) or "no GPU verification ran"
    else:
        code = describe_exit(judged.returncode) if judged.returncode is not None else "did not exit"
        last = [line for line in judged.log_tail.splitlines() if line.strip()][-1:]
        status, reason = "crashed", f"the problem's process {code}" + (f": {last[0]}" if last else "")
    metadata = {"kernelfuse_status": status, ("runtime_error" if status != "not_verified" else "skipped"): reason}
    return {"status": status, "reason": reason, "built": False, "correct": False, "compiled": False,
            "correctness": False, "runtime": -1.0, "ref_runtime": -1.0, "speedup_eager": None,
            "speedup_compile": None, "log_tail": judged.log_tail, "metadata": metadata}
