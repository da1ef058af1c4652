"""Write every plan variant of a problem as its own ModelNew file, on the CPU, to profile them on a GPU machine.

`kernelfuse optimize` keeps only the variant that ships; a profile of the others (why a fused plan lost to eager)
needs their files:
    python benchmarks/emit_variants.py OUT_DIR PROBLEM.py [PROBLEM.py ...] [--precision bf16]
    PYTHONPATH=. python benchmarks/kernel_profile.py PROBLEM.py OUT_DIR/<name>__<variant>.py --compile
Files are named `<problem>__<variant>.py` (strict precision unless --precision says otherwise, captured under
autocast for bf16 as optimize does; no convolution layouts measured: the default ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kernelfuse.capture import build_model, capture
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import optimizer_variants
from kernelfuse.rewrite import apply_rules


def main(out: Path, problems: list[str], precision: str = "strict") -> None:
    out.mkdir(parents=True, exist_ok=True)
    autocast = torch.bfloat16 if precision == "bf16" else None
    for path in problems:
        problem = load_problem(path)
        graph = apply_rules(capture(problem, build_model(problem), autocast=autocast)).graph
        for plan in optimizer_variants(graph, precision):
            target = out / f"{problem.name}__{plan.variant}.py"
            target.write_text(emit_file(problem, plan, f"variant {plan.variant}, written for profiling"))
            print(target)


if __name__ == "__main__":
    argv = sys.argv[1:]
    chosen = "strict"
    if "--precision" in argv:
        at = argv.index("--precision")
        chosen = argv[at + 1]
        del argv[at:at + 2]
    if len(argv) < 2:
        sys.exit(__doc__)
    main(Path(argv[0]), argv[1:], chosen)
