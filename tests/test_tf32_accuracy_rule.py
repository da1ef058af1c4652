"""The judge's trial under the strict policy when eager itself runs TF32: a candidate beyond 1e-4 of eager passes
only when it is no less accurate than eager against float64 (max and mean error, NaN/Inf where eager has them).

Runs on the CPU: the reference here rounds its answer to TF32's 10-bit mantissa, as cuDNN's default TF32
convolutions do on the GPU, and `uses_tf32` is what the judge's probe would find for it.
"""

from __future__ import annotations

import pytest
import torch

from kernelfuse.judge.calls import Models, TrialSettings
from kernelfuse.judge.timedcheck import TimedInputs
from kernelfuse.judge.trials import run_trial
from kernelfuse.load import load_problem
from kernelfuse.verify import NumericsFlags, float64_model, get_policy


def _round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits` explicit mantissa bits (TF32: 10, bf16: 7)."""
    mant, exp = torch.frexp(x)
    scale = float(1 << (bits + 1))
    return torch.ldexp(torch.round(mant * scale) / scale, exp)


class Exact(torch.nn.Module):
    """The answer in the model's own dtype: float64 when the judge upcasts it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3.0 + x


class TF32Eager(Exact):
    """Eager as cuDNN runs it by default: the exact answer with TF32 rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return _round_mantissa(out, 10) if out.dtype == torch.float32 else out


class Tf32Candidate(Exact):
    """A fused plan whose TF32 calls see inputs one fp32 rounding apart from eager's: TF32 rounding then goes the
    other way on some elements, a TF32 ulp (5e-4 relative) from eager and from float64, as accurate as eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _round_mantissa(super().forward(x) * (1.0 + 2.0 ** -14), 10)


class Bf16Candidate(Exact):
    """Precision lowered below eager's: bf16's 7 mantissa bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _round_mantissa(super().forward(x), 7)


class OffsetCandidate(Exact):
    """Under eager's max error times 2, but off by 1.5x that max everywhere: worse than eager on average."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1.5 * (TF32Eager()(x) - out).abs().max()


class NaNCandidate(Exact):
    """Accurate where finite, but NaN where eager is finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x).clone()
        out[0, 0] = float("nan")
        return out


def _settings(uses_tf32: bool = True, policy: str = "strict") -> TrialSettings:
    return TrialSettings(torch.device("cpu"), get_policy(policy), 0, NumericsFlags.capture(), NumericsFlags.capture(),
                         uses_tf32, 0)


def _trial(candidate: torch.nn.Module, uses_tf32: bool = True, policy: str = "strict"):
    reference = TF32Eager()
    settings = _settings(uses_tf32, policy)
    models = Models(reference, candidate, float64_model(reference))
    return run_trial(None, models, settings, 0, [],
                     make_inputs=lambda seed: [torch.randn(256, 512, generator=torch.Generator().manual_seed(seed))
                                               * 8.0])


def test_tf32_candidate_passes_on_accuracy_when_eager_is_tf32():
    result = _trial(Tf32Candidate())
    assert result.max_abs > 1e-4  # the tolerance to eager alone would reject it
    assert result.passed and result.by_accuracy, result.reason
    assert result.err64_ours <= 2 * result.err64_eager


def test_same_candidate_fails_when_eager_is_true_fp32():
    result = _trial(Tf32Candidate(), uses_tf32=False)
    assert not result.passed and result.defence == "mismatch", result


@pytest.mark.parametrize("candidate", [Bf16Candidate(), OffsetCandidate(), NaNCandidate()],
                         ids=["bf16", "offset", "nan"])
def test_less_accurate_candidates_still_fail(candidate: torch.nn.Module):
    result = _trial(candidate)
    assert not result.passed and not result.by_accuracy, result


def test_rule_is_strict_policy_only():
    # under the tf32 policy the tolerance is 1e-2 already; the rule adds nothing there and never fires
    result = _trial(Tf32Candidate(), policy="tf32")
    assert result.passed and not result.by_accuracy


PROBLEM = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x

def get_inputs():
    return [torch.randn(256, 512) * 8.0]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(("candidate", "uses_tf32", "passes"), [
    (Tf32Candidate(), True, True), (Tf32Candidate(), False, False), (Bf16Candidate(), True, False),
    (OffsetCandidate(), True, False)], ids=["tf32-eager", "fp32-eager", "bf16", "offset"])
def test_timed_calls_are_checked_by_the_same_rule(tmp_path, candidate: torch.nn.Module, uses_tf32: bool,
                                                  passes: bool):
    # the timing loop's sampled checks compare each timed call with eager on the same inputs: the rule applies
    # there too (before it, fused ResNet and DenseNet plans passed every trial and failed here)
    (tmp_path / "p.py").write_text(PROBLEM)
    reference = TF32Eager()
    models = Models(reference, candidate, float64_model(reference))
    timed = TimedInputs(load_problem(tmp_path / "p.py"), models, _settings(uses_tf32), ["candidate"], 2, 3)
    for _ in range(3):
        inputs = timed.inputs("candidate")
        timed.before_call("candidate")
        timed.check_result(candidate(*inputs))
    assert (timed.failure is None) == passes, timed.failure
    assert timed.n_checked == (3 if passes else 1)  # checks stop at the first failure
