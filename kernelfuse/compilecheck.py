"""Compile an emitted file's CUDA with nvcc where there is no GPU: "ok" must mean the file builds, not only that
its plan computes the right values (a plan can be right while its file is not: two kernels of one name).

The source compiled is the file's own `CUDA_SRC` (read back from the emitted text), with the flags
`torch.utils.cpp_extension.load_inline` gives it in the file's loader (torch's common nvcc flags, `-O3`, C++17, a
shared library), for `KERNELFUSE_NVCC_ARCH` (default sm_90, the H100). Results are cached by a hash of the
source, flags and compiler under the user cache dir; variants compile in parallel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

NVCC_PLACES = ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
# torch.utils.cpp_extension.COMMON_NVCC_FLAGS (kept here: importing cpp_extension costs a second) and the loader's
TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
LOADER_FLAGS = ("-O3", "-std=c++17", "--compiler-options", "-fPIC", "-shared", "-Xcompiler", "-fvisibility=hidden")
COMPILE_TIMEOUT_S = 600.0
CUDA_SRC = re.compile(r'^CUDA_SRC = r"""\n(.*?)"""$', re.S | re.M)
ERROR_LINE = re.compile(r"\berror\b", re.I)


@dataclass(frozen=True)
class CompileCheck:
    """One variant's file: compiled ("ok"), rejected by nvcc ("FAILED", the first error line in `note`), or not
    checked ("not run": no nvcc, or no custom kernel to build)."""

    variant: str
    status: str
    note: str

    @property
    def ok(self) -> bool:
        return self.status != "FAILED"


def find_nvcc() -> str | None:
    """nvcc on PATH, under CUDA_HOME, or in the usual places; None when there is none."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    places = ([str(Path(home) / "bin" / "nvcc")] if home else []) + list(NVCC_PLACES)
    return shutil.which("nvcc") or next((p for p in places if os.access(p, os.X_OK)), None)


def cuda_source_of(text: str) -> str | None:
    """The CUDA source an emitted file builds (its CUDA_SRC), or None for a file without custom kernels."""
    match = CUDA_SRC.search(text)
    return match.group(1) if match else None


def nvcc_command(nvcc: str, source: Path, output: Path) -> list[str]:
    arch = os.environ.get("KERNELFUSE_NVCC_ARCH", "sm_90a")  # what the loader builds on an H100
    return [nvcc, *TORCH_NVCC_FLAGS, *LOADER_FLAGS, f"-arch={arch}", str(source), "-o", str(output)]


def check_files(texts: dict[str, str], nvcc: str | None = None) -> dict[str, CompileCheck]:
    """Compile each variant's emitted file text (variant -> text) in parallel; one CompileCheck per variant."""
    nvcc = nvcc or find_nvcc()
    sources = {v: cuda_source_of(t) for v, t in texts.items()}
    if nvcc is None:
        return {v: CompileCheck(v, "not run", "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the CUDA "
                                "compile check did NOT run") for v in texts}
    todo = {v: s for v, s in sources.items() if s is not None}
    out = {v: CompileCheck(v, "not run", "no custom kernel to compile") for v, s in sources.items() if s is None}
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        for variant, check in zip(todo, pool.map(lambda item: _check(nvcc, *item), todo.items()), strict=True):
            out[variant] = check
    return {v: out[v] for v in texts}


def _check(nvcc: str, variant: str, source: str) -> CompileCheck:
    try:
        error = compile_error(nvcc, source)
    except OSError as err:  # the compiler could not be started: no verdict on the file either way
        return CompileCheck(variant, "not run", f"nvcc could not run ({err}): the CUDA compile check did NOT run")
    return CompileCheck(variant, "ok", "the file's CUDA compiles with nvcc") if error is None else \
        CompileCheck(variant, "FAILED", error)


def compile_error(nvcc: str, source: str) -> str | None:
    """None when `source` compiles into a shared library, else nvcc's first error line; cached by content."""
    key = hashlib.sha256("\0".join([source, *nvcc_command(nvcc, Path("s.cu"), Path("s.so")),
                                    _version(nvcc)]).encode()).hexdigest()
    cached = _cache_dir() / f"{key}.txt"
    if cached.exists():
        text = cached.read_text()
        return None if text == "ok" else text
    with tempfile.TemporaryDirectory(prefix="kernelfuse_nvcc_") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        try:
            run = subprocess.run(nvcc_command(nvcc, cu, Path(tmp) / "kernels.so"), capture_output=True, text=True,
                                 timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"nvcc ran past {COMPILE_TIMEOUT_S:.0f} s"  # not cached: the machine may only be busy
    error = None if run.returncode == 0 else first_error(run.stderr + run.stdout, run.returncode)
    _store(cached, "ok" if error is None else error)
    return error


def first_error(output: str, returncode: int) -> str:
    """The compiler's first line naming an error, without the temporary file's directory."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    line = next((x for x in lines if ERROR_LINE.search(x)), lines[0] if lines else f"nvcc exit code {returncode}")
    return re.sub(r"\S*/kernels\.cu", "kernels.cu", line)[:300]


@cache
def _version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kernelfuse" / "nvcc"


def _store(path: Path, text: str) -> None:
    """Write atomically (parallel runs share the cache); an unwritable cache only costs a compile next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        pass
