"""A float64 reference that does not fit in device memory: the trial compares with eager alone and says so,
instead of ending the judgement with an internal error (level-1 L1Norm, 8 GiB fp32 input, did)."""

from __future__ import annotations

import torch

from kernelfuse.judge.calls import Models, TrialSettings
from kernelfuse.judge.trials import run_trial
from kernelfuse.verify import NumericsFlags, get_policy


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().mean(1, keepdim=True)


class TooBigInFloat64(Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")


class Off(Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.01


def _trial(candidate: torch.nn.Module):
    settings = TrialSettings(torch.device("cpu"), get_policy("strict"), 0, NumericsFlags.capture(),
                             NumericsFlags.capture(), False, 0)
    return run_trial(None, Models(Model(), candidate, TooBigInFloat64()), settings, 0, [],
                     make_inputs=lambda seed: [torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))])


def test_trial_without_float64_compares_with_eager_and_says_so():
    result = _trial(Model())
    assert result.passed and result.float64_skipped and result.err64_ours is None


def test_trial_without_float64_still_fails_a_wrong_candidate():
    result = _trial(Off())
    assert not result.passed and result.defence == "mismatch"
