"""Summary statistics of timing samples: the median is the headline, the spread says how far to trust it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TimingStats:
    """Milliseconds: median and mean, the interquartile range (p25..p75), extremes and the count."""

    n: int
    median: float
    mean: float
    std: float
    min: float
    max: float
    p25: float
    p75: float

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25

    @property
    def spread_pct(self) -> float:
        """IQR as a percentage of the median: a difference between versions smaller than this is noise."""
        return 100.0 * self.iqr / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "iqr": self.iqr}

    def describe(self) -> str:
        """`2.731 ms (IQR 2.725-2.740, min 2.719, n=20)`."""
        return (f"{self.median:.3f} ms (IQR {self.p25:.3f}-{self.p75:.3f}, min {self.min:.3f}, max {self.max:.3f}, "
                f"n={self.n})")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values; q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no samples")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> TimingStats:
    """Statistics of `samples` (milliseconds); ValueError if there are none."""
    values = sorted(float(s) for s in samples)
    if not values:
        raise ValueError("no timing samples to summarize")
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return TimingStats(n, percentile(values, 50), mean, std, values[0], values[-1], percentile(values, 25),
                       percentile(values, 75))


def speedup(baseline_ms: float | None, ours_ms: float | None) -> float | None:
    """baseline / ours (>1 means ours is faster); None when either is missing or ours is not positive."""
    if baseline_ms is None or ours_ms is None or ours_ms <= 0:
        return None
    return baseline_ms / ours_ms
