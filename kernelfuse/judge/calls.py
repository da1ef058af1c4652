"""How the judge calls each side: the reference on its own copy of the inputs (and its float64 copy where there is
one), the candidate with free memory poisoned first and its threads and device state watched. Apart from the trials
because the timed-call checks (judge.timedcheck) make the same calls and compare the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernelfuse.judge.devicestate import DeviceState
from kernelfuse.judge.guard import new_threads, python_threads
from kernelfuse.verify import (
    NumericsFlags,
    Policy,
    as_accurate_as,
    flags_applied,
    inputs_to,
    poison_free_memory,
    to_float64,
)


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


def cast_like(ref64: Any, like: Any) -> Any:
    if isinstance(ref64, torch.Tensor) and isinstance(like, torch.Tensor):
        return ref64.to(like.device, like.dtype)
    if isinstance(ref64, (tuple, list)) and isinstance(like, (tuple, list)):
        return type(like)(cast_like(r, x) for r, x in zip(ref64, like, strict=False))
    return ref64


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
