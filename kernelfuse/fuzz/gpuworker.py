"""A GPU check worker: reads `{"problem": ..., "emitted": ...}` lines on stdin, builds and runs each emitted
ModelNew against eager (`kernelfuse.fuzz.device.gpu_check`) and answers `{"wrong": ...}` on stdout, one line each.

Several run side by side (`device.GpuPool`): torch is imported once per worker, not once per model. A worker whose
CUDA context a model poisoned (an illegal address is sticky) answers, then exits; the pool starts a fresh one.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints (the models, the compiler) goes to the log, not into the answers
    warnings.simplefilter("ignore")
    import torch

    from kernelfuse.fuzz.device import gpu_check

    for line in sys.stdin:
        task = json.loads(line)
        wrong = gpu_check(Path(task["problem"]), Path(task["emitted"]))
        answers.write(json.dumps({"wrong": wrong}) + "\n")
        if wrong and not _healthy(torch):
            return 3
    return 0


def _healthy(torch) -> bool:  # noqa: ANN001 - the imported module
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").sum().item() == 1.0
    except Exception:  # noqa: BLE001 - any failure: the context is gone
        return False


if __name__ == "__main__":
    sys.exit(main())
