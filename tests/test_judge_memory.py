"""The judge fits wherever the model fits: the float64 reference and the poison reserve are sized from free memory
(the free-memory queries monkeypatched here), and running out of it degrades the check or is a clear verdict."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernelfuse.judge.worker as worker
import kernelfuse.verify.memory as memory
from kernelfuse.judge.calls import Models, reference64_output
from kernelfuse.judge.evaluate import _status
from kernelfuse.verify.float64 import float64_model
from kernelfuse.verify.memory import Placement, device_free_bytes, place_float64, poison_budget

GIB = 2**30
CUDA = torch.device("cuda", 0)


class FakeOutcome:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture
def free(monkeypatch):
    """Set the device's and the host's free bytes."""
    def set_free(device: int | None, host: int | None) -> None:
        monkeypatch.setattr(memory, "device_free_bytes", lambda d: device if d.type == "cuda" else None)
        monkeypatch.setattr(memory, "host_free_bytes", lambda: host)
    return set_free


def test_float64_reference_on_the_device_when_it_fits(free):
    free(10 * GIB, 100 * GIB)
    assert place_float64(9 * GIB, CUDA) == Placement(CUDA, None)


def test_float64_reference_on_the_host_when_only_the_host_holds_it(free):
    free(10 * GIB, 100 * GIB)
    placement = place_float64(35 * GIB, CUDA)
    assert placement.device == torch.device("cpu")
    assert "runs on the CPU" in placement.note and "35.0 GiB" in placement.note


def test_no_float64_reference_when_nothing_holds_it(free):
    free(10 * GIB, 20 * GIB)
    placement = place_float64(35 * GIB, CUDA)
    assert placement.device is None
    assert "compare with eager under the policy's tolerance only" in placement.note


def test_on_the_cpu_the_float64_reference_stays_with_the_model(free):
    free(None, 0)
    assert place_float64(35 * GIB, torch.device("cpu")).device == torch.device("cpu")


def test_device_free_bytes_counts_cached_blocks_and_the_process_share(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 8 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)
    headroom = memory.HEADROOM_BYTES + int(memory.HEADROOM_FRACTION * 80 * GIB)
    assert device_free_bytes(CUDA) == 40 * GIB + 2 * GIB - headroom
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.25)  # a 20 GiB share
    assert device_free_bytes(CUDA) == (20 - 8) * GIB + 2 * GIB - headroom
    assert device_free_bytes(torch.device("cpu")) is None


def test_poison_reserve_is_cut_to_free_memory(monkeypatch):
    monkeypatch.setattr(memory, "device_free_bytes", lambda d: 3 * GIB)
    assert poison_budget(16 * GIB, CUDA) == 3 * GIB
    assert poison_budget(1 * GIB, CUDA) == 1 * GIB
    monkeypatch.setattr(memory, "device_free_bytes", lambda d: 0)
    assert poison_budget(1 * GIB, CUDA) == 0


def _probe(peak: int) -> SimpleNamespace:
    return SimpleNamespace(peak_bytes=peak)


def test_worker_runs_without_float64_reference_when_it_does_not_fit(free):
    free(1 * GIB, 1 * GIB)
    out = FakeOutcome()
    model = torch.nn.Linear(4, 4)
    ref64, where = worker._float64_reference(out, model, lambda: torch.nn.Linear(4, 4), _probe(10 * GIB), CUDA)
    assert ref64 is None and where is None
    assert len(out.warnings) == 1 and "policy's tolerance only" in out.warnings[0]


def test_worker_places_float64_reference_on_the_host(free):
    free(1 * GIB, 100 * GIB)
    out = FakeOutcome()
    model = torch.nn.Linear(4, 4)
    ref64, where = worker._float64_reference(out, model, lambda: torch.nn.Linear(4, 4), _probe(10 * GIB), CUDA)
    assert where == torch.device("cpu") and next(ref64.parameters()).dtype == torch.float64
    assert torch.equal(ref64.weight, model.weight.double())
    assert "runs on the CPU" in out.warnings[0]


def test_worker_degrades_when_the_float64_copy_runs_out_of_memory(free, monkeypatch):
    free(100 * GIB, 100 * GIB)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(worker, "float64_model", oom)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = FakeOutcome()
    assert worker._float64_reference(out, torch.nn.Linear(4, 4), None, _probe(0), CUDA) == (None, None)
    assert "did not fit in device memory after all" in out.warnings[0]


def test_float64_run_out_of_memory_skips_the_rule_for_that_trial():
    class Hungry(torch.nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    model = torch.nn.Identity()
    models = Models(model, model, Hungry(), torch.device("cpu"))
    out, why = reference64_output(models, [torch.rand(3)], torch.device("cpu"), 0)
    assert out is None and "does not fit" in why


def test_float64_reference_on_another_device_gets_its_inputs_there():
    seen = []

    class Where(torch.nn.Module):
        def forward(self, x):
            seen.append((x.device, x.dtype))
            return x * 2

    models = Models(torch.nn.Identity(), torch.nn.Identity(), Where(), torch.device("cpu"))
    out, why = reference64_output(models, [torch.rand(3)], torch.device("meta"), 0)
    assert why is None and seen == [(torch.device("cpu"), torch.float64)]


def test_float64_model_builds_on_the_requested_device():
    model = torch.nn.Linear(3, 2)
    copy = float64_model(model, lambda: torch.nn.Linear(3, 2), torch.device("meta"))
    assert copy.weight.device.type == "meta" and copy.weight.dtype == torch.float64
    assert model.weight.dtype == torch.float32


def test_judge_out_of_memory_is_a_clear_verdict_not_an_internal_error(tmp_path: Path):
    failure = {"kind": "out_of_memory", "stage": "trials",
               "message": "OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB"}
    run = SimpleNamespace(timed_out=False, log_path=tmp_path / "log", returncode=0)
    cand = SimpleNamespace(path=str(tmp_path / "c.py"), block=False)
    status, reason, _ = _status(run, {"finished": True}, failure, cand, SimpleNamespace(), {}, True, [])
    assert status == "runtime_error"
    assert "out of device memory at the judge's trials stage" in reason and "16.00 GiB" in reason


@pytest.mark.gpu
def test_float64_reference_that_does_not_fit_the_device_runs_on_the_host():
    """A 1 GiB input under a 4 GiB share of the GPU: the float64 run (2 GiB input, 2 GiB output, 2 GiB state of
    the judge's copies) does not fit beside the float32 copies, so the worker places it on the host."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(4 * GIB / total, 0)
    try:
        x = torch.rand(256, 1024, 1024, device="cuda")  # 1 GiB
        y = torch.nn.functional.avg_pool1d(x, 3, 1, 1)
        need = memory.float64_need(0, 2 * x.numel() * 4)
        placement = place_float64(need, CUDA)
        assert placement.device == torch.device("cpu"), placement
        out = FakeOutcome()
        model = torch.nn.AvgPool1d(3, 1, 1).cuda()
        ref64, where = worker._float64_reference(out, model, lambda: torch.nn.AvgPool1d(3, 1, 1), _probe(need), CUDA)
        models = Models(model, model, ref64, where)
        got, why = reference64_output(models, [x], CUDA, 0)
        assert why is None and got.device.type == "cpu"
        assert torch.allclose(got.float(), y.cpu(), atol=1e-6)  # compared on the host: the device share is full
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


BIG_POOL = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.AvgPool3d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(x)


def get_inputs():
    return [torch.rand(8, 16, 64, 128, 256)]  # 1 GiB: its float64 run needs ~4.7 GiB


def get_init_inputs():
    return []
'''


@pytest.mark.gpu
def test_judge_with_a_nearly_full_gpu_runs_the_float64_reference_on_the_host(tmp_path):
    """The whole judge, in its own worker, on a GPU the test fills but for 8 GiB: the float32 judging fits, the
    float64 reference does not and runs on the CPU; the verdict is correct and says so (was: internal_error,
    CUDA out of memory, on level-1 average pooling)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kernelfuse.judge import EvalOptions, evaluate

    problem = tmp_path / "big_pool.py"
    problem.write_text(BIG_POOL)
    candidate = tmp_path / "candidate.py"
    candidate.write_text(BIG_POOL + "\n\nModelNew = Model\n")
    free, _ = torch.cuda.mem_get_info(0)
    hog = torch.empty(free - 8 * GIB, dtype=torch.uint8, device="cuda")
    try:
        verdict = evaluate(problem, candidate, EvalOptions(trials=2, baselines=("eager",), timing_reps=5))
    finally:
        del hog
        torch.cuda.empty_cache()
    assert verdict.status == "ok", verdict.reason
    assert any("runs on the CPU" in w for w in verdict.warnings), verdict.warnings
