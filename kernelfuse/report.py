"""`optimize --json REPORT.json`: the optimizer's result as a stable, versioned JSON document.

Built only from the pipeline's own data (Plan, CpuCheck, the judge's Verdict.to_json()), so the report says what
the run did. The schema is documented in README.md ("optimize --json"); bump SCHEMA_VERSION when a field changes
meaning or goes away (adding a field does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernelfuse import __version__
from kernelfuse.plan.ir import FusedStep, Plan

if TYPE_CHECKING:  # the pipeline imports this module: no import cycle at run time
    from kernelfuse.pipeline import OptimizeResult

SCHEMA_VERSION = 1
LIBRARIES = {"matmul": "cuBLAS", "conv": "cuDNN"}


def plan_json(plan: Plan) -> dict[str, Any]:
    """Each kernel (kind library/generated, the ATen ops it covers) and each unfused op with its reason."""
    graph = plan.graph
    kernels: list[dict[str, Any]] = []
    for step in plan.steps:
        if not hasattr(step, "replaces"):
            continue
        ops = [graph[n].op for n in step.replaces if graph[n].op != "getitem"]
        if isinstance(step, FusedStep):
            kernels.append(_anchor_json(step, ops))
        else:
            kernels.append({"name": step.kernel, "kind": "generated", "family": getattr(step, "family", None),
                            "aten_ops": ops})
    return {
        "variant": plan.variant,
        "kernels": kernels,
        "unfused": [{"node": s.node.name, "aten_op": s.node.op, "reason": s.reason} for s in plan.unfused],
    }


def _anchor_json(step: FusedStep, ops: list[str]) -> dict[str, Any]:
    """An anchor: which implementation runs it (`impl`: library, template, generated) and whether its epilogue
    runs inside the anchor's own kernel (`epilogue_in_anchor`) or in an epilogue kernel of its own."""
    anchor = step.anchor
    library = anchor.impl == "library"
    inside = anchor.epilogue_inside or (anchor.fused_relu and not step.epilogue.statements)
    return {"name": step.kernel, "kind": "library" if library else "generated", "anchor": anchor.family,
            "impl": anchor.impl, "library": LIBRARIES[anchor.family] if library else None,
            "family": None if library else "gemm-3xtf32" if anchor.family == "matmul" else
            f"conv-{'direct' if anchor.impl == 'direct' else 'igemm'}",
            "aten_ops": ops,
            "epilogue_in_anchor": inside, "epilogue_kernel": step.needs_kernel and not anchor.epilogue_inside,
            "layout": anchor.layout if anchor.family == "conv" else None}


def optimize_json(result: OptimizeResult, problem_path: str, precision: str) -> dict[str, Any]:
    """The whole report: problem, plans, CPU checks, GPU verdicts (null without a GPU), what shipped and why."""
    graph = result.plans[0].graph if result.plans else None
    mode = None if graph is None else "mixed" if graph.mixed_modes else "train" if graph.training else "eval"
    return {
        "schema_version": SCHEMA_VERSION,
        "kernelfuse_version": __version__,
        "problem": {"path": problem_path, "captured_mode": mode},
        "precision": precision,
        "output": str(result.output),
        "shipped": result.shipped,
        "rewrites": [{"rule": r.rule, "nodes": list(r.nodes), "note": r.note} for r in result.rewrites],
        "plans": [plan_json(p) for p in result.plans],
        "cpu_checks": [{"variant": c.variant, "status": c.status, "max_abs_err": c.max_abs_err, "note": c.note}
                       for c in result.cpu_checks],
        "compile_checks": [{"variant": c.variant, "status": c.status, "note": c.note} for c in result.compile_checks],
        "fallbacks": [{"stage": f.stage, "what": f.what, "reason": f.reason} for f in result.fallbacks],
        "gpu": None if result.final is None and not result.variants else {
            "variants": [{"variant": v.variant, "verdict": v.verdict.to_json()} for v in result.variants],
            "final": result.final.to_json() if result.final is not None else None,
            "cold_build_s": result.cold_build_s,
        },
        "notes": list(result.notes),
    }
