"""Time several versions of one computation in the same process, alternating, so clock and thermal drift cancel.

Round r runs every version once, in an order rotated by r, so no version always runs first or after a given other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelfuse.bench.timer import Sample, Timer


def rotated(names: list[str], r: int) -> list[str]:
    """`names` rotated left by r (mod len)."""
    if not names:
        return []
    k = r % len(names)
    return names[k:] + names[:k]


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
    for r in range(reps):
        for name in rotated(names, r):
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
