"""A plan as the suite records it: the optimize report's plan (kernels, what stayed unfused and why) plus the
estimated bytes eager and the plan move, so a report of a run without a GPU still shows what fusion would do."""

from __future__ import annotations

from typing import Any

from kernelfuse.bench.planbytes import plan_bytes
from kernelfuse.plan import Plan
from kernelfuse.report import plan_json


def plan_report(plan: Plan) -> dict[str, Any]:
    """plan_json(plan) with `bytes_eager` and `bytes_fused` (kernelfuse.bench.planbytes)."""
    moved = plan_bytes(plan)
    return {**plan_json(plan), "bytes_eager": moved.eager, "bytes_fused": moved.fused}
