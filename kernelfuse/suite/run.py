"""`run_suite`: discover, skip what is recorded (--resume), schedule (local processes or Ray), record each result
as it lands, then summarize and write the report."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelfuse.judge.runner import judge_zygote
from kernelfuse.suite.candidates import find_candidate
from kernelfuse.suite.child import ChildResult
from kernelfuse.suite.discover import SuiteError, SuiteProblem, discover
from kernelfuse.suite.job import JobSpec
from kernelfuse.suite.pool import CORES_PER_BUILD, Finished, WorkItem, run_local
from kernelfuse.suite.progress import Progress
from kernelfuse.suite.records import RecordStore
from kernelfuse.suite.results import make_record
from kernelfuse.suite.summary import Summary, summarize_records


@dataclass(frozen=True)
class SuiteOptions:
    """Everything `kernelfuse bench` takes. gpus: a count or "all" (CPU-only: the number of worker processes).
    ray_address: used when ray is True (None: start a local cluster). limit: the first N problems of the suite."""

    jsonl: Path = Path("kernelfuse_bench.jsonl")
    candidates: Path | None = None
    report: Path | None = None
    out_dir: Path | None = None
    gpus: str = "1"
    ray: bool = False
    ray_address: str | None = None
    resume: bool = False
    precision: str = "strict"
    baselines: tuple[str, ...] = ("eager", "compile")
    levels: tuple[int, ...] = ()
    cpu_only: bool = False
    limit: int | None = None
    timeout_s: float = 900.0
    require_custom_kernel: bool = False

    @property
    def files_dir(self) -> Path:
        """Where optimized ModelNew files go: --out-dir, else `<jsonl stem>_modelnew/` beside the JSONL."""
        return self.out_dir or self.jsonl.with_name(self.jsonl.stem + "_modelnew")


def run_suite(paths: list[Path], options: SuiteOptions, log: Callable[[str], None] = print,
              progress: Progress | None = None) -> tuple[list[dict[str, Any]], Summary]:
    """Run every problem not yet recorded; return all records of the JSONL and their summary."""
    if options.report is not None:
        from kernelfuse.suite.report import require_matplotlib

        require_matplotlib()
    if options.candidates is not None and not options.candidates.is_dir():
        raise SuiteError(f"--candidates {options.candidates} is not a folder: give the folder of ModelNew files")
    problems = discover(paths, options.levels)[: options.limit]
    store = RecordStore(options.jsonl, options.resume)
    todo = [p for p in problems if p.key not in store.done]
    mode = f"judge {options.candidates}" if options.candidates else "optimize"
    log(f"kernelfuse bench: {len(problems)} problem(s), {len(problems) - len(todo)} already recorded in "
        f"{options.jsonl}, {len(todo)} to run ({mode}, {options.precision}, "
        f"baselines {','.join(options.baselines) or 'none'})")
    progress = progress or Progress(len(todo))
    workroot = Path(tempfile.mkdtemp(prefix="kernelfuse_bench_"))
    items = []
    for problem in todo:
        candidate = find_candidate(problem, options.candidates) if options.candidates else None
        if options.candidates is not None and candidate is None:
            missing = ChildResult("judge", None, False, 0.0, {
                "error": f"no candidate for {problem.key} in {options.candidates} (expected "
                         f"{_expected_names(problem)})", "error_type": "NoCandidate"})
            _record(store, progress, Finished(WorkItem(problem, None, _spec(problem, None, options), workroot),
                                              None, missing, "-"), options)
            continue
        items.append(WorkItem(problem, candidate, _spec(problem, candidate, options),
                              workroot / re.sub(r"[^\w.-]", "_", problem.key)))
    try:
        # judge workers forked warm from one server on this machine (Ray tasks start their own processes)
        with nullcontext() if options.ray else judge_zygote():
            for finished in _schedule(items, options, log):
                _record(store, progress, finished, options)
    finally:
        progress.close()
    summary = summarize_records(store.records)
    if options.report is not None:
        from kernelfuse.suite.report import write_report

        write_report(store.records, summary, options.report)
        log(f"report written to {options.report}")
    return store.records, summary


def gpu_slots(gpus: str, cpu_only: bool) -> list[str | None]:
    """One CUDA_VISIBLE_DEVICES value per worker: GPU indices, or "" (no GPU) for each CPU-only worker."""
    if cpu_only:
        if not gpus.isdigit() or int(gpus) < 1:
            raise SuiteError(f"--gpus {gpus}: with --cpu-only give the number of worker processes (1 or more)")
        return [""] * int(gpus)
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise SuiteError("no CUDA device visible: run on a GPU machine, or pass --cpu-only (optimize without GPU "
                         "verification; judge candidates on the CPU)")
    if gpus == "all":
        wanted = count
    elif gpus.isdigit() and 1 <= int(gpus) <= count:
        wanted = int(gpus)
    else:
        raise SuiteError(f"--gpus {gpus}: give a number from 1 to {count} (GPUs visible) or 'all'")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(count)]
    return list(ids[:wanted])


def _schedule(items: list[WorkItem], options: SuiteOptions, log: Callable[[str], None]) -> Iterator[Finished]:
    if not items:
        return iter(())
    if options.ray:
        from kernelfuse.suite.ray_pool import import_ray, run_ray

        import_ray()
        log(f"scheduling on Ray ({options.ray_address or 'local cluster'}), one "
            f"{'CPU' if options.cpu_only else 'GPU'} per task")
        return run_ray(items, options.ray_address, options.cpu_only, options.timeout_s)
    slots = gpu_slots(options.gpus, options.cpu_only)
    build_jobs = 0 if options.cpu_only else max(1, min(len(items), (os.cpu_count() or 1) // CORES_PER_BUILD))
    log(f"scheduling locally: {len(slots)} {'CPU worker' if options.cpu_only else 'GPU worker'}(s), "
        f"{build_jobs} parallel build job(s)")
    return run_local(items, slots, build_jobs, options.timeout_s)


def _spec(problem: SuiteProblem, candidate: Path | None, options: SuiteOptions) -> JobSpec:
    output = options.files_dir / (re.sub(r"[^\w.-]", "_", problem.key) + "_new.py")
    return JobSpec(problem=str(problem.path.resolve()), candidate=str(candidate.resolve()) if candidate else None,
                   output=str(output.resolve()), precision=options.precision, baselines=options.baselines,
                   cpu_only=options.cpu_only, timeout_s=options.timeout_s,
                   require_custom_kernel=options.require_custom_kernel)


def _record(store: RecordStore, progress: Progress, finished: Finished, options: SuiteOptions) -> None:
    record = make_record(finished.item.problem, finished.item.candidate, finished.build, finished.judged,
                         finished.worker, options.timeout_s)
    if store.append(record):
        progress.finished(record)


def _expected_names(problem: SuiteProblem) -> str:
    names = [f"{problem.name}.py", f"{problem.name}.txt"]
    if problem.level is not None and problem.problem_id is not None:
        names.insert(0, f"level_{problem.level}_problem_{problem.problem_id}_sample_0_kernel.py")
    return " or ".join(names)
