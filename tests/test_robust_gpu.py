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
                if result.shipped != "unfused" and "_use_kernels" in emitted:
                    # the fused path serves the captured (training) mode only
                    assert emitted["_use_kernels"](ours, tuple(x)) == (mode == "train")
                torch.manual_seed(trial)
                got = ours(*x)
                torch.manual_seed(trial)
                expected = reference(*x)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=f"{mode} mode, trial {trial}")
