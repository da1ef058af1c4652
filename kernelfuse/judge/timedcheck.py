"""What the timing loop feeds the candidate and how its timed calls are checked.

A judge that checks correctness on a few calls and then times many calls on one input can be gamed: count the
calls, look at the caller or the clock, and be honest only while checked; memoise on the input's pointer or
contents and be free while timed. So, around every timed call (outside the timed region):
- inputs rotate over a pool of distinct input sets (seeds of the correctness trials, as many as memory allows), and
  the candidate's set gets new contents before each call (the set's own values, rolled by a random offset, written
  into the same buffers): a memo keyed on the pointer returns a stale answer, one keyed on the contents never hits;
- every output must be a plain tensor like the reference's (judge.outputs), and the device state (precision flags,
  stream, L2 settings) must be as before the call (judge.devicestate);
- a random sample of the timed calls, drawn from the OS's entropy after the candidate is loaded and always including
  the last call, is compared with the reference run on the same inputs (every call on the CPU path), and so are
  the candidate's inputs after the call: modified in place where the reference leaves them is input mutation.
A candidate cannot tell a checked call from an unchecked one without reading the judge's own frames (out of scope:
README, Limits). Instances hold the loop's counters, so this class is mutable by design. With
`settings.call_checks` off (measuring the judge's overhead only) the loop times one input set as it was, unchecked.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from kernelfuse.judge.calls import (
    Models,
    TrialSettings,
    as_accurate_as_baseline,
    call_reference,
    cast_like,
    draws_random,
    reference64_output,
)
from kernelfuse.judge.devicestate import DeviceState
from kernelfuse.judge.outputs import impure_output
from kernelfuse.load import Problem
from kernelfuse.verify import Comparison, changed_inputs, compare_outputs, inputs_to

POOL_MEMORY_FRACTION = 0.25  # of the free device memory, for the input pool of all versions together
CHECK_ALL_UP_TO = 8  # timed calls: up to this many, every call is checked
CHECK_FRACTION = 0.25
MIN_CHECKED = 4
CALL_SEED_OFFSET = 1_000_003  # torch seed before timed call c: seed + offset + c (the reference gets the same)


def pool_size(wanted: int, input_bytes: int, versions: int, device: torch.device) -> int:
    """How many input sets fit: `wanted`, bounded by a fraction of free device memory (at least 1)."""
    if device.type != "cuda" or input_bytes <= 0:
        return max(1, wanted)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(wanted, int(POOL_MEMORY_FRACTION * free) // max(1, input_bytes * (versions + 1))))


def checked_calls(reps: int, device: torch.device) -> set[int]:
    """Indices of the timed candidate calls to compare with the reference: all on the CPU or when few, else a
    random quarter (at least MIN_CHECKED) plus the last, drawn from OS entropy."""
    if device.type != "cuda" or reps <= CHECK_ALL_UP_TO:
        return set(range(reps))
    count = max(MIN_CHECKED, int(CHECK_FRACTION * reps))
    return set(random.SystemRandom().sample(range(reps - 1), min(count, reps - 1))) | {reps - 1}


class TimedInputs:
    """The input pool, each version's own buffers, and the checks on the candidate's timed calls."""

    def __init__(self, problem: Problem, models: Models, settings: TrialSettings, names: list[str], sets: int,
                 reps: int) -> None:
        self.models, self.settings = models, settings
        device = settings.device
        first = problem.make_inputs(settings.seed, device)
        n = pool_size(sets if settings.call_checks else 1,
                      sum(x.numel() * x.element_size() for x in first if isinstance(x, torch.Tensor)), len(names),
                      device)
        self.pool = [first] + [problem.make_inputs(settings.seed + k, device) for k in range(1, n)]
        self.own = {name: [inputs_to(p, device) for p in self.pool] for name in names}
        self.calls = dict.fromkeys(names, 0)
        self.timed = 0
        self.checked = checked_calls(reps, device) if settings.call_checks else set()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.current: list[Any] = []
        self.given: list[Any] = []  # the candidate's own input buffers of its current call
        self.state: DeviceState | None = None
        self.call_seed = settings.seed
        self.template, _ = call_reference(models.reference, self.pool[0], settings, settings.seed)
        self.failure: tuple[str, str] | None = None
        self.n_checked = 0

    @property
    def sets(self) -> int:
        return len(self.pool)

    def inputs(self, name: str) -> list[Any]:
        """The inputs for `name`'s next call, advancing its counter. With the call checks on, every version's
        buffers get fresh contents the same way; the candidate's are what its checked calls are compared on."""
        k = self.calls[name] % len(self.pool)
        self.calls[name] += 1
        own = self.own[name][k]
        if self.settings.call_checks:
            current = [self._rolled(x) for x in self.pool[k]]
            for dst, src in zip(own, current, strict=True):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            if name == "candidate":
                self.current = current
        if name == "candidate":
            self.given = own
        return own

    def _rolled(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.numel() < 2:
            return x
        shift = int(torch.randint(1, x.numel(), (1,), generator=self.generator, device=x.device))
        return torch.roll(x.reshape(-1), shift).view(x.shape)

    def before_call(self, name: str) -> None:
        """Seed torch as the checked reference call will be, and capture the device state (flags already set).
        Every version gets the same work before its timed call, though only the candidate's state is compared:
        a seed before the candidate's calls alone made the problem's own forward, judged as a candidate, time
        7% slower than itself as eager on the CPU (0.84-0.90x on an H200, launch-bound level-1 problem 12)."""
        seed = self.settings.seed + CALL_SEED_OFFSET + self.calls[name]
        torch.manual_seed(seed)
        state = DeviceState.capture(self.settings.device) if self.settings.call_checks else None
        if name == "candidate":
            self.call_seed, self.state = seed, state

    def after_call(self, name: str) -> None:
        """The candidate must leave the device state as it found it (the same capture runs after every version)."""
        if self.state is None or not self.settings.call_checks:
            return
        now = DeviceState.capture(self.settings.device)
        if name != "candidate" or self.failure:
            return
        changed = now.changes_from(self.state, self.settings.policy.name == "strict")
        if changed:
            self.failure = ("device_state", "a timed call left the device state changed: " + "; ".join(changed))

    def check_result(self, out: Any) -> None:
        """A timed candidate call's output: plain, and (for the sampled calls) equal to the reference's."""
        index = self.timed
        self.timed += 1
        if self.failure or not self.settings.call_checks:
            return
        impure = impure_output(out, self.template)
        if impure:
            self.failure = ("output_type", f"timed call {index}: {impure}")
            return
        if index not in self.checked:
            return
        self.n_checked += 1
        ref, ref_in = call_reference(self.models.reference, self.current, self.settings, self.call_seed)
        # as in the trials: a forward drawing random numbers has no float64 reference (its copy draws other ones)
        exact = self.models.reference64 is not None and not draws_random(self.call_seed, self.settings.device)
        mutated = changed_inputs(ref_in, self.given)
        if mutated:
            self.failure = ("inputs_modified", f"timed call {index}: the candidate modified its input(s) {mutated} in "
                            "place where the reference leaves them as they were")
            return
        policy = self.settings.policy
        comp = compare_outputs(ref, out, policy.atol, policy.rtol)
        auto = None
        if not comp.ok and policy.autocast is not None:  # as in the trials: eager under autocast is the reference
            auto, _ = call_reference(self.models.reference, self.current, self.settings, self.call_seed,
                                     autocast=policy.autocast)
            under = compare_outputs(cast_like(auto, ref), out, policy.atol, policy.rtol)
            comp = under if under.ok else comp
        if not comp.ok and exact:  # as in the trials: the exact answer counts
            comp = self._against_float64(out, ref, auto) or comp
        if not comp.ok:
            self.failure = ("timed_output_mismatch", f"timed call {index} of {len(self.checked)} checked (input set "
                            f"{(self.calls['candidate'] - 1) % len(self.pool)}): the output differs from the "
                            f"reference's for the same inputs: {comp.reason}; correct while checked, wrong while "
                            "timed")

    def _against_float64(self, out: Any, ref: Any, auto: Any = None) -> Any:
        """A passing comparison when the output is within the tolerance of the exact answer, or no less accurate
        than the policy's baseline against it (eager running TF32; `auto`, eager under autocast), as in the
        trials; else None."""
        # as in the trials: too big or not runnable in float64, eager's comparison stands alone
        ref64, _ = reference64_output(self.models, self.current, self.settings.device, self.call_seed)
        like = ref64.to(ref.device, ref.dtype) if isinstance(ref64, torch.Tensor) and isinstance(ref, torch.Tensor) \
            else None
        if like is None:
            return None
        comp = compare_outputs(like, out, self.settings.policy.atol, self.settings.policy.rtol)
        if comp.ok:
            return comp
        if as_accurate_as_baseline(self.settings, out, ref, ref64, auto):
            return Comparison(True, None, comp.max_abs, comp.max_rel, comp.mean_abs, 0, 0, comp.numel)
        return None
