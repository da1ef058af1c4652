"""The fuzzer's CPU stages in a child process (`worker.serve`), so that a model which kills the process (a segfault
inside torch has been seen) or hangs costs one model's answer, not the run.

Tasks: `{"generate": [seed, index]}` answers the model's spec, pickled (the generator runs each drawn op on real
tensors, so it can meet the same crash); `{"problem": path, "measure_layouts": bool}` answers the classified run
(`run.run_problem`);
`{"eager_only": path}` only builds the model and runs its eager forward, answering `{"eager": "ok"}`: the fuzzer
asks it in a fresh child after a death, to tell a model eager cannot run from a failure of kernelfuse.
"""

from __future__ import annotations

import base64
import copy
import pickle
import sys
from pathlib import Path

import torch

from kernelfuse.capture import build_model
from kernelfuse.fuzz.generate import generate
from kernelfuse.fuzz.run import run_problem
from kernelfuse.fuzz.worker import serve
from kernelfuse.load import load_problem


def _handle(task: dict) -> tuple[dict, bool]:
    if "generate" in task:
        spec = generate(*task["generate"])
        return {"spec": base64.b64encode(pickle.dumps(spec)).decode()}, True
    if "eager_only" in task:
        try:
            problem = load_problem(Path(task["eager_only"]))
            model = build_model(problem)
            with torch.no_grad():
                copy.deepcopy(model)(*problem.make_inputs(0))
        except Exception as err:  # noqa: BLE001 - eager cannot run it: what the fuzzer wants to know
            return {"eager": f"raised {type(err).__name__}"}, True
        return {"eager": "ok"}, True
    run = run_problem(Path(task["problem"]), task.get("measure_layouts", False))
    o = run.outcome
    return {"status": o.status, "stage": o.stage, "reason": o.reason,
            "emitted": [[e.variant, e.text, e.cuda] for e in run.emitted]}, True


if __name__ == "__main__":
    sys.exit(serve(_handle))
