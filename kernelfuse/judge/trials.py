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
from kernelfuse.judge.devicestate import DeviceState
from kernelfuse.judge.guard import new_threads, python_threads
from kernelfuse.judge.outputs import borrowed_output, impure_output
from kernelfuse.judge.rewritten import rewritten_flops
from kernelfuse.load import Problem
from kernelfuse.verify import (
    Comparison,
    NumericsFlags,
    Policy,
    as_accurate_as,
    changed_inputs,
    check_float64,
    compare_outputs,
    fingerprint,
    flags_applied,
    flatten_outputs,
    inputs_to,
    mean_abs_error,
    no_tf32_flags,
    poison_free_memory,
    same_bits,
    tf32_flags,
    to_float64,
)

MIN_POISON_RESERVE = 256 << 20
BASELINE_LABELS = {"fp32": "eager", "tf32": "eager with TF32", "bf16": "eager under bf16 autocast"}
STOPPING_DEFENCES = ("threads", "patched", "device_state")  # after these, further calls of the candidate prove nothing
RANDOM_FORWARD = ("the forward draws random numbers: a float64 copy draws different ones, so it is no reference "
                  "(neither accepts nor fails a candidate)")


class CandidateCallError(Exception):
    """The candidate raised during a call; `when` says which call (the original is the __cause__)."""

    def __init__(self, when: str, error: BaseException) -> None:
        super().__init__(f"{when}: {type(error).__name__}: {error}")
        self.when = when
        self.error = error


@dataclass(frozen=True)
class Models:
    """The two models on the judged device, and a float64 copy of the reference (None when not used) on
    `reference64_device` (None: the judged device; the host where the device cannot hold it)."""

    reference: torch.nn.Module
    candidate: torch.nn.Module
    reference64: torch.nn.Module | None
    reference64_device: torch.device | None = None


@dataclass(frozen=True)
class TrialSettings:
    """How trials run: device, policy, seed, the flags for each side, whether the reference uses TF32, and whether
    the per-call checks run (off only to measure their cost: EvalOptions.call_checks)."""

    device: torch.device
    policy: Policy
    seed: int
    default_flags: NumericsFlags
    candidate_flags: NumericsFlags
    uses_tf32: bool
    poison_reserve: int
    call_checks: bool = True


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_reference(model: torch.nn.Module, pristine: list[Any], settings: TrialSettings, rng_seed: int,
                   flags: NumericsFlags | None = None, autocast: torch.dtype | None = None) -> tuple[Any, list[Any]]:
    """Run the reference on its own copy of the inputs under `flags` (default: the flags before import), and
    under autocast to `autocast` where given."""
    inputs = inputs_to(pristine, settings.device)
    torch.manual_seed(rng_seed)
    with flags_applied(flags or settings.default_flags):
        if autocast is not None:
            with torch.autocast(settings.device.type, dtype=autocast):
                out = model(*inputs)
        else:
            out = model(*inputs)
    synchronize(settings.device)
    return out, inputs


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def draws_random(rng_seed: int, device: torch.device) -> bool:
    """Whether the call just made after `torch.manual_seed(rng_seed)` (call_reference's) drew random numbers: the
    default generators (the CPU's, and the device's on CUDA) are no longer where that seed put them. Call it right
    after the reference call; it reseeds them with `rng_seed` (every judged call seeds its own anyway)."""
    after = _rng_states(device)
    torch.manual_seed(rng_seed)
    return any(not torch.equal(a, b) for a, b in zip(after, _rng_states(device), strict=True))


def call_candidate(model: torch.nn.Module, pristine: list[Any], settings: TrialSettings, rng_seed: int,
                   when: str) -> tuple[Any, list[Any], tuple[str, str] | None]:
    """Poison free memory, run the candidate on its own input copy, synchronise.

    Returns (out, inputs, issue): issue is (defence, message) when the call left Python threads running or changed
    device state (kernelfuse.judge.devicestate), else None.
    """
    poison_free_memory(settings.device, settings.poison_reserve)
    inputs = inputs_to(pristine, settings.device)
    torch.manual_seed(rng_seed)
    before = python_threads()
    try:
        with flags_applied(settings.candidate_flags):
            state = DeviceState.capture(settings.device) if settings.call_checks else None
            out = model(*inputs)
            changed = state and DeviceState.capture(settings.device).changes_from(state,
                                                                                  settings.policy.name == "strict")
        leftover = new_threads(before)
        synchronize(settings.device)
    except Exception as err:  # noqa: BLE001 - any failure of the candidate's code is its verdict
        raise CandidateCallError(when, err) from err
    if leftover:
        return out, inputs, ("threads", f"the candidate left Python thread(s) running after forward returned: "
                             f"{', '.join(leftover)}: work escaping the timed region")
    if changed:
        return out, inputs, ("device_state", f"forward left the device state changed ({when}): "
                             + "; ".join(changed))
    return out, inputs, None


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


def cast_like(ref64: Any, like: Any) -> Any:
    if isinstance(ref64, torch.Tensor) and isinstance(like, torch.Tensor):
        return ref64.to(like.device, like.dtype)
    if isinstance(ref64, (tuple, list)) and isinstance(like, (tuple, list)):
        return type(like)(cast_like(r, x) for r, x in zip(ref64, like, strict=False))
    return ref64


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


def reference64_output(models: Models, pristine: list[Any], device: torch.device, rng: int
                       ) -> tuple[Any, str | None]:
    """(the float64 reference's output, None), or (None, why not) when there is no float64 reference, it does not
    fit in memory after all (a float64 copy doubles every tensor: level-1 L1Norm has a 16 GiB input) or the model
    does not run in float64 (it builds float32 tensors of its own). The trial then stands on the comparison with
    eager alone, and the verdict says so. It runs where the worker placed it (the device, else the host)."""
    if models.reference64 is None:
        return None, None
    where = models.reference64_device or device
    try:
        torch.manual_seed(rng)
        return models.reference64(*to_float64(inputs_to(pristine, where))), None
    except torch.OutOfMemoryError:
        if where.type == "cuda":
            torch.cuda.empty_cache()
        return None, "a float64 copy of the model's tensors does not fit in device memory"
    except Exception as err:  # noqa: BLE001 - the reference's own failure in float64, not the candidate's
        return None, f"the model does not run in float64 ({type(err).__name__}: {str(err)[:160]})"


def as_accurate_as_baseline(settings: TrialSettings, out: Any, ref_out: Any, ref64_out: Any,
                            autocast_out: Any = None) -> bool:
    """Where the policy's baseline is no exact answer itself, a candidate outside the tolerance of it passes when
    it is no less accurate than that baseline against float64, in max and in mean error, with NaN and Inf where
    the baseline has them (DESIGN.md: where eager rounds, judge accuracy against float64). The trials and the
    timed-call checks both apply it. The baselines:
    - strict policy, eager running TF32 convolutions or matrix products (cuDNN's default): a fused plan whose TF32
      calls see inputs one rounding apart from eager's lands up to eager's own error away from it (DenseNet,
      ResNet: 2e-4 to 0.07 on outputs where eager is 8e-4 to 0.2 from float64);
    - the bf16 policy, eager under CUDA autocast (`autocast_out`): two bf16 computations that round at different
      points differ by up to bf16 eager's own error. A 12-layer Llama under autocast is 0.064 (max) and 0.009
      (mean) from float64, so fused plans as accurate as eager left 15% of the elements beyond 1e-2."""
    if settings.uses_tf32 and settings.policy.baseline == "fp32":
        base = ref_out
    elif settings.policy.autocast is not None and autocast_out is not None:
        base = cast_like(autocast_out, ref_out)
    else:
        return False
    return as_accurate_as(out, base, ref64_out)


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
