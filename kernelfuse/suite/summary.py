"""Suite metrics from records: KernelBench's fast_p per level, geometric-mean speedups, failures by cause.

fast_p is the fraction of ALL problems of a level that are correct and faster than eager by more than p
(speedup_eager > p), so fast_0 is the correctness rate. Geometric means are over the correct, timed problems, one
per baseline timed (eager, torch.compile and its reduce-overhead and max-autotune modes where asked for).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

FAST_P = (0.0, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class LevelSummary:
    level: str
    problems: int
    correct: int
    fast_p: dict[float, float]
    geomean_eager: float | None
    geomean_compile: float | None
    timed_eager: int
    timed_compile: int
    geomeans: dict[str, float | None] = field(default_factory=dict)  # every baseline timed: name -> geomean speedup


@dataclass(frozen=True)
class Summary:
    levels: tuple[LevelSummary, ...]
    failures: dict[str, int]

    def format_table(self) -> str:
        """Per-level rows (fast_p, geometric means) and failures by cause, as the CLI prints them."""
        extra = [n for n in self.baselines if n not in ("eager", "compile")]
        head = "level    problems  correct  " + "  ".join(f"fast_{p:g}" for p in FAST_P) + \
            "   geomean/eager  geomean/compile" + "".join(f"  {'geomean/' + n:>19}" for n in extra)
        lines = [head]
        for s in self.levels:
            fast = "  ".join(f"{s.fast_p[p]:>6.2f}" for p in FAST_P)
            lines.append(f"{s.level:<8} {s.problems:>8}  {s.correct:>7}  {fast}   {_x(s.geomean_eager):>13}  "
                         f"{_x(s.geomean_compile):>15}" + "".join(f"  {_x(s.geomeans.get(n)):>19}" for n in extra))
        if self.failures:
            lines.append("failures: " + ", ".join(f"{cause} {n}" for cause, n in sorted(self.failures.items())))
        return "\n".join(lines)

    @property
    def baselines(self) -> list[str]:
        """The baselines any level has a geometric mean for, in the order they were timed."""
        return list(dict.fromkeys(n for s in self.levels for n, g in s.geomeans.items() if g is not None))

    def to_json(self) -> dict[str, Any]:
        return {"levels": [{**s.__dict__, "fast_p": {f"{p:g}": v for p, v in s.fast_p.items()}} for s in self.levels],
                "failures": self.failures}


def level_name(record: dict[str, Any]) -> str:
    return f"level{record['level']}" if record.get("level") is not None else "other"


def summarize_records(records: list[dict[str, Any]]) -> Summary:
    """Per-level rows (plus "all" when there are several levels) and failures by cause."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(level_name(record), []).append(record)
    rows = [_level(name, groups[name]) for name in sorted(groups)]
    if len(groups) > 1:
        rows.append(_level("all", records))
    failures = Counter(failure_cause(r) for r in records if not r.get("correctness"))
    return Summary(tuple(rows), dict(failures))


def failure_cause(record: dict[str, Any]) -> str:
    """The record's status, refined by the build's cause where the build failed."""
    status = record.get("status") or "unknown"
    cause = record.get("build_cause")
    return f"{status} ({cause})" if status == "not_built" and cause else status


def geomean(values: list[float | None]) -> float | None:
    good = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in good) / len(good)) if good else None


def speedups(record: dict[str, Any]) -> dict[str, float]:
    """The record's speedup over each baseline timed (its `baselines`; a record without them: eager, compile)."""
    found = {name: b.get("speedup") for name, b in (record.get("baselines") or {}).items()}
    found.setdefault("eager", record.get("speedup_eager"))
    found.setdefault("compile", record.get("speedup_compile"))
    return {name: v for name, v in found.items() if v}


def _level(name: str, records: list[dict[str, Any]]) -> LevelSummary:
    correct = [r for r in records if r.get("correctness")]
    eager = [r["speedup_eager"] for r in correct if r.get("speedup_eager")]
    compiled = [r["speedup_compile"] for r in correct if r.get("speedup_compile")]
    fast = {p: sum(1 for r in correct if (r.get("speedup_eager") or 0.0) > p) / len(records) if p else
            len(correct) / len(records) for p in FAST_P}
    names = list(dict.fromkeys(n for r in correct for n in speedups(r)))
    geomeans = {n: geomean([speedups(r).get(n) for r in correct]) for n in names}
    return LevelSummary(name, len(records), len(correct), fast, geomean(eager), geomean(compiled), len(eager),
                        len(compiled), geomeans)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"
