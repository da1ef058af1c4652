"""Write every plan variant of a problem as its own ModelNew file, on the CPU, to profile them on a GPU machine.

`kernelfuse optimize` keeps only the variant that ships; a profile of the others (why a fused plan lost to eager)
needs their files:
    python benchmarks/emit_variants.py OUT_DIR PROBLEM.py [PROBLEM.py ...] [--precision bf16]
    PYTHONPATH=. python benchmarks/kernel_profile.py PROBLEM.py OUT_DIR/<name>__<variant>.py --compile
Files are named `<problem>__<variant>.py` (strict precision unless --precision says otherwise, captured under
autocast for bf16 as optimize does; no convolution layouts measured: the default ones). `--measured`, on a GPU:
each convolution's layout and its fp32-or-TF32 arithmetic measured first, as `kernelfuse optimize` plans them (the
channels-last graph then keeps TF32 off where eager's convolution is exact fp32).

`--onchip 512x48,256x24,...` writes each plan that has an on-chip row kernel (kernelfuse.codegen.onchip) once per
tiling as well, `<problem>__<variant>__onchip<threads>x<chunk KB>.py`: the block's threads and its chunk of the row
in KB (today's 512 x 48), to time them against each other with `kernelfuse eval PROBLEM FILE --baselines ''`.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from unittest.mock import patch

import torch

from kernelfuse.bench.layout import measure_conv_layouts
from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import onchip, reduce
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import optimizer_variants
from kernelfuse.rewrite import apply_rules


def main(out: Path, problems: list[str], precision: str = "strict", tilings: tuple[str, ...] = (),
         measured: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    autocast = torch.bfloat16 if precision == "bf16" else None
    for path in problems:
        problem = load_problem(path)
        graph = apply_rules(capture(problem, build_model(problem), autocast=autocast)).graph
        timings = measure_conv_layouts(graph, strict=precision == "strict") if measured else None
        layouts = None if timings is None else {t.node: t.choice for t in timings}
        fp32 = frozenset(t.node for t in timings or [] if t.fp32)
        for plan in optimizer_variants(graph, precision, None, layouts, fp32):
            target = out / f"{problem.name}__{plan.variant}.py"
            text = emit_file(problem, plan, f"variant {plan.variant}, written for profiling")
            target.write_text(text)
            print(target)
            if "_onchip_kernel" not in text:
                continue
            for tiling in tilings:
                with onchip_tiling(tiling):
                    target = out / f"{problem.name}__{plan.variant}__onchip{tiling}.py"
                    target.write_text(emit_file(problem, plan, f"variant {plan.variant}, on-chip tiling {tiling}"))
                print(target)


def onchip_tiling(tiling: str) -> ExitStack:
    """The on-chip row kernel's block threads and chunk bytes set from `THREADSxKB` while the stack is open."""
    threads, kb = (int(x) for x in tiling.split("x"))
    stack = ExitStack()
    stack.enter_context(patch.object(onchip, "ONCHIP_THREADS", threads))
    stack.enter_context(patch.object(reduce, "ONCHIP_THREADS", threads))
    stack.enter_context(patch.object(onchip, "CHUNK_BYTES", kb * 1024))
    return stack


if __name__ == "__main__":
    argv = sys.argv[1:]
    chosen = "strict"
    if "--precision" in argv:
        at = argv.index("--precision")
        chosen = argv[at + 1]
        del argv[at:at + 2]
    onchip_tilings: tuple[str, ...] = ()
    if "--onchip" in argv:
        at = argv.index("--onchip")
        onchip_tilings = tuple(argv[at + 1].split(","))
        del argv[at:at + 2]
    on_gpu = "--measured" in argv
    if on_gpu:
        argv.remove("--measured")
    if len(argv) < 2:
        sys.exit(__doc__)
    main(Path(argv[0]), argv[1:], chosen, onchip_tilings, on_gpu)
