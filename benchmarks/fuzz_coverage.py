"""How many fuzz models reach the channels-last graph's paths (CPU only, planning only: nothing is checked). Per
model of a seed's run: whether a variant is `fused-cl` (kernelfuse.plan.layout.channels_last_graph), and in that
plan a pool writing channels-last (`GenStep.pools_channels_last`), cuDNN's conv+bias+ReLU on channels-last
operands (a FusedStep with `anchor.fused_relu`) and a contiguous copy inserted before a view (`<value>_contiguous`).
Usage: python benchmarks/fuzz_coverage.py SEED [N]  (N models, default 300)
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

from kernelfuse.capture.trace import build_model, capture
from kernelfuse.fuzz.generate import generate, render
from kernelfuse.load.problem import load_problem
from kernelfuse.plan.fuse import optimizer_variants
from kernelfuse.plan.ir import FusedStep, Plan
from kernelfuse.plan.layout import VIEW_OPS
from kernelfuse.rewrite.rules import apply_rules

PATHS = ("cnn_stack drawn", "fused-cl", "cl pool", "cl conv+relu", "view copy", "planning failed")


def reached(plans: list[Plan]) -> set[str]:
    """The channels-last paths these plans take (see the module's docstring)."""
    found: set[str] = set()
    for plan in plans:
        if not getattr(plan.options, "channels_last_graph", False):
            continue
        found.add("fused-cl")
        if any(step.pools_channels_last for step in plan.generated):
            found.add("cl pool")
        if any(isinstance(step, FusedStep) and step.anchor.fused_relu for step in plan.steps):
            found.add("cl conv+relu")
        if any(node.name.endswith("_contiguous") and any(u.op in VIEW_OPS for u in plan.graph.users(node.name))
               for node in plan.graph.nodes):
            found.add("view copy")
    return found


def model_paths(seed: int, index: int, folder: Path) -> set[str]:
    spec = generate(seed, index)
    found = {"cnn_stack drawn"} if any(op.kind == "cnn_stack" for op in spec.ops) else set()
    path = folder / f"{spec.name}.py"
    path.write_text(render(spec))
    try:
        problem = load_problem(path)
        graph = apply_rules(capture(problem, build_model(problem))).graph
        return found | reached(optimizer_variants(graph))
    except Exception:  # noqa: BLE001 - a refusal or a crash: the fuzzer classifies those, here it is only counted
        return found | {"planning failed"}


def main(seed: int, count: int) -> None:
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(count):
            counts.update(model_paths(seed, index, Path(tmp)))
    print(f"seed {seed}, {count} models:")
    for name in PATHS:
        print(f"  {name:16} {counts[name]:5}  ({counts[name] / max(count, 1):.1%})")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 300)
