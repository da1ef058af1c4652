"""Checks the worker runs beside the trials and timing that decide the verdict: the robustness trials on other
input distributions (their failures reported, never the verdict), the CUDA streams and the share of GPU time in the
candidate's own kernels, and torch.compile's threads named as such. Each records what it finds in the outcome.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from kernelfuse.judge.accounting import account_kernels, candidate_libraries
from kernelfuse.judge.calls import CandidateCallError, Models, TrialSettings
from kernelfuse.judge.guard import compiler_threads
from kernelfuse.judge.outcome import Outcome
from kernelfuse.judge.protocol import WorkerRequest
from kernelfuse.judge.streams import kernel_streams
from kernelfuse.judge.trials import run_trial
from kernelfuse.verify import inputs_to

ROBUST_INPUTS = {  # --robust: other input distributions (float inputs only), each from the problem's own seed
    "standard normal": lambda x, seed: torch.randn(x.shape, dtype=x.dtype,
                                                   generator=torch.Generator().manual_seed(seed)),
    "scaled by 100": lambda x, seed: x * 100,
    "all negative": lambda x, seed: -x.abs() - torch.finfo(x.dtype).tiny,
}


def note_compiler_threads(out: Outcome, before: frozenset[threading.Thread]) -> None:
    """torch.compile's worker threads started by the candidate: named for what they are (not work escaping the
    timed region: the compiled forward waits for its compilation)."""
    names = compiler_threads(before)
    if names:
        out.set(compiler_threads=names)
        out.warn(f"the candidate calls torch.compile itself: its thread(s) {', '.join(names[:6])} are torch.compile's "
                 "(Inductor's compile workers), not work escaping the timed region; its kernels are the compiler's")


def robust_trials(problem: Any, models: Models, settings: TrialSettings, request: WorkerRequest) -> dict[str, Any]:
    """One trial per other input distribution; failures are reported, never raised (the main verdict stands)."""
    failures: list[str] = []
    for j, (name, transform) in enumerate(ROBUST_INPUTS.items()):
        def make_inputs(seed: int, transform: Any = transform) -> list[Any]:
            return [transform(x, seed) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                    for x in problem.make_inputs(seed)]
        try:
            result = run_trial(problem, models, settings, request.trials + 1 + j, [], make_inputs)
        except CandidateCallError as err:
            failures.append(f"{name}: the candidate raised: {type(err.error).__name__}: {err.error}"[:500])
            continue
        if not result.passed:
            failures.append(f"{name}: {result.reason}"[:500])
    return {"ok": not failures, "failures": failures, "distributions": list(ROBUST_INPUTS)}


def check_streams(out: Outcome, models: Models, problem: Any, settings: TrialSettings, request: WorkerRequest,
                   libraries_before: frozenset[str]) -> None:
    """Record the CUDA streams the candidate's kernels use beyond the reference's, and the share of its GPU time
    in kernels of its own (kernelfuse.judge.accounting)."""
    pristine = problem.make_inputs(settings.seed, settings.device)
    try:  # each call's private inputs copied before the profiler starts: the copy is not the model's GPU work
        ref_inputs, cand_inputs = inputs_to(pristine, settings.device), inputs_to(pristine, settings.device)
        settings.default_flags.apply()
        # eager as it is timed: under the policy's autocast (its busy time and kernel names are the bf16 ones)
        autocast = settings.policy.autocast if settings.device.type == "cuda" else None
        with torch.autocast(settings.device.type, dtype=autocast) if autocast is not None else nullcontext():
            ref = kernel_streams(lambda: models.reference(*ref_inputs))
        settings.candidate_flags.apply()
        cand = kernel_streams(lambda: models.candidate(*cand_inputs))
        settings.default_flags.apply()
    except CandidateCallError:
        raise
    except Exception as err:  # noqa: BLE001 - the profiler is a cross-check, not a requirement
        out.warn(f"stream check unavailable: {type(err).__name__}: {str(err)[:200]}")
        return
    extra = sorted(cand.streams - ref.streams)
    out.set(streams={"reference": sorted(ref.streams), "candidate": sorted(cand.streams), "extra": extra,
                     "gpu_activities": cand.count, "reference_busy_ms": round(ref.busy_ms, 4),
                     "candidate_busy_ms": round(cand.busy_ms, 4)})
    account = account_kernels(cand.work, {name for name, *_ in ref.work}, Path(request.candidate_path).read_text(),
                              candidate_libraries(libraries_before))
    out.set(kernels=account.to_dict())
    if extra:
        out.warn(f"the candidate's kernels ran on CUDA stream(s) {extra} besides the current stream "
                 f"{sorted(ref.streams)}: fine if joined before returning; the timing cross-check decides")
