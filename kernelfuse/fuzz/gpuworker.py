"""A GPU check worker (`worker.serve`): each task `{"problem": ..., "emitted": ...}` builds and runs the emitted
ModelNew against eager (`kernelfuse.fuzz.device.gpu_check`) and answers `{"wrong": ...}`.

Several run side by side (`device.GpuPool`). A worker whose CUDA context a model poisoned (an illegal address is
sticky) answers, then exits; the pool starts a fresh one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kernelfuse.fuzz.device import gpu_check
from kernelfuse.fuzz.worker import serve


def _check(task: dict) -> tuple[dict, bool]:
    wrong = gpu_check(Path(task["problem"]), Path(task["emitted"]))
    return {"wrong": wrong}, not wrong or _healthy()


def _healthy() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").sum().item() == 1.0
    except Exception:  # noqa: BLE001 - any failure: the context is gone
        return False


if __name__ == "__main__":
    sys.exit(serve(_check))
