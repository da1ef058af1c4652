"""`bench --report OUT.html`: one self-contained HTML file (plots embedded as base64 PNGs, no scripts; the only
links are to the emitted ModelNew files, relative to the report) that shows a suite at a glance: the summary table
with a geometric mean per baseline, the speedup distributions over eager and torch.compile per level, every
problem's speedup sorted over each baseline timed, achieved time against the floor estimate, failures, a
per-problem table (the shipped variant, the library anchors' implementation, the share of GPU time in kernels of
its own, the file) and the plans: kernels, what stayed unfused and why, estimated bytes moved eager against fused.
A run without a GPU has no timings: its report leaves the plots out and shows the plans.

matplotlib is optional (`pip install 'kernelfuse[report]'`) and imported only here, with the Agg backend.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from pathlib import Path
from typing import Any

from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.plan_html import anchors_cell, plans_section, shipped_plan
from kernelfuse.suite.roofline import roofline_figure
from kernelfuse.suite.summary import FAST_P, Summary, failure_cause, level_name, speedups

INSTALL = "pip install 'kernelfuse[report]'  (or: pip install matplotlib)"
OK_COLOR, SLOW_COLOR, FAIL_COLOR = "#2a9d8f", "#e9c46a", "#b0b0b0"
STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td.l{text-align:left}tr.fail td{color:#888}img{max-width:100%;display:block;margin:1em 0}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em}"""


def require_matplotlib() -> None:
    """Raise a one-line error with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SuiteError(f"--report needs matplotlib, which is not installed: {INSTALL}") from None


BASELINE_TITLES = {"eager": "eager", "compile": "torch.compile", "compile-ro": "torch.compile reduce-overhead",
                   "compile-max": "torch.compile max-autotune-no-cudagraphs"}


def write_report(records: list[dict[str, Any]], summary: Summary, path: Path) -> None:
    """Write the HTML report of `records` to `path` (links to emitted files are relative to its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(records, summary, path.parent), encoding="utf-8")


def render_report(records: list[dict[str, Any]], summary: Summary, base: Path | None = None) -> str:
    """The report's HTML text; `base` is the report's folder, for the links to emitted files."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    devices = sorted({str(r.get("device")) for r in records if r.get("device") not in (None, "unknown", "cpu")})
    precisions = sorted({str(r["precision"]) for r in records if r.get("precision")})
    baselines = _baselines(records)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kernelfuse bench</title><style>{STYLE}"
             f"</style></head><body><h1>kernelfuse bench: {len(records)} problem(s)</h1>",
             f"<p>device: {html.escape(', '.join(devices) or 'no GPU (nothing timed)')} · precision: "
             f"{html.escape(', '.join(precisions) or 'not recorded')} · baselines timed: "
             f"{html.escape(', '.join(baselines) or 'none')}</p>",
             "<h2 id='summary'>Summary</h2>", _summary_table(summary)]
    if any(r.get("correctness") and r.get("runtime_ms") for r in records):
        parts += ["<h2 id='distribution'>Speedup distribution</h2>", _img(_distribution(records))]
        parts += ["<h2 id='per-problem'>Per-problem speedup</h2>"]
        parts += [f"<h3 id='per-problem-{name}'>over {html.escape(BASELINE_TITLES.get(name, name))}</h3>"
                  + _img(_bars(records, name)) for name in baselines]
        parts += ["<h2 id='floor'>Achieved time vs floor estimate</h2>", _img(_floor(records))]
        parts += ["<h2 id='roofline'>Time over the floor: ours, eager, torch.compile</h2>",
                  _img(roofline_figure(records))]
    else:
        parts.append("<p class='note'>No problem was timed (no GPU ran): the plots are left out; the plans below "
                     "show what each problem's fusion does and the traffic it saves by estimate.</p>")
    parts += ["<h2 id='problems'>Problems</h2>", _problem_table(records, baselines, base),
              plans_section(records), "</body></html>"]
    return "\n".join(parts)


def _baselines(records: list[dict[str, Any]]) -> list[str]:
    """Baselines any correct record was timed against, in the order timed."""
    return list(dict.fromkeys(n for r in records if r.get("correctness") for n in speedups(r)))


def _summary_table(summary: Summary) -> str:
    names = summary.baselines or ["eager", "compile"]
    head = "".join(f"<th>fast_{p:g}</th>" for p in FAST_P)
    head += "".join(f"<th>geomean vs {html.escape(BASELINE_TITLES.get(n, n))}</th>" for n in names)
    rows = "".join(
        f"<tr><td class='l'>{s.level}</td><td>{s.problems}</td><td>{s.correct}</td>"
        + "".join(f"<td>{s.fast_p[p]:.2f}</td>" for p in FAST_P)
        + "".join(f"<td>{_x(s.geomeans.get(n))}</td>" for n in names) + "</tr>" for s in summary.levels)
    table = f"<table class='summary'><tr><th>level</th><th>problems</th><th>correct</th>{head}</tr>{rows}</table>"
    failures = "".join(f"<tr><td class='l'>{html.escape(c)}</td><td>{n}</td></tr>"
                       for c, n in sorted(summary.failures.items(), key=lambda kv: -kv[1]))
    return table + (f"<table class='failures'><tr><th>failure cause</th><th>problems</th></tr>{failures}</table>"
                    if failures else "<p>no failures</p>")


def _problem_table(records: list[dict[str, Any]], baselines: list[str], base: Path | None) -> str:
    """One row per problem; the timing columns only where something was timed (a CPU-only run has none)."""
    timed = any(r.get("runtime_ms") is not None for r in records)
    names = baselines or ["eager", "compile"]
    rows = []
    for r in sorted(records, key=lambda r: (level_name(r), r.get("problem_id") or 0, r["key"])):
        cls = "" if r.get("correctness") else " class='fail'"
        times = r.get("baselines") or {"eager": {"ms": r.get("eager_ms")}, "compile": {"ms": r.get("compile_ms")}}
        ratios = speedups(r) if r.get("correctness") else {}
        cells = ([_ms(r.get("runtime_ms"))] + [_ms((times.get(n) or {}).get("ms")) for n in names]
                 + [_ms(r.get("floor_ms"))] + [_x(ratios.get(n)) for n in names]
                 + [_share(r.get("custom_kernel_share"))]) if timed else []
        reason = "" if r.get("correctness") else failure_cause(r) + ": " + str(r.get("reason") or "")
        status = html.escape(str(r.get("status")))
        plan = shipped_plan(r)
        rows.append(f"<tr{cls}><td class='l'>{html.escape(r['key'])}</td><td class='l'>{status}</td>"
                    + "".join(f"<td>{c}</td>" for c in cells)
                    + f"<td class='l'>{html.escape(str(r.get('shipped') or '-'))}</td>"
                    + f"<td class='l'>{anchors_cell(plan)}</td><td class='l'>{_file_link(r, base)}</td>"
                    + f"<td class='l'>{html.escape(reason[:300])}</td></tr>")
    head = ("<th>ours ms</th>" + "".join(f"<th>{html.escape(n)} ms</th>" for n in names) + "<th>floor ms</th>"
            + "".join(f"<th>vs {html.escape(n)}</th>" for n in names) + "<th>custom kernel share</th>") if timed else ""
    return (f"<table class='problems'><tr><th>problem</th><th>status</th>{head}<th>shipped</th>"
            "<th>library anchors</th><th>file</th><th>why not correct</th></tr>" + "".join(rows) + "</table>")


def _file_link(record: dict[str, Any], base: Path | None) -> str:
    """A link to the emitted file, relative to the report's folder (absolute without one)."""
    output = record.get("output")
    if not output:
        return "-"
    target = Path(output)
    href = os.path.relpath(target, base) if base is not None else target.as_posix()
    return f"<a href='{html.escape(Path(href).as_posix(), quote=True)}'>{html.escape(target.name)}</a>"


def _share(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _distribution(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    levels = sorted({level_name(r) for r in records})
    fig, axes = plt.subplots(len(levels), 2, figsize=(11, 2.8 * len(levels)), squeeze=False)
    for row, level in enumerate(levels):
        mine = [r for r in records if level_name(r) == level and r.get("correctness")]
        for col, (field, label) in enumerate((("speedup_eager", "eager"), ("speedup_compile", "torch.compile"))):
            ax = axes[row][col]
            values = [r[field] for r in mine if r.get(field)]
            if values:
                lo, hi = min(min(values), 0.5), max(max(values), 2.0)
                bins = [lo * (hi / lo) ** (i / 24) for i in range(25)]
                ax.hist(values, bins=bins, color=OK_COLOR, edgecolor="white")
                ax.set_xscale("log")
            else:
                ax.text(0.5, 0.5, "no timed correct problem", ha="center", va="center", transform=ax.transAxes)
            ax.axvline(1.0, color="#333", linestyle="--", linewidth=1)
            ax.set_title(f"{level}: speedup over {label} ({len(values)} timed)", fontsize=10)
            ax.set_ylabel("problems")
    fig.tight_layout()
    return fig


def _bars(records: list[dict[str, Any]], baseline: str) -> Any:
    import matplotlib.pyplot as plt

    def value(r: dict[str, Any]) -> float:
        return speedups(r).get(baseline, 0.0) if r.get("correctness") else 0.0

    ranked = sorted(records, key=lambda r: -value(r) if r.get("correctness") else 1.0)
    values = [value(r) for r in ranked]
    colors = [FAIL_COLOR if not r.get("correctness") else OK_COLOR if v > 1.0 else SLOW_COLOR
              for r, v in zip(ranked, values, strict=True)]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.22 * len(ranked) + 2), 4.5))
    xs = range(len(ranked))
    ax.bar(xs, values, color=colors)
    for x, r in zip(xs, ranked, strict=True):
        if not r.get("correctness"):
            ax.text(x, 0.02, failure_cause(r).split(" ")[0], rotation=90, fontsize=6, ha="center", va="bottom")
    ax.axhline(1.0, color="#333", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["key"].split("/")[-1][:28] for r in ranked], rotation=90, fontsize=6)
    title = BASELINE_TITLES.get(baseline, baseline)
    ax.set_ylabel(f"speedup over {title} (x)")
    ax.set_title(f"green: faster than {title} · yellow: correct, not faster · grey: not correct (cause)", fontsize=9)
    fig.tight_layout()
    return fig


def _floor(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5))
    points = [(r["floor_ms"], r["runtime_ms"], r.get("eager_ms")) for r in records
              if r.get("correctness") and r.get("floor_ms") and r.get("runtime_ms")]
    if points:
        ax.scatter([p[0] for p in points], [p[1] for p in points], color=OK_COLOR, label="ours", zorder=3)
        eager = [(p[0], p[2]) for p in points if p[2]]
        ax.scatter([e[0] for e in eager], [e[1] for e in eager], color="#999", marker="x", label="eager", zorder=2)
        lo = min(min(p[0] for p in points), min(p[1] for p in points))
        hi = max(max(p[1] for p in points), max(e[1] for e in eager) if eager else 0.0)
        ax.plot([lo, hi], [lo, hi], color="#333", linestyle="--", linewidth=1, label="time = floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no floor estimates (needs timed, correct problems on a GPU)", ha="center",
                va="center", transform=ax.transAxes, fontsize=9)
    ax.set_xlabel("floor estimate (ms): FLOPs over peak, bytes over bandwidth")
    ax.set_ylabel("achieved median (ms)")
    fig.tight_layout()
    return fig


def _img(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return f"<img alt='plot' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode('ascii')}'>"


def _x(value: Any) -> str:
    return f"{value:.3f}x" if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else "-"


def _ms(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"
