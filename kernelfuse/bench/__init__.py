"""Stage — bench: time eager, torch.compile and a candidate in one process, alternating, with L2 flushed.

CUDA events around each call, a warm-up, median of at least 20 with the spread, a host-time cross-check for work
escaping the events, and a floor estimate (FLOPs over peak, bytes over bandwidth) measured on the device.
"""

from kernelfuse.bench.alternate import balanced_orders, time_alternating
from kernelfuse.bench.crosscheck import escaped_work
from kernelfuse.bench.floor import (
    Ceilings,
    Floor,
    below_floor,
    capped_by,
    count_flops,
    floor_estimate,
    measure_ceilings,
    min_bytes,
    tensor_bytes,
)
from kernelfuse.bench.stats import TimingStats, percentile, speedup, summarize
from kernelfuse.bench.timer import Clock, Sample, Timer

__all__ = [
    "Ceilings", "Clock", "Floor", "Sample", "Timer", "TimingStats", "balanced_orders", "below_floor", "capped_by",
    "count_flops", "escaped_work",
    "floor_estimate", "measure_ceilings", "min_bytes", "percentile", "speedup", "summarize",
    "tensor_bytes", "time_alternating",
]
