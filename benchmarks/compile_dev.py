"""Compile the generated CUDA of every problem in KernelBench folders with nvcc (no GPU needed): the default plan's
kernel file, built for sm_90. Usage: python benchmarks/compile_dev.py ../shared/kernelbench/level2 [...]"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite


def main(folders: list[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="kernelfuse_compile_"))
    jobs = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.py"), key=lambda p: int(p.name.split("_")[0])):
            try:
                problem = load_problem(path)
                plans = plan_variants(rewrite(capture(problem, build_model(problem))))
            except Exception as err:  # noqa: BLE001 - a problem that cannot be planned is reported, not fatal
                print(f"{path.name}: not planned ({type(err).__name__}: {err})")
                continue
            for plan in plans:
                sources = generate(plan)
                if sources is not None:
                    cu = work / f"{path.stem}_{plan.variant}.cu"
                    cu.write_text(sources.cuda)
                    jobs.append(cu)

    def compile_one(cu: Path) -> tuple[Path, subprocess.CompletedProcess]:
        cmd = ["nvcc", "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(cu.with_suffix(".o"))]
        return cu, subprocess.run(cmd, capture_output=True, text=True)

    failed = 0
    with ThreadPoolExecutor(2) as pool:
        for cu, result in pool.map(compile_one, jobs):
            failed += result.returncode != 0
            print(f"{cu.stem}: {'ok' if result.returncode == 0 else 'FAILED' + chr(10) + result.stderr[-2000:]}")
    print(f"{len(jobs) - failed}/{len(jobs)} kernel files compiled", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
