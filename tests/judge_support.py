"""Paths shared by the judge's tests: the repository, its fixtures, the example problems and the seed replies."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CANDIDATES = FIXTURES / "candidates"
PROBLEMS = FIXTURES / "problems"
TINY = PROBLEMS / "tiny_gemm_add_relu.py"
EXAMPLES = REPO / "examples"
SEED_DIRS = (REPO.parent / "shared" / "seeds", REPO / ".device_carry" / "seeds")
SEED_PROBLEMS = {
    "002": EXAMPLES / "gemm_add_relu.py",
    "003": EXAMPLES / "gemm_sigmoid_scaling_residualadd.py",
    "004": EXAMPLES / "conv2d_relu_biasadd.py",
}


def seed_path(number: str) -> Path:
    """The seed reply whose name starts with `number` (002, 003, 004); skips the test when the seeds are absent."""
    for folder in SEED_DIRS:
        found = sorted(folder.glob(f"{number}_*.txt")) if folder.is_dir() else []
        if found:
            return found[0]
    pytest.skip(f"seed reply {number} not found in {', '.join(str(d) for d in SEED_DIRS)}")
    raise AssertionError("unreachable")


def candidate(name: str) -> Path:
    return CANDIDATES / f"{name}.py"


def evaluate_many(jobs: dict) -> dict:
    """Run `evaluate(problem, candidate, opts)` for each job at once (each in its own child process) and return
    {key: Verdict}; a job may also be a list of such triples, run one after the other (its last verdict returned
    under the key, all of them under (key, i)). Keeps the CPU suite fast: the children mostly wait on imports."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from kernelfuse.judge import evaluate

    def run(job):
        steps = job if isinstance(job, list) else [job]
        return [evaluate(*step) for step in steps]

    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        futures = {key: pool.submit(run, job) for key, job in jobs.items()}
        results = {}
        for key, future in futures.items():
            verdicts = future.result()
            results[key] = verdicts[-1]
            for i, v in enumerate(verdicts):
                results[(key, i)] = v
    return results
