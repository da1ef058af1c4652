"""Write every plan variant of a problem as its own ModelNew file, on the CPU, to profile them on a GPU machine.

`kernelfuse optimize` keeps only the variant that ships; a profile of the others (why a fused plan lost to eager)
needs their files:
    python benchmarks/emit_variants.py OUT_DIR PROBLEM.py [PROBLEM.py ...]
    PYTHONPATH=. python benchmarks/kernel_profile.py PROBLEM.py OUT_DIR/<name>__<variant>.py --compile
Files are named `<problem>__<variant>.py` (strict precision; no convolution layouts measured: the default ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernelfuse.capture import build_model, capture
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import optimizer_variants
from kernelfuse.rewrite import apply_rules


def main(out: Path, problems: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in problems:
        problem = load_problem(path)
        graph = apply_rules(capture(problem, build_model(problem))).graph
        for plan in optimizer_variants(graph, "strict"):
            target = out / f"{problem.name}__{plan.variant}.py"
            target.write_text(emit_file(problem, plan, f"variant {plan.variant}, written for profiling"))
            print(target)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])
