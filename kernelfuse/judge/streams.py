"""Which CUDA streams did a call's kernels run on? Read from the profiler's trace.

Eager work and torch.compile run on the current stream. A candidate whose kernels also run on other streams may be
fine (if it joins them before returning) or may be hiding work from the timing events; the verdict names the
extra streams, and the host-time cross-check in bench decides whether work escaped.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_streams(fn: Callable[[], Any]) -> tuple[set[int], int]:
    """(stream ids used by the GPU work of one call of `fn`, number of GPU activities); raises if profiling fails."""
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
    count = 0
    for event in trace.get("traceEvents", []):
        if event.get("cat") in GPU_CATEGORIES:
            stream = (event.get("args") or {}).get("stream")
            if stream is not None:
                streams.add(int(stream))
                count += 1
    return streams, count
