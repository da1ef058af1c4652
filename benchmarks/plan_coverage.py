"""Plan coverage on a KernelBench folder (CPU only): per problem, the kernels its default plan generates (anchor
epilogues and generated kernels) and the ops left as torch calls; per level, the share of problems with at least
one generated kernel. Usage: python benchmarks/plan_coverage.py ../shared/kernelbench/level2 [...]"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

TIMEOUT_S = 120


def _plan(path: str, queue: mp.Queue) -> None:
    from kernelfuse.capture import build_model, capture
    from kernelfuse.load import load_problem
    from kernelfuse.plan import plan_variants
    from kernelfuse.rewrite import rewrite

    problem = load_problem(path)
    plan = plan_variants(rewrite(capture(problem, build_model(problem))))[-1]
    steps = [s for s in plan.fused if s.needs_kernel] + plan.generated
    kernels = [s.chain(plan.graph) for s in steps]
    queue.put((kernels, sorted({s.node.op for s in plan.unfused})))


def main(folders: list[str]) -> None:
    for folder in folders:
        files = sorted(Path(folder).glob("*.py"), key=lambda p: int(p.name.split("_")[0]))
        covered = 0
        for path in files:
            queue: mp.Queue = mp.Queue()
            proc = mp.Process(target=_plan, args=(str(path), queue))
            proc.start()
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                print(f"{path.name}: timed out after {TIMEOUT_S} s")
                continue
            if queue.empty():
                print(f"{path.name}: failed (exit {proc.exitcode})")
                continue
            kernels, unfused = queue.get()
            covered += bool(kernels)
            print(f"{path.name}: {len(kernels)} kernel(s) {kernels} | torch calls: {', '.join(unfused) or 'none'}")
        print(f"== {folder}: {covered}/{len(files)} problems with at least one generated kernel "
              f"({covered / max(len(files), 1):.0%})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
