"""What the many-variant GPU probes share (`wgmma_attention_probe.py`, `tma_conv_probe.py`): one CUDA translation
unit a variant built in parallel into one extension for sm_90a, ptxas reports without a GPU, and each variant's
checks run in child processes, so that a trap (which kills the CUDA context) or a hang ends one child only and the
variants after it are still checked and timed."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUIET = ["-diag-suppress=177"]  # each translation unit holds helpers it does not use
DONE = "@@checked "  # a child's marker after each variant: the parent knows where a trap or hang struck


def ident(name: str) -> str:
    """A variant's name as a C identifier."""
    return name.replace("-", "_")


def build_dir(name: str) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / name


def write_sources(directory: Path, sources: dict[str, str]) -> list[str]:
    """Writes the sources, leaving unchanged files alone (their mtimes keep the children's loads from rebuilding)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for file, text in sources.items():
        path = directory / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        paths.append(str(path))
    return paths


def build(name: str, sources: dict[str, str]):  # noqa: ANN201 - torch's extension module
    """The extension of all translation units, for sm_90a (wgmma, setmaxnreg and TMA need the arch-specific
    target, whatever the host sets)."""
    from torch.utils.cpp_extension import load

    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    directory = build_dir(name)
    paths = write_sources(directory / "src", sources)
    (directory / "build").mkdir(parents=True, exist_ok=True)
    return load(name, sources=paths, extra_cuda_cflags=["-O3", *QUIET], build_directory=str(directory / "build"))


def compile_only(name: str, sources: dict[str, str], label: Callable[[str], str]) -> None:
    """nvcc -Xptxas -v on every translation unit (no GPU needed): registers, spills, wgmma serialization warnings;
    `label` turns a mangled kernel name into its template arguments."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
    paths = [p for p in write_sources(build_dir(name) / "ptxas", sources) if p.endswith(".cu")]

    def one(path: str) -> tuple[str, float, str]:
        t0 = time.time()
        r = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-O3", *QUIET, "-Xptxas", "-v", "-c",
                            path, "-o", path + ".o"], capture_output=True, text=True)
        return path, time.time() - t0, r.stdout + r.stderr

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for path, seconds, log in pool.map(one, paths):
            print(f"{Path(path).name}: {seconds:.1f} s")
            kernel = spills = ""
            for line in log.splitlines():
                if "Compiling entry function" in line:
                    kernel = label(line.split("'")[1])
                elif "spill stores" in line:
                    spills = line.strip()
                elif "Used" in line:
                    print(f"  {kernel}: {line.split(':', 1)[-1].strip()}; {spills}")
                elif "(C75" in line:  # wgmma serialized, or an arrive the compiler had to add
                    print(f"  {line.split(':', 1)[-1].strip()[:160]}")
                elif "error" in line.lower() or "warning" in line.lower():
                    print(f"  {line.strip()}")
    print(f"all translation units: {time.time() - t0:.1f} s wall on {os.cpu_count()} cores")


def template_label(pattern: str, form: str) -> Callable[[str], str]:
    """A `label` for compile_only: the mangled name's template arguments through `pattern` into `form`, else the
    name itself."""
    return lambda mangled: re.sub(f".*{pattern}.*", form, mangled) if re.search(pattern, mangled) else mangled


def checked(index: int) -> str:
    """The line a child prints after variant `index`'s checks."""
    return f"{DONE}{index}"


def screen(script: str, names: list[str], timeout_s: int) -> list[int]:
    """The variants' checks in child processes (`script --check-from N`: the checks of variants N.. in order,
    `checked(i)` after each): a trap or a hang ends that child only; the next child starts after the variant that
    struck. Returns the variants a child came back from (failed checks included: they are timed, and their errors
    in the table say so)."""
    alive, first = [], 0
    while first < len(names):
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, os.path.abspath(script), "--check-from", str(first)],
                               capture_output=True, text=True, timeout=timeout_s)
            out, err, why = r.stdout, r.stderr, f"child exited {r.returncode}"
        except subprocess.TimeoutExpired as e:
            out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
            why = f"child still running after {timeout_s} s (a hang?)"
        done = [int(line[len(DONE):]) for line in out.splitlines() if line.startswith(DONE)]
        print("\n".join(line for line in out.splitlines() if not line.startswith(DONE)))
        alive += done
        last = done[-1] if done else first - 1
        if last < len(names) - 1:  # the child ended during variant last + 1
            tail = [line for line in err.splitlines() if line.strip()][-3:]
            print(f"  {names[last + 1]}: {why}; not timed. " + " / ".join(tail)[:400])
        print(f"  (child: {time.time() - t0:.1f} s)", flush=True)
        first = last + 2
    return alive


def start(script: str, names: list[str], timeout_s: int, build: Callable, compile_only: Callable[[], None],
          child_check: Callable[[int], None], parser: argparse.ArgumentParser | None = None):  # noqa: ANN201
    """A probe's first steps: `--compile-only` (ptxas only) and the internal `--check-from N` (a child's checks)
    end the run (None); else the build and every variant's checks in children, giving (arguments, the extension,
    the variants that came back)."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true", help="ptxas registers and spills, no GPU")
    parser.add_argument("--check-from", type=int, help="(internal) the checks from this variant on, in a child")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return None
    if args.check_from is not None:
        child_check(args.check_from)
        return None
    t0 = time.time()
    ext = build()
    print(f"build: {time.time() - t0:.1f} s\n", flush=True)
    t0 = time.time()
    alive = screen(script, names, timeout_s)
    print(f"\nchecks: {time.time() - t0:.1f} s; timed: {', '.join(names[i] for i in alive)}")
    return args, ext, alive
