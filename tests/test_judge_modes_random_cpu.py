"""Two judge rules found with the model zoo on the GPU, checked on the CPU.

Mode "train" (the default) is the models as constructed: a zoo problem's `Model` holds `torchvision...().eval()`
inside a module left in training mode, and the judge must not flip that inner model to training (`.train(True)`
did: its BatchNorm used batch statistics and its Dropout drew masks).

A forward that draws random numbers has no float64 reference: the float64 copy draws other numbers (on CUDA the
generator's use differs by dtype; `torch.rand_like` differs on the CPU too, which stands in for it here), so eager's
own error against it is as large as the output, and the float64 acceptance paths would accept anything.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from judge_support import evaluate_many
from torch import nn

from kernelfuse.judge import EvalOptions
from kernelfuse.judge import trials as trials_module
from kernelfuse.judge.calls import Models, TrialSettings, call_reference, draws_random
from kernelfuse.judge.timedcheck import TimedInputs
from kernelfuse.judge.trials import RANDOM_FORWARD, run_trial
from kernelfuse.judge.worker import constructed_modes, set_mode
from kernelfuse.load import load_problem
from kernelfuse.verify import NumericsFlags, float64_model, get_policy

CPU = EvalOptions(device="cpu", baselines=(), timing_reps=3, warmup=1, trials=3, timeout_s=120)

INNER_EVAL = """
import torch
import torch.nn as nn


class Model(nn.Module):
    # as the zoo builds torchvision models: the inner model in eval mode, this module left in training mode
    def __init__(self, features, hidden):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.Dropout(0.5),
                                   nn.Linear(hidden, features)).eval()

    def forward(self, x):
        return torch.sigmoid(self.inner(x))


def get_inputs():
    return [torch.rand(8, 16) * 3]


def get_init_inputs():
    return [16, 32]
"""

EVAL_CANDIDATE = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    # the inner model as built: BatchNorm on its running statistics, Dropout the identity, whatever the flags say
    def __init__(self, features, hidden):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.Dropout(0.5),
                                   nn.Linear(hidden, features))

    def forward(self, x):
        fc1, bn, _, fc2 = self.inner
        y = F.batch_norm(fc1(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        return torch.sigmoid(fc2(y))
"""

RANDOM_PROBLEM = """
import torch
import torch.nn as nn


class Model(nn.Module):
    # dropout drawn as CUDA's is: the mask depends on the dtype (torch.rand_like draws differ by dtype)
    def __init__(self, features):
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        y = self.fc(x)
        return y * (torch.rand_like(y) >= 0.5) * 2.0


def get_inputs():
    return [torch.randn(64, 32)]


def get_init_inputs():
    return [32]
"""

FLOAT64_CANDIDATE = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    # runs the forward in float64: its mask is the float64 copy's, not eager's
    def __init__(self, features):
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        y = F.linear(x.double(), self.fc.weight.double(), self.fc.bias.double())
        return (y * (torch.rand_like(y) >= 0.5) * 2.0).float()
"""


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 16)).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class RandDrop(nn.Module):
    """Dropout whose mask depends on the dtype, as on CUDA (where nn.Dropout's does): torch.rand_like."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) >= 0.5) * 2.0 if self.training else x


class Noisy(nn.Module):
    def __init__(self, drop: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.drop = drop if drop is not None else RandDrop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


class SkipsDropout(Noisy):
    """Wrong: no dropout at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class InFloat64(Noisy):
    """Wrong: the float64 copy's mask, not eager's (within tolerance of the float64 reference, not of eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.f64 = float64_model(Noisy())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f64(x.double()).float()


def _settings(uses_tf32: bool) -> TrialSettings:
    return TrialSettings(torch.device("cpu"), get_policy("strict"), 0, NumericsFlags.capture(), NumericsFlags.capture(),
                         uses_tf32, 0)


def _inputs(seed: int) -> list[torch.Tensor]:
    return [torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))]


def _trial(candidate: nn.Module, reference: nn.Module | None = None, uses_tf32: bool = True):
    reference = reference or Noisy()
    models = Models(reference, candidate, float64_model(reference))
    return run_trial(None, models, _settings(uses_tf32), 0, [], make_inputs=_inputs)


# --- mode "train": the models as constructed -------------------------------------------------------------------


def test_train_mode_keeps_each_module_as_constructed():
    model = Inner()
    constructed = constructed_modes(model)
    assert model.training and not model.inner.training
    set_mode(model, "eval", constructed)
    assert not any(m.training for m in model.modules())
    set_mode(model, "train", constructed)  # "both": back to as constructed after the eval pass
    assert model.training and not any(m.training for m in model.inner.modules())


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modes")
    (folder / "inner_eval.py").write_text(INNER_EVAL)
    (folder / "eval_candidate.py").write_text(EVAL_CANDIDATE)
    (folder / "same.py").write_text(INNER_EVAL.replace("class Model(", "class ModelNew("))
    (folder / "random.py").write_text(RANDOM_PROBLEM)
    (folder / "float64_candidate.py").write_text(FLOAT64_CANDIDATE)
    (folder / "random_same.py").write_text(RANDOM_PROBLEM.replace("class Model(", "class ModelNew("))
    inner = folder / "inner_eval.py"
    return evaluate_many({
        "eval_candidate": (inner, folder / "eval_candidate.py", CPU),
        "eval_candidate_both": (inner, folder / "eval_candidate.py", replace(CPU, mode="both")),
        "same": (inner, folder / "same.py", CPU),
        "random_float64": (folder / "random.py", folder / "float64_candidate.py", CPU),
        "random_same": (folder / "random.py", folder / "random_same.py", CPU),
    })


def test_judge_runs_inner_eval_submodule_in_eval_mode(verdicts):
    # the candidate computes the inner model in eval mode: correct only when the reference runs it so
    for key in ("eval_candidate", "eval_candidate_both", "same"):
        v = verdicts[key]
        assert v.correct, (key, v.reason)


# --- a forward that draws random numbers has no float64 reference --------------------------------------------


def test_random_forward_detection():
    settings = _settings(False)
    x = _inputs(0)
    for model, random in ((Noisy(nn.Dropout(0.5)), True), (Noisy(nn.Dropout(0.5)).eval(), False),
                          (Noisy(), True), (Noisy().eval(), False)):
        call_reference(model, x, settings, 7)
        assert draws_random(7, settings.device) is random, model
        after = torch.get_rng_state()
        assert torch.equal(after, torch.manual_seed(7).get_state())  # left as the seed put it


@pytest.mark.parametrize("candidate", [SkipsDropout(), InFloat64()], ids=["skips-dropout", "float64-mask"])
def test_wrong_candidate_of_random_forward_fails(monkeypatch, candidate: nn.Module):
    result = _trial(candidate)
    assert not result.passed and result.defence == "mismatch", result
    assert result.float64_skipped == RANDOM_FORWARD and result.err64_ours is None
    # the setup is one the float64 paths accepted before the rule (detection off: today's behaviour before it)
    monkeypatch.setattr(trials_module, "draws_random", lambda *_: False)
    assert _trial(candidate).passed


def test_random_forward_same_candidate_passes_without_float64():
    result = _trial(Noisy())
    assert result.passed and result.float64_skipped == RANDOM_FORWARD, result


def test_deterministic_forward_keeps_the_float64_reference():
    result = _trial(Noisy().eval(), Noisy().eval())
    assert result.passed and result.float64_skipped is None and result.err64_ours is not None, result


def test_timed_calls_of_random_forward_are_not_accepted_by_float64(tmp_path, monkeypatch):
    (tmp_path / "p.py").write_text(RANDOM_PROBLEM)
    problem = load_problem(tmp_path / "p.py")

    def failure() -> tuple[str, str] | None:
        reference = Noisy()
        candidate = InFloat64()
        timed = TimedInputs(problem, Models(reference, candidate, float64_model(reference)), _settings(True),
                            ["candidate"], 2, 3)
        for _ in range(3):
            inputs = timed.inputs("candidate")
            timed.before_call("candidate")
            timed.check_result(candidate(*inputs))
        return timed.failure

    found = failure()
    assert found is not None and found[0] == "timed_output_mismatch", found
    monkeypatch.setattr("kernelfuse.judge.timedcheck.draws_random", lambda *_: False)
    assert failure() is None  # accepted through the float64 reference before the rule


def test_verdict_says_why_float64_was_skipped(verdicts):
    v = verdicts["random_float64"]
    assert (v.status, v.defence) == ("incorrect", "mismatch"), v.reason
    assert any("draws random numbers" in w for w in v.warnings), v.warnings
    same = verdicts["random_same"]
    assert same.correct and any("draws random numbers" in w for w in same.warnings), same.reason


def test_every_version_gets_the_candidates_pre_call_work(tmp_path):
    # the candidate's timed calls are prepared with fresh input contents and a seed: eager's and torch.compile's
    # must be prepared alike, or identical code times slower as the candidate (0.84-0.90x on an H200, 0.94x on
    # the CPU for a seed alone)
    (tmp_path / "p.py").write_text(RANDOM_PROBLEM)
    problem = load_problem(tmp_path / "p.py")
    timed = TimedInputs(problem, Models(Noisy(), Noisy(), None), _settings(False), ["candidate", "eager"], 2, 3)
    before = timed.own["eager"][0][0].clone()
    inputs = timed.inputs("eager")
    timed.before_call("eager")
    assert inputs[0] is timed.own["eager"][0][0] and not torch.equal(inputs[0], before)
    assert torch.initial_seed() == 0 + 1_000_003 + 1  # settings.seed + CALL_SEED_OFFSET + eager's first call
    assert timed.current == [] and timed.given == []  # the candidate's own check state is untouched
    timed.after_call("eager")
    assert timed.failure is None
