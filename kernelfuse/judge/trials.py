"""Correctness trials with the exploit defences built in (run inside the worker, on the judged device).

Each trial draws fresh inputs (`problem.make_inputs(seed + trial)`) and runs, in this order:
candidate, reference, candidate. Before each candidate call the caching allocator's free memory is poisoned with
NaN; every call gets its own copy of the inputs. So:
- a result read from memory the reference freed, or an output never written, shows as NaN (run before the reference
  there is nothing to steal at all);
- modified inputs show when the copy is compared with the reference's copy afterwards;
- a cached answer fails the next trial's fresh inputs (and is named when it equals an earlier trial's output);
- threads still running after a call are reported, and so is device state a call changed (judge.devicestate);
- outputs must be plain tensors owning their storage (judge.outputs);
- the two candidate runs on the same inputs must agree within the tolerance (else "nondeterministic");
- precision lowered below the policy fails the float64 rule (kernelfuse.verify.float64), unless the reference's
  forward draws random numbers (dropout in training mode, stochastic depth): a float64 copy draws different ones
  (on CUDA the generator's use differs by dtype), so it is no reference, and eager's comparison stands alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kernelfuse.bench.floor import count_flops, min_bytes, tensor_bytes
from kernelfuse.judge.calls import (
    Models,
    TrialSettings,
    as_accurate_as_baseline,
    call_candidate,
    call_reference,
    cast_like,
    draws_random,
    reference64_output,
)
from kernelfuse.judge.outputs import borrowed_output, impure_output
from kernelfuse.judge.rewritten import rewritten_flops
from kernelfuse.load import Problem
from kernelfuse.verify import (
    Comparison,
    changed_inputs,
    check_float64,
    compare_outputs,
    fingerprint,
    flatten_outputs,
    inputs_to,
    mean_abs_error,
    no_tf32_flags,
    same_bits,
    tf32_flags,
)

MIN_POISON_RESERVE = 256 << 20
BASELINE_LABELS = {"fp32": "eager", "tf32": "eager with TF32", "bf16": "eager under bf16 autocast"}
STOPPING_DEFENCES = ("threads", "patched", "device_state")  # after these, further calls of the candidate prove nothing
RANDOM_FORWARD = ("the forward draws random numbers: a float64 copy draws different ones, so it is no reference "
                  "(neither accepts nor fails a candidate)")


@dataclass(frozen=True)
class Probe:
    """What one reference call on spare inputs tells: output bytes, FLOPs, minimum bytes moved, TF32 use."""

    output_bytes: int
    flops: int
    min_bytes: int
    uses_tf32: bool
    output: str
    peak_bytes: int = 0  # device memory one reference call took beyond what was allocated before it (CUDA only)


@dataclass(frozen=True)
class TrialResult:
    """One trial: passed or not, which defence fired, and the errors measured."""

    index: int
    passed: bool
    reason: str | None
    defence: str | None
    max_abs: float
    max_rel: float
    mean_abs: float
    err64_ours: float | None
    err64_eager: float | None
    err64_base: float | None
    err64_scale: float | None = None  # max |float64 reference|: the rule's relative slack is taken of it
    err64_bound: float | None = None  # the rule's bound (float64.Float64Check.bound); ours/bound > 1 fails
    err64_mean_ours: float | None = None  # mean abs errors vs float64 of the candidate and the policy baseline: a
    err64_mean_base: float | None = None  # mean-based rule's false rejections can be measured from these
    by_accuracy: bool = False  # passed on the float64 accuracy rule (as_accurate_as_baseline), not the tolerance
    float64_skipped: str | None = None  # why the float64 reference gave no output: compared with eager only

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_reference(problem: Problem, model: torch.nn.Module, settings: TrialSettings, trials: int) -> Probe:
    """One reference call on inputs no trial uses: output size (for the poison reserve), FLOPs, bytes, TF32 use.

    TF32 use is found by running again with TF32 off everywhere and comparing bits.
    """
    pristine = problem.make_inputs(settings.seed + trials, settings.device)
    rng = settings.seed + trials
    cuda = settings.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(settings.device)
    before = torch.cuda.memory_allocated(settings.device) if cuda else 0
    out, _ = call_reference(model, pristine, settings, rng)
    # the inputs the call copied and every tensor it made: what a float64 run needs twice of
    peak = torch.cuda.max_memory_allocated(settings.device) - before + tensor_bytes(pristine) if cuda else 0
    exact, _ = call_reference(model, pristine, settings, rng, flags=no_tf32_flags(settings.default_flags))
    uses_tf32 = not _same_leaves(out, exact)
    flops = count_flops(lambda: call_reference(model, pristine, settings, rng))
    if flops:  # exact algebra may remove arithmetic (kernelfuse's rewrites): the floor is the smaller count
        flops = min(flops, rewritten_flops(problem, model, pristine) or flops)
    return Probe(tensor_bytes(out), flops, min_bytes(model, pristine, out), uses_tf32, _describe(out), peak)


def _describe(out: Any) -> str:
    from kernelfuse.verify import describe

    return describe(out)


def _same_leaves(a: Any, b: Any) -> bool:
    la, lb = flatten_outputs(a), flatten_outputs(b)
    return len(la) == len(lb) and all(
        same_bits(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True)
    )


def run_trial(problem: Problem, models: Models, settings: TrialSettings, index: int,
              earlier: list[tuple], make_inputs: Callable[[int], list[Any]] | None = None) -> TrialResult:
    """Trial `index`: candidate, reference, candidate on fresh inputs; all checks; `earlier` holds the fingerprints
    of earlier trials' candidate outputs (this trial's is appended). `make_inputs(seed)` replaces the problem's
    input factory (the robustness trials' other distributions)."""
    policy, device = settings.policy, settings.device
    rng = settings.seed + index
    pristine = (inputs_to(make_inputs(settings.seed + index), device) if make_inputs else
                problem.make_inputs(settings.seed + index, device))
    out_a, in_a, issue_a = call_candidate(models.candidate, pristine, settings, rng,
                                          f"trial {index}, run before the reference")
    if issue_a:
        return _fail(index, *issue_a)
    ref_out, ref_in = call_reference(models.reference, pristine, settings, rng)
    random = models.reference64 is not None and draws_random(rng, device)
    out_b, in_b, issue_b = call_candidate(models.candidate, pristine, settings, rng,
                                          f"trial {index}, run after the reference")
    if issue_b:
        return _fail(index, *issue_b)
    for out, cand_in in ((out_a, in_a), (out_b, in_b)) if settings.call_checks else ():
        impure = impure_output(out, ref_out)
        if impure:
            return _fail(index, "output_type", f"trial {index}: {impure}")
        borrowed = borrowed_output(out, cand_in, models.candidate, ref_out, ref_in, models.reference)
        if borrowed:
            return _fail(index, "output_alias", f"trial {index}: {borrowed}")

    ref_changed = changed_inputs(pristine, ref_in)
    for label, cand_in in (("before", in_a), ("after", in_b)):
        changed = changed_inputs(ref_in, cand_in)
        if changed and not ref_changed:
            return _fail(index, "inputs_modified",
                         f"the candidate modified its input(s) {changed} in place (run {label} the reference); the "
                         "reference leaves its inputs unchanged")
        if changed:
            check = compare_outputs(ref_in, cand_in, policy.atol, policy.rtol)
            if not check.ok:
                return _fail(index, "inputs_modified", f"the candidate changed its inputs differently from the "
                             f"reference's in-place update (run {label} the reference): {check.reason}")
    del in_a, in_b, ref_in

    # the bf16 policy's reference: eager under CUDA autocast (what a bf16 candidate computes), beside fp32 eager
    autocast_out = (call_reference(models.reference, pristine, settings, rng, autocast=policy.autocast)[0]
                    if policy.autocast is not None and device.type == "cuda" else None)
    f64 = None
    means: tuple[float | None, float | None] = (None, None)
    ref64_out, float64_skipped = ((None, RANDOM_FORWARD) if random else
                                  reference64_output(models, pristine, device, rng))
    if ref64_out is not None:
        base = ref_out
        if policy.baseline == "tf32":
            tf32 = tf32_flags(settings.default_flags)
            base, _ = call_reference(models.reference, pristine, settings, rng, flags=tf32)
        elif policy.baseline == "bf16":
            base = autocast_out if autocast_out is not None else \
                call_reference(models.reference, pristine, settings, rng, autocast=policy.autocast)[0]
        label = BASELINE_LABELS.get(policy.baseline, "eager")
        f64_a = check_float64(out_a, base, ref_out, ref64_out, label)
        f64_b = check_float64(out_b, base, ref_out, ref64_out, label)
        f64 = f64_a if f64_a.ours_err >= f64_b.ours_err else f64_b
        means = (mean_abs_error(out_a if f64 is f64_a else out_b, ref64_out), mean_abs_error(base, ref64_out))
        del base

    comps = []
    by_accuracy = False
    for label, out in (("before", out_a), ("after", out_b)):
        comp = compare_outputs(ref_out, out, policy.atol, policy.rtol)
        if not comp.ok and autocast_out is not None:  # the bf16 policy: eager under autocast is the reference
            under = compare_outputs(cast_like(autocast_out, ref_out), out, policy.atol, policy.rtol)
            comp = under if under.ok else comp
        # eager is an approximation too: within tolerance of the exact (float64) answer also passes
        if not comp.ok and ref64_out is not None:
            alt = compare_outputs(cast_like(ref64_out, ref_out), out, policy.atol, policy.rtol)
            accurate = not alt.ok and as_accurate_as_baseline(settings, out, ref_out, ref64_out, autocast_out)
            by_accuracy = by_accuracy or accurate
            if alt.ok or accurate:
                comp = Comparison(True, None, comp.max_abs, comp.max_rel, comp.mean_abs, 0, 0, comp.numel)
        comps.append((label, comp))
    del autocast_out
    worst = max((c for _, c in comps), key=lambda c: c.max_abs)
    errors = dict(max_abs=worst.max_abs, max_rel=worst.max_rel, mean_abs=worst.mean_abs,
                  err64_ours=f64.ours_err if f64 else None, err64_eager=f64.eager_err if f64 else None,
                  err64_base=f64.base_err if f64 else None, err64_scale=f64.ref_scale if f64 else None,
                  err64_bound=f64.bound if f64 else None, err64_mean_ours=means[0], err64_mean_base=means[1],
                  float64_skipped=float64_skipped)
    print_b = fingerprint(out_b)
    stale_of = next((i for i, fp in enumerate(earlier) if fp == print_b), None)
    earlier.append(print_b)

    twice = compare_outputs(out_a, out_b, policy.atol, policy.rtol) if settings.call_checks else None
    if twice is not None and not twice.ok and all(c.ok for _, c in comps):
        comps.append(("twice", twice))
    for label, comp in comps:
        if comp.ok:
            continue
        where = f"trial {index}, candidate run {label} the reference"
        if comp.n_unwritten and device.type == "cuda":
            return _fail(index, "poisoned_memory",
                         f"output not fully written ({where}): {comp.n_unwritten} of {comp.numel} elements are NaN "
                         "where the reference is finite; free memory was filled with NaN before the call, so these "
                         "elements were never written (or were read from memory the reference freed)", **errors)
        if twice is not None and not twice.ok:
            return _fail(index, "nondeterministic",
                         f"two runs of the candidate on the same inputs differ beyond the tolerance (trial {index}): "
                         f"{twice.reason}; uninitialised memory, a race or randomness the seed does not control",
                         **errors)
        if stale_of is not None and index > 0:
            return _fail(index, "stale_output",
                         f"the candidate returned the same output as in trial {stale_of} for different inputs "
                         f"({where}): a cached or lazily computed result; {comp.reason}", **errors)
        return _fail(index, "mismatch", f"{where}: {comp.reason}", **errors)
    if f64 is not None and not f64.ok:
        return _fail(index, "precision", f"trial {index}: {f64.reason}", **errors)
    return TrialResult(index, True, None, None, **errors, by_accuracy=by_accuracy)


def _fail(index: int, defence: str, reason: str, **errors: Any) -> TrialResult:
    base = dict(max_abs=float("nan"), max_rel=float("nan"), mean_abs=float("nan"), err64_ours=None,
                err64_eager=None, err64_base=None)
    base.update(errors)
    return TrialResult(index, False, reason, defence, **base)


def run_trials(problem: Problem, models: Models, settings: TrialSettings, trials: int,
               after_trial: Callable[[TrialResult], str | None],
               make_inputs: Callable[[int], list[Any]] | None = None) -> list[TrialResult]:
    """Run all trials (stopping early only when a thread, patch or device-state change was found); `after_trial` may
    veto a passed trial (the guard found a patch)."""
    results: list[TrialResult] = []
    earlier: list[tuple] = []
    for index in range(trials):
        result = run_trial(problem, models, settings, index, earlier, make_inputs)
        veto = after_trial(result)
        if veto is not None and result.passed:
            result = _fail(index, "patched", veto, **{k: v for k, v in result.to_dict().items()
                                                     if k in ("max_abs", "max_rel", "mean_abs", "err64_ours",
                                                              "err64_eager", "err64_base")})
        results.append(result)
        if result.defence in STOPPING_DEFENCES:
            break
    return results


def poison_reserve_for(probe: Probe) -> int:
    """Poison at least twice the reference's output size, so an allocation of the output's size lands on NaN."""
    return max(MIN_POISON_RESERVE, 2 * probe.output_bytes)
