"""Local scheduling: builds on all CPU cores, timing strictly one problem per GPU.

Every problem's build phase is queued at once on a thread pool of `build_jobs` (each a child process compiling
in parallel), in suite order, so builds run ahead of the GPUs. One worker thread per GPU takes the next problem,
waits for its build and runs its judge phase in a child that sees only that GPU (CUDA_VISIBLE_DEVICES). Results
go to the caller's thread through a queue, so records are written by one thread only.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kernelfuse.suite.child import Children, ChildResult
from kernelfuse.suite.discover import SuiteProblem
from kernelfuse.suite.job import JobSpec

CORES_PER_BUILD = 4  # a build job compiles up to ~3 variants (plus torch.compile's workers) at once


@dataclass(frozen=True)
class WorkItem:
    """One problem to run: its spec, the candidate judged (None: optimize) and a private work folder."""

    problem: SuiteProblem
    candidate: Path | None
    spec: JobSpec
    workdir: Path


@dataclass(frozen=True)
class Finished:
    item: WorkItem
    build: ChildResult | None
    judged: ChildResult
    worker: str


def run_local(items: list[WorkItem], slots: list[str | None], build_jobs: int, timeout_s: float,
              on_start: Callable[[WorkItem, str], None] = lambda item, worker: None) -> Iterator[Finished]:
    """Yield each problem's result as it lands. `slots`: one CUDA_VISIBLE_DEVICES value per worker (None: leave
    it as it is); `build_jobs` 0 skips the build phase (no GPU to build for)."""
    children = Children()
    results: queue.Queue[Finished | BaseException] = queue.Queue()
    todo: queue.Queue[WorkItem] = queue.Queue()
    for item in items:
        todo.put(item)
    builder = ThreadPoolExecutor(max_workers=build_jobs) if build_jobs else None
    builds: dict[str, Future[ChildResult]] = {}
    if builder is not None:
        for i, item in enumerate(items):
            builds[item.problem.key] = builder.submit(children.run, item.spec, "build", item.workdir, timeout_s,
                                                      slots[i % len(slots)])

    def worker(slot: str | None, name: str) -> None:
        try:
            while not children.cancelled:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    return
                build = builds[item.problem.key].result() if item.problem.key in builds else None
                on_start(item, name)
                judged = children.run(item.spec, "judge", item.workdir, timeout_s, slot)
                results.put(Finished(item, build, judged, name))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, which raises it
            results.put(err)

    threads = [threading.Thread(target=worker, args=(slot, f"gpu{slot}" if slot not in (None, "") else f"w{i}"),
                                daemon=True) for i, slot in enumerate(slots)]
    for t in threads:
        t.start()
    try:
        for _ in items:
            got = results.get()
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        children.cancel()
        if builder is not None:
            builder.shutdown(wait=False, cancel_futures=True)
