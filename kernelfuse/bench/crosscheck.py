"""Did work escape the timed region? Compare event time with the host time of the same, synchronised call.

Events on the current stream miss work left running on a side stream or launched by a thread; a device-wide
synchronise does not. For honest code the host time exceeds the event time by a small constant (the synchronise
latency), the same for the candidate and for eager; a candidate whose gap is larger by a good margin did work the
events did not see.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernelfuse.bench.stats import percentile
from kernelfuse.bench.timer import Sample

MIN_EXCESS_MS = 0.05
EXCESS_FRACTION = 0.10


def _median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 50)


def escaped_work(candidate: Sequence[Sample], baseline: Sequence[Sample]) -> str | None:
    """A sentence describing escaped work, or None when the candidate's gap is in line with the baseline's.

    Flags when median(host - event) of the candidate exceeds the baseline's (0 without baseline samples) by more
    than max(MIN_EXCESS_MS, EXCESS_FRACTION * candidate host median).
    """
    if not candidate:
        return None
    gap = _median([s.gap_ms for s in candidate])
    base_gap = _median([s.gap_ms for s in baseline]) if baseline else 0.0
    host = _median([s.host_ms for s in candidate])
    event = _median([s.event_ms for s in candidate])
    excess = gap - base_gap
    if excess > max(MIN_EXCESS_MS, EXCESS_FRACTION * host):
        return (f"timing escape: CUDA events measured {event:.3f} ms but the synchronised call took {host:.3f} ms on "
                f"the host ({excess:.3f} ms more than {'eager' if baseline else 'a synchronise'} takes): work ran "
                f"outside the timed stream "
                f"(side stream or thread)")
    return None
