"""The roofline view of a bench run: each problem's time over its floor estimate for ours, eager and
torch.compile, as a markdown table (benchmarks/level1_roofline.py) and a plot for the HTML report.

A ratio of 1.0 is the floor (bytes over the measured copy bandwidth, or FLOPs over the measured peak); the issue's
level-1 criterion is within 1.25x of it, or faster than both eager and torch.compile.
"""

from __future__ import annotations

import math
from typing import Any

CRITERION = 1.25  # within this factor of the floor, or faster than both baselines
SERIES = (("runtime_ms", "ours", "#2a9d8f"), ("eager_ms", "eager", "#999999"),
          ("compile_ms", "torch.compile", "#e76f51"))


def over_floor(record: dict[str, Any], field: str) -> float | None:
    """`record[field]` over its floor, or None where either is missing."""
    value, floor = record.get(field), record.get("floor_ms")
    ok = isinstance(value, (int, float)) and isinstance(floor, (int, float)) and floor > 0 and math.isfinite(value)
    return value / floor if ok else None


def meets_criterion(record: dict[str, Any]) -> bool:
    """Within CRITERION of the floor, or faster than both eager and torch.compile (correct results only)."""
    ratio = over_floor(record, "runtime_ms")
    if not record.get("correctness") or ratio is None:
        return False
    faster = all((record.get(f) or 0.0) > 1.0 for f in ("speedup_eager", "speedup_compile"))
    return ratio <= CRITERION or faster


def roofline_table(records: list[dict[str, Any]]) -> str:
    """Markdown: per problem ours / eager / torch.compile ms, the floor, each over the floor, and the criterion."""
    lines = ["| problem | shipped | ours ms | eager ms | compile ms | floor ms | ours/floor | eager/floor | "
             "compile/floor | vs compile | criterion |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    met = 0
    for r in sorted(records, key=lambda r: (r.get("level") or 0, r.get("problem_id") or 0)):
        ms = [_num(r.get(f)) for f in ("runtime_ms", "eager_ms", "compile_ms", "floor_ms")]
        ratios = [_num(over_floor(r, f), 2) for f, _, _ in SERIES]
        ok = meets_criterion(r)
        met += ok
        status = "met" if ok else ("not correct: " + str(r.get("reason") or r.get("status"))[:60]
                                   if not r.get("correctness") else "**missed**")
        lines.append(f"| {r.get('problem_name') or r.get('key')} | {r.get('shipped') or r.get('status')} | "
                     + " | ".join(ms + ratios) + f" | {_num(r.get('speedup_compile'))}x | {status} |")
    lines.append(f"\n{met} of {len(records)} within {CRITERION}x of the floor or faster than both baselines")
    return "\n".join(lines)


def roofline_figure(records: list[dict[str, Any]]) -> Any:
    """Grouped bars per correct, timed problem: ours, eager and torch.compile over the floor (log scale), the
    floor and the criterion as lines."""
    import matplotlib.pyplot as plt

    rows = sorted((r for r in records if r.get("correctness") and over_floor(r, "runtime_ms")),
                  key=lambda r: -(over_floor(r, "runtime_ms") or 0.0))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.33 * len(rows) + 2), 4.8))
    if not rows:
        ax.text(0.5, 0.5, "no timed, correct problem with a floor estimate", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
        return fig
    width = 0.27
    for i, (field, label, color) in enumerate(SERIES):
        values = [over_floor(r, field) or 0.0 for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, color=color, label=label)
    ax.axhline(1.0, color="#333", linewidth=1, label="floor")
    ax.axhline(CRITERION, color="#333", linestyle="--", linewidth=1, label=f"{CRITERION}x floor")
    ax.set_yscale("log")
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels([str(r.get("problem_name") or r.get("key"))[:28] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("time over the floor estimate (x)")
    ax.legend(fontsize=8, ncol=5)
    fig.tight_layout()
    return fig


def _num(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"
