"""The plans in the suite's HTML report: each problem's kernels, what stayed unfused and why, and the estimated
bytes moved eager against fused (kernelfuse.suite.plans), as recorded by `bench` in optimize mode.

Anchors may carry `impl` (which library implementation the anchor calls) and `epilogue_in_anchor` (the epilogue
runs inside the library call) where the planner records them; both are optional here.
"""

from __future__ import annotations

import html
from typing import Any

GRAPH_SUFFIX = "+graph"


def shipped_plan(record: dict[str, Any]) -> dict[str, Any] | None:
    """The plan of the variant the record shipped (a graphed variant's own plan), or None (unfused, no plans)."""
    plans = record.get("plans") or []
    shipped = str(record.get("shipped") or "").removesuffix(GRAPH_SUFFIX)
    return next((p for p in plans if p.get("variant") == shipped), None)


def _anchor(kernel: dict[str, Any]) -> str:
    text = str(kernel.get("library") or "library")
    if kernel.get("impl"):
        text += f" {kernel['impl']}"
    if kernel.get("layout"):
        text += f" [{kernel['layout']}]"
    if kernel.get("epilogue_in_anchor"):
        text += " +epilogue in the call"
    elif kernel.get("epilogue_kernel"):
        text += " +epilogue kernel"
    return text


def anchors_cell(plan: dict[str, Any] | None) -> str:
    """The library anchors of a plan, one per line (HTML-escaped), or "-"."""
    anchors = [_anchor(k) for k in (plan or {}).get("kernels", []) if k.get("kind") == "library"]
    return "<br>".join(html.escape(a) for a in anchors) or "-"


def size(nbytes: float) -> str:
    """1.5 MB, 22.7 kB, 4.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _bytes_line(plan: dict[str, Any]) -> str:
    eager, fused = plan.get("bytes_eager"), plan.get("bytes_fused")
    if not eager or fused is None:
        return "bytes moved: not estimated"
    return f"bytes moved (estimate): eager {size(eager)}, fused {size(fused)} ({fused / eager:.2f}x)"


def _plan_block(plan: dict[str, Any], shipped: bool) -> str:
    kernels = "".join(
        f"<tr><td class='l'>{html.escape(str(k.get('name')))}</td><td class='l'>{html.escape(str(k.get('kind')))}"
        f"</td><td class='l'>{html.escape(_anchor(k) if k.get('kind') == 'library' else str(k.get('family')))}</td>"
        f"<td class='l'>{html.escape(', '.join(k.get('aten_ops') or []))}</td></tr>" for k in plan.get("kernels", []))
    unfused = "".join(
        f"<tr><td class='l'>{html.escape(str(u.get('node')))}</td><td class='l'>{html.escape(str(u.get('aten_op')))}"
        f"</td><td class='l'>{html.escape(str(u.get('reason')))}</td></tr>" for u in plan.get("unfused", []))
    mark = " (shipped)" if shipped else ""
    parts = [f"<p><b>{html.escape(str(plan.get('variant')))}{mark}</b>: {len(plan.get('kernels', []))} kernel(s); "
             f"{html.escape(_bytes_line(plan))}</p>"]
    if kernels:
        parts.append("<table class='kernels'><tr><th>kernel</th><th>kind</th><th>library / family</th>"
                     f"<th>ATen ops</th></tr>{kernels}</table>")
    parts.append(f"<table class='unfused'><tr><th>unfused node</th><th>ATen op</th><th>why</th></tr>{unfused}</table>"
                 if unfused else "<p>nothing left unfused</p>")
    return "".join(parts)


def plans_section(records: list[dict[str, Any]]) -> str:
    """`<h2 id='plans'>` with one collapsible block per problem that recorded plans ("" when none did)."""
    blocks = []
    for r in sorted((r for r in records if r.get("plans")), key=lambda r: r["key"]):
        ship = shipped_plan(r)
        head = ship or r["plans"][0]
        summary = f"{r['key']}: {_bytes_line(head)}"
        body = "".join(_plan_block(p, p is ship) for p in r["plans"])
        blocks.append(f"<details class='plan'><summary>{html.escape(summary)}</summary>{body}</details>")
    if not blocks:
        return ""
    return "<h2 id='plans'>Plans</h2>" + "".join(blocks)
