"""Numerics-flag helpers a fused forward calls around one library call. Their source is copied into the emitted
file (which imports nothing from kernelfuse), and the layout measurement calls the same functions, so what is
timed is what the file runs."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch


def _with_tf32(call):
    """Run one matrix product with TF32 tensor cores allowed (tf32 policy); the global setting is restored."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        return call()
    finally:
        torch.set_float32_matmul_precision(previous)


def _without_tf32(call):
    """Run one cuDNN convolution with TF32 off, as accurate as eager's call on this GPU; the setting is restored."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return call()
    finally:
        torch.backends.cudnn.allow_tf32 = previous


def source_of(helper: Callable) -> str:
    """The helper's text for the emitted file."""
    return "\n" + inspect.getsource(helper)
