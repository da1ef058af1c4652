"""Where an emitted file's extension build spends its seconds: cold and cached `_extension()` per file, with the
C++ binding compile, the nvcc compile and the link from ninja's log, and the CPU seconds of the whole build.

    python benchmarks/build_speed.py OUT.log [--old-build] FILE.py...   (emitted files, from `kernelfuse optimize`)

--old-build first turns each file back into the previous build configuration (the binding includes
<torch/extension.h> and compiles at -O3; TORCH_CUDA_ARCH_LIST left as the environment has it), for a before/after
comparison on the same machine.

Each file builds in a fresh process against an empty TORCH_EXTENSIONS_DIR (cold), then again in a fresh process
against the same folder (cached). On a shared machine wall seconds depend on the load; CPU seconds do not (much).
Without a GPU set TORCH_CUDA_ARCH_LIST (e.g. 9.0) or torch compiles for every architecture it knows.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = "import runpy, sys; g = runpy.run_path(sys.argv[1]); g['_extension']()"
NEW_HEADERS = re.compile(r"// Only the headers these wrappers use.*?namespace torch \{ using at::Tensor; \}\n", re.S)
ARCH_OVERRIDE = "if torch.cuda.is_available():\n            os.environ[\"TORCH_CUDA_ARCH_LIST\"]"


def old_build(text: str) -> str:
    """The emitted file as the previous loader and binding header built it (see the module docstring)."""
    old, n = NEW_HEADERS.subn("#include <torch/extension.h>\n", text)
    if n != 1 or ARCH_OVERRIDE not in old or 'extra_cflags=["-O1"]' not in old:
        raise SystemExit("--old-build: this file does not have the current loader and header; emit it again")
    old = old.replace(ARCH_OVERRIDE, "if False:\n            os.environ[\"TORCH_CUDA_ARCH_LIST\"]")
    return old.replace('extra_cflags=["-O1"]', 'extra_cflags=["-O3"]')


def build_once(path: Path, ext_dir: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child and its compilers) for one `_extension()` in a fresh process,
    torch's import excluded from neither (it is the same in both)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", CODE, str(path)], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_only(path: Path) -> float:
    """Wall seconds of importing torch and executing the file without building (the floor under `cached`)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1])", str(path)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def ninja_steps(ext_dir: Path) -> dict[str, float]:
    """Seconds per ninja target (main.o: C++ binding, cuda.cuda.o: nvcc, *.so: link) from .ninja_log."""
    steps: dict[str, float] = {}
    for log in ext_dir.glob("*/.ninja_log"):
        for line in log.read_text().splitlines()[1:]:
            start, end, _, target, _ = line.split("\t")
            name = "link" if target.endswith(".so") else {"main.o": "c++", "cuda.cuda.o": "nvcc"}.get(target, target)
            steps[name] = (int(end) - int(start)) / 1000
    return steps


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    files = [Path(a) for a in rest if a != "--old-build"]
    workdir = Path(tempfile.mkdtemp(prefix="kf_build_files_"))
    if "--old-build" in rest:
        olds = [workdir / f.name for f in files]
        for f, o in zip(files, olds, strict=True):
            o.write_text(old_build(f.read_text()))
        files = olds
    label = " (old build)" if "--old-build" in rest else ""
    lines = [f"torch build timing{label} · TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')} · "
             f"{os.cpu_count()} cores",
             f"{'file':<40} {'cold s':>7} {'cold cpu s':>10} {'c++ s':>6} {'nvcc s':>6} {'link s':>6} "
             f"{'cached s':>8} {'import s':>8}"]
    for path in files:
        with tempfile.TemporaryDirectory(prefix="kf_build_") as tmp:
            cold, cpu = build_once(path, Path(tmp))
            steps = ninja_steps(Path(tmp))
            cached, _ = build_once(path, Path(tmp))
        base = import_only(path)
        lines.append(f"{path.name:<40} {cold:>7.1f} {cpu:>10.1f} {steps.get('c++', 0):>6.1f} "
                     f"{steps.get('nvcc', 0):>6.1f} {steps.get('link', 0):>6.1f} {cached:>8.2f} {base:>8.2f}")
        print(lines[-1], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
