"""The bare anchors: a forward's convolutions and matrix products (the library calls every version must make, or
replace), each timed alone on the shapes, strides and dtypes eager called it with.

What a fused anchor should cost: its library call alone, plus the epilogue it absorbed. The judge records the sum
beside the versions' times (`anchor_ms`), so a fused convolution's overhead over the bare cuDNN call is read off
a suite's table instead of estimated (issue 22: at most 15% over the bare anchor).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernelfuse.bench.timer import Timer

ANCHOR_OPS = frozenset({
    torch.ops.aten.convolution.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default, torch.ops.aten.addmv.default,
    torch.ops.aten.mv.default,
})


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the anchor saw it: what a stand-in needs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class AnchorCall:
    """One anchor op with its arguments, tensors replaced by their specs (hashable: identical calls group)."""

    op: Any
    args: tuple[Any, ...]

    def describe(self) -> str:
        shapes = " x ".join(str(list(a.shape)) for a in self.args if isinstance(a, TensorSpec))
        return f"{self.op.__name__.split('.')[0]} {shapes}"


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AnchorCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func in ANCHOR_OPS and not kwargs:
            self.calls.append(AnchorCall(func, tuple(_spec(a) for a in args)))
        return func(*args, **kwargs)


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    return tuple(value) if isinstance(value, list) else value


def record_anchors(fn: Callable[[], Any]) -> Counter[AnchorCall]:
    """The anchor calls one run of `fn` makes, counted (a block repeated in a loop: one call, n times)."""
    recorder = _Recorder()
    with recorder:
        fn()
    return Counter(recorder.calls)


def time_anchors(calls: Counter[AnchorCall], timer: Timer, device: torch.device) -> dict[str, Any]:
    """Each distinct anchor call timed alone (Timer.median_ms: L2 flushed before each call, as for the versions) on
    random stand-ins of its arguments; `ms` is the sum over the forward's calls."""
    rows, total = [], 0.0
    for call, count in calls.most_common():
        args = tuple(_stand_in(a, device) for a in call.args)
        ms = timer.median_ms(lambda args=args, op=call.op: op(*args))
        total += count * ms
        rows.append({"op": call.describe(), "count": count, "ms": ms})
    return {"ms": total, "calls": rows}


def _stand_in(value: Any, device: torch.device) -> Any:
    """Random values laid out as the spec says (a broadcast bias keeps its 0 strides: its storage is filled, then
    viewed)."""
    if not isinstance(value, TensorSpec):
        return value
    extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride, strict=True) if n > 0)
    storage = torch.empty(extent if all(value.shape) else 0, dtype=value.dtype, device=device)
    storage = storage.normal_() if value.dtype.is_floating_point else storage.zero_()
    return storage.as_strided(value.shape, value.stride)
