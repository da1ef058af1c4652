"""The fuzzer's checks that need CUDA tools: nvcc compiles of the emitted kernels (cached by source hash, in
parallel) and, on a GPU, each emitted ModelNew's fused forward against eager, in this process.

Extensions are built first, all at once on every core (`kernelfuse.pipeline.prebuild`, a file at a time per
worker), so the in-process loop that follows only loads them from torch's cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernelfuse.fuzz.run import load_emitted
from kernelfuse.load import DEFAULT_SEED, load_problem
from kernelfuse.verify.compare import compare_outputs
from kernelfuse.verify.float64 import check_float64, float64_model, to_float64

NVCC_PLACES = ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
NVCC_FLAGS = ("-std=c++17", "-arch=sm_90", "-c")  # tests/test_nvcc_compile.py's flags
NVCC_TIMEOUT_S = 300
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernelfuse" / "fuzz_nvcc"
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}  # the judge's strict policy: 1e-4 otherwise
STRICT = 1e-4


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in NVCC_PLACES if os.path.exists(p)), None)


def compile_all(sources: Iterable[str], nvcc: str, jobs: int | None = None) -> dict[str, str]:
    """nvcc's first error line for each source that does not compile (the ones that do are absent); a source
    that compiled once is remembered by its hash and not compiled again."""
    distinct = list(dict.fromkeys(sources))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        errors = dict(zip(distinct, pool.map(lambda s: _compile(s, nvcc), distinct), strict=True))
    return {s: e for s, e in errors.items() if e}


def _compile(source: str, nvcc: str) -> str:
    digest = hashlib.sha256((" ".join(NVCC_FLAGS) + source).encode()).hexdigest()[:24]
    stamp = CACHE / f"{digest}.ok"
    if stamp.exists():
        return ""
    with tempfile.TemporaryDirectory(prefix="kernelfuse_fuzz_nvcc_") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        try:
            result = subprocess.run([nvcc, *NVCC_FLAGS, str(cu), "-o", str(Path(tmp) / "kernels.o")],
                                    capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"nvcc ran past {NVCC_TIMEOUT_S} s"
    if result.returncode:
        lines = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
        return "nvcc: " + (lines[0].split("kernels.cu")[-1].strip(": ") if lines else f"exit {result.returncode}")
    CACHE.mkdir(parents=True, exist_ok=True)
    stamp.touch()
    return ""


def prebuild_all(files: list[Path], jobs: int | None = None) -> None:
    """Build every emitted file's extension, one file per worker, all cores busy (results land in torch's cache)."""
    from kernelfuse.pipeline import prebuild

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        list(pool.map(lambda f: prebuild([f], NVCC_TIMEOUT_S), files))


def gpu_check(problem_path: Path, emitted_path: Path) -> str:
    """'' when the emitted file's fused forward on the GPU matches eager's (the judge's strict tolerance, or the
    float64 rule where eager itself rounds); else what differs."""
    problem = load_problem(problem_path)
    init = problem.init_inputs()
    reference = problem.make_model(DEFAULT_SEED, init).cuda()
    try:
        scope = load_emitted(emitted_path.read_text(), emitted_path.stem)
        torch.manual_seed(DEFAULT_SEED)
        candidate = scope["ModelNew"](*init).cuda()
        candidate.load_state_dict(reference.state_dict())
        fused = scope["_use_kernels"](candidate, problem.make_inputs(1, "cuda"))
        with torch.no_grad():
            torch.manual_seed(0)
            expected = reference(*problem.make_inputs(1, "cuda"))
            torch.manual_seed(0)
            got = candidate(*problem.make_inputs(1, "cuda"))
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - the emitted file does not build or run on the GPU
        return f"the emitted file raised on the GPU: {type(err).__name__}: {str(err).strip()[:300]}"
    dtype = next((t.dtype for t in _leaves(expected)), torch.float32)
    tol = TOLERANCE.get(dtype, STRICT)
    verdict = compare_outputs(expected, got, tol, tol)
    if verdict.ok:
        return ""
    if verdict.reason and ("shape" in verdict.reason or "dtype" in verdict.reason or "structure" in verdict.reason):
        return verdict.reason
    with torch.no_grad():
        ref64 = float64_model(reference)(*to_float64(problem.make_inputs(1, "cuda")))
    rule = check_float64(got, expected, expected, ref64)
    path = "fused" if fused else "original ops (the fused path's guard declined)"
    return "" if rule.ok else f"{path}: {verdict.reason}; {rule.reason}"


def _leaves(out: object) -> list[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    return [out] if isinstance(out, torch.Tensor) and out.is_floating_point() else []
