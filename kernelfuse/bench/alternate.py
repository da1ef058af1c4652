"""Time several versions of one computation in the same process, alternating, so clock and thermal drift cancel.

Round r runs every version once, in the orders of a Williams design: over a cycle of rounds every version runs
after every other one equally often. A plain rotation keeps the cyclic order (with candidate, eager, compile the
candidate always ran after torch.compile, whose Python evicts the host's caches: identical code timed 4-15% slower
as the candidate on a launch-bound problem).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelfuse.bench.timer import Sample, Timer


def balanced_orders(names: list[str]) -> list[list[str]]:
    """A Williams design over `names`: n orders (2n where n is odd) in which each version runs first equally often
    and directly after each other version equally often (first-order carry-over balanced)."""
    n = len(names)
    if n < 2:
        return [list(names)]
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[names[(j + r) % n] for j in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_alternating(
    runners: dict[str, Callable[[], Any]],
    timer: Timer,
    reps: int,
    warmup: int = 3,
    after_call: Callable[[str], None] | None = None,
    before_call: Callable[[str], None] | None = None,
    on_result: Callable[[str, Any], None] | None = None,
) -> dict[str, list[Sample]]:
    """`reps` timed samples per runner, after `warmup` untimed calls each.

    `before_call(name)` and `after_call(name)` run outside the timed region around each call: the judge sets each
    version's numerics flags and inputs before, and checks that the candidate left no threads or changed state
    behind after. `on_result(name, result)` sees what each timed call returned (the judge checks it).
    """
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            if before_call:
                before_call(name)
            runners[name]()
            if after_call:
                after_call(name)
    timer.clock.synchronize()
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    orders = balanced_orders(names)
    for r in range(reps):
        for name in orders[r % len(orders)]:
            if before_call:
                before_call(name)
            sample, result = timer.time(runners[name])
            if on_result:
                on_result(name, result)
            del result
            samples[name].append(sample)
            if after_call:
                after_call(name)
    return samples
