"""Where an emitted file's kernel build spends its seconds: `_extension()` cold (empty extension cache) and cached,
per file, with the C++, nvcc and link steps from ninja's log and the CPU seconds of the whole build.

    python benchmarks/build_speed.py OUT.log FILE.py...   (emitted files, from `kernelfuse optimize`)

Each file runs in a fresh process against an empty TORCH_EXTENSIONS_DIR (cold), then again in a fresh process
against the same folder (cached). The build seconds are `_extension()` alone, timed inside the process after torch's
import and the CUDA runtime's start (which any model using the kernels has paid already); `process s` is the whole
cold process for context. On a shared machine wall seconds depend on the load; CPU seconds do not (much). Without a
GPU set TORCH_CUDA_ARCH_LIST (e.g. 9.0), or torch compiles for every architecture it knows.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = """
import runpy, sys, time
import torch
if torch.cuda.is_available():
    torch.cuda.init()
g = runpy.run_path(sys.argv[1])
start = time.perf_counter()
g["_extension"]()
print("BUILD_SECONDS", time.perf_counter() - start)
"""


def build_once(path: Path, ext_dir: Path) -> tuple[float, float, float]:
    """(seconds of `_extension()`, wall seconds of the process, CPU seconds of the process and its compilers)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CODE, str(path)], env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    build = float(done.stdout.split("BUILD_SECONDS")[-1])
    return build, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ninja_steps(ext_dir: Path) -> dict[str, float]:
    """Seconds per ninja target (main.o: the C++ file, cuda.cuda.o: nvcc, *.so: link) from .ninja_log."""
    steps: dict[str, float] = {}
    for log in ext_dir.glob("*/.ninja_log"):
        for line in log.read_text().splitlines()[1:]:
            start, end, _, target, _ = line.split("\t")
            name = "link" if target.endswith(".so") else {"main.o": "c++", "cuda.cuda.o": "nvcc"}.get(target, target)
            steps[name] = (int(end) - int(start)) / 1000
    return steps


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, files = Path(argv[0]), [Path(a) for a in argv[1:]]
    lines = [f"kernel build timing · TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')} · "
             f"{os.cpu_count()} cores",
             f"{'file':<44} {'cold s':>7} {'cold cpu s':>10} {'c++ s':>6} {'nvcc s':>6} {'link s':>6} "
             f"{'cached s':>8} {'process s':>9}"]
    for path in files:
        with tempfile.TemporaryDirectory(prefix="kf_build_") as tmp:
            cold, process, cpu = build_once(path, Path(tmp))
            steps = ninja_steps(Path(tmp))
            cached, _, _ = build_once(path, Path(tmp))
        lines.append(f"{path.parent.name + '/' + path.name:<44} {cold:>7.2f} {cpu:>10.1f} {steps.get('c++', 0):>6.2f} "
                     f"{steps.get('nvcc', 0):>6.2f} {steps.get('link', 0):>6.2f} {cached:>8.3f} {process:>9.1f}")
        print(lines[-1], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
