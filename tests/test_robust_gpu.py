"""GPU: a BatchNorm+Dropout model and an fp16 model, optimized, then run in train and in eval mode against eager.

Run on a GPU machine: `PYTHONPATH=. python -m pytest -m gpu tests/test_robust_gpu.py`.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kernelfuse.load import load_problem
from kernelfuse.pipeline import OptimizeOptions, optimize_file

FIXTURES = Path(__file__).parent / "fixtures" / "problems"
CASES = [("tiny_bn_dropout.py", 1e-4), ("tiny_half_ctor.py", 1e-2)]


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "tol"), CASES)
def test_optimized_model_equals_eager_in_train_and_eval_mode(tmp_path, name, tol):
    out = tmp_path / f"new_{name}"
    result = optimize_file(FIXTURES / name, out, OptimizeOptions(use_gpu=True, trials=3,
                                                                 final_baselines=("eager",)), log=print)
    assert out.exists() and (result.final is None or result.final.correct), result.notes
    emitted = runpy.run_path(str(out))
    problem = load_problem(FIXTURES / name)
    torch.manual_seed(42)
    ours = emitted["ModelNew"](*problem.init_inputs()).cuda()
    reference = problem.make_model().cuda()
    for mode in ("train", "eval"):
        ours.train(mode == "train")
        reference.train(mode == "train")
        for trial in range(3):
            x = [t.cuda() for t in problem.make_inputs(seed=trial)]
            with torch.no_grad():
                if result.shipped != "unfused" and "_fallback_reason" in emitted:
                    # the fused path serves the captured (training) mode only
                    why = emitted["_fallback_reason"](ours, tuple(x))
                    assert (why is None) == (mode == "train") and (why is None or why[0] == "mode"), why
                torch.manual_seed(trial)
                got = ours(*x)
                torch.manual_seed(trial)
                expected = reference(*x)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=f"{mode} mode, trial {trial}")


@pytest.mark.gpu
def test_recurrent_op_kept_whole_runs_as_one_cudnn_call_and_equals_eager(tmp_path):
    """A GRU (captured as one `aten.gru.input` node) with a fused Linear epilogue: the emitted file calls the op
    on the GPU with the module's weights and equals eager."""
    from optimizer_helpers import write_problem

    path = write_problem(tmp_path, "grufc", """
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(64, 128, num_layers=2, batch_first=True, bidirectional=True)
            self.fc = nn.Linear(256, 32)

        def forward(self, x, h0):
            out, hn = self.rnn(x, h0)
            return torch.relu(self.fc(out[:, -1, :])) * 2.0, hn
        """, "[torch.rand(16, 50, 64), torch.rand(4, 16, 128)]")
    out = tmp_path / "grufc_new.py"
    result = optimize_file(path, out, OptimizeOptions(use_gpu=True, trials=3, final_baselines=("eager",)), log=print)
    assert result.final is None or result.final.correct, result.notes
    assert "torch.ops.aten.gru.input(" in out.read_text() or result.shipped == "unfused"
    emitted = runpy.run_path(str(out))
    problem = load_problem(path)
    torch.manual_seed(42)
    ours = emitted["ModelNew"](*problem.init_inputs()).cuda()
    reference = problem.make_model().cuda()
    x = [t.cuda() for t in problem.make_inputs(seed=0)]
    with torch.no_grad():
        for got, expected in zip(ours(*x), reference(*x), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
