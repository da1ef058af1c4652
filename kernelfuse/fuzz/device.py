"""The fuzzer's checks that need CUDA tools: nvcc compiles of the emitted kernels (cached by source hash, in
parallel) and, on a GPU, each emitted ModelNew built and its fused forward compared with eager's, in parallel
worker processes (`GpuPool`): one model's build, hang or poisoned CUDA context never blocks the others.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernelfuse.fuzz.run import load_emitted, loosest_tolerance
from kernelfuse.fuzz.worker import Worker
from kernelfuse.load import DEFAULT_SEED, load_problem
from kernelfuse.verify.compare import compare_outputs
from kernelfuse.verify.float64 import check_float64, float64_model, to_float64

NVCC_PLACES = ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
NVCC_FLAGS = ("-std=c++17", "-arch=sm_90a", "-c")  # the target the loader builds on an H100 (its wgmma loops too)
NVCC_TIMEOUT_S = 300
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernelfuse" / "fuzz_nvcc"
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}  # the judge's strict policy: 1e-4 otherwise
STRICT = 1e-4
GPU_JOBS = 16  # GPU check workers at most (each its own CUDA context, ~0.5 GB)
GPU_TIMEOUT_S = 120.0  # one model's build and run (a first one: torch imported, CUDA started, ~15 s)


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


class GpuPool:
    """Long-lived GPU check workers (`kernelfuse.fuzz.gpuworker`), one thread each feeding it: extensions build
    and models run on every core at once, torch imported once per worker. A worker that dies, hangs past
    GPU_TIMEOUT_S or poisons its CUDA context costs only its model's answer: it is replaced."""

    def __init__(self, logs: Path, jobs: int | None = None) -> None:
        self.logs, self.jobs = logs, jobs or min(os.cpu_count() or 1, GPU_JOBS)
        self.workers = [Worker("kernelfuse.fuzz.gpuworker", logs / f"gpu_worker_{k}.log") for k in range(self.jobs)]

    def check_all(self, tasks: list[tuple[Path, Path]]) -> list[str]:
        """For each (problem file, emitted file): '' if the emitted forward matches eager on the GPU, else why."""
        results = [""] * len(tasks)
        todo: queue.Queue = queue.Queue()
        for item in enumerate(tasks):
            todo.put(item)
        threads = [threading.Thread(target=self._serve, args=(w, todo, results)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    @staticmethod
    def _serve(worker: Worker, todo: queue.Queue, results: list[str]) -> None:
        while True:
            try:
                i, (problem, emitted) = todo.get_nowait()
            except queue.Empty:
                return
            answer = worker.ask({"problem": str(problem), "emitted": str(emitted)}, GPU_TIMEOUT_S)
            results[i] = answer["wrong"] if isinstance(answer, dict) else (
                f"the GPU check's worker died on this model ({answer}; log {worker.log})")


def gpu_check(problem_path: Path, emitted_path: Path) -> str:
    """'' when the emitted file's forward on the GPU matches eager's (the judge's strict tolerance, or the float64
    rule where eager itself rounds); else what differs, or what raised."""
    try:
        problem = load_problem(problem_path)
        init = problem.init_inputs()
        reference = problem.make_model(DEFAULT_SEED, init).cuda()
        scope = load_emitted(emitted_path.read_text(), emitted_path.stem)
        torch.manual_seed(DEFAULT_SEED)
        candidate = scope["ModelNew"](*init).cuda()  # builds the extension (torch's cache, keyed by source hash)
        candidate.load_state_dict(reference.state_dict())
        guard = scope.get("_fallback_reason")  # absent from a file with no kernels
        with torch.no_grad():  # as the forward below runs: grad mode would decline the fused path
            declined = guard(candidate, tuple(problem.make_inputs(1, "cuda"))) if guard else None
            torch.manual_seed(0)
            expected = reference(*problem.make_inputs(1, "cuda"))
            torch.manual_seed(0)
            got = candidate(*problem.make_inputs(1, "cuda"))
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - the emitted file does not build or run on the GPU
        return f"the emitted file raised on the GPU: {type(err).__name__}: {str(err).strip()[:300]}"
    tol = loosest_tolerance([*problem.make_inputs(1, "cuda"), expected], TOLERANCE, STRICT)
    verdict = compare_outputs(expected, got, tol, tol)
    if verdict.ok:
        return ""
    if verdict.reason and ("shape" in verdict.reason or "dtype" in verdict.reason or "structure" in verdict.reason):
        return verdict.reason
    with torch.no_grad():
        ref64 = float64_model(reference)(*to_float64(problem.make_inputs(1, "cuda")))
    rule = check_float64(got, expected, expected, ref64)
    path = "fused" if declined is None else f"original ops (the fused path's guard declined: {declined[1]})"
    return "" if rule.ok else f"{path}: {verdict.reason}; {rule.reason}"
