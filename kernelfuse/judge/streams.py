"""Which CUDA streams did a call's kernels run on? Read from the profiler's trace.

Eager work and torch.compile run on the current stream. A candidate whose kernels also run on other streams may be
fine (if it joins them before returning) or may be hiding work from the timing events; the verdict names the
extra streams, and the host-time cross-check in bench decides whether work escaped.

The same trace gives the GPU's busy time (the summed durations of the call's kernels and copies): next to the
timed call's duration it says how much of a forward is launch overhead, which decides whether replaying the
forward from a CUDA graph is worth judging (kernelfuse.choose).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class GpuActivity:
    """The GPU work of one profiled call."""

    streams: frozenset[int]  # CUDA stream ids its kernels and copies ran on
    count: int  # kernels, copies and memsets
    busy_ms: float  # their summed durations (overlapping work counted twice)
    work: tuple[tuple[str, str, float], ...] = ()  # each one's (name, category, ms): the kernel accounting's input


def kernel_streams(fn: Callable[[], Any]) -> GpuActivity:
    """The GPU work of one call of `fn`, read from the profiler's trace; raises if profiling fails."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="kernelfuse-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    streams: set[int] = set()
    work: list[tuple[str, str, float]] = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") in GPU_CATEGORIES:
            stream = (event.get("args") or {}).get("stream")
            if stream is not None:
                streams.add(int(stream))
                work.append((str(event.get("name", "")), event["cat"], float(event.get("dur") or 0.0) / 1000))
    return GpuActivity(frozenset(streams), len(work), sum(ms for *_, ms in work), tuple(work))
