"""`bench --ray [ADDRESS]`: the same two phases as Ray tasks, one GPU each (`num_gpus=1`; CPU-only: none).

Ray is optional (`pip install kernelfuse[ray]`) and imported only here. A task carries the problem's and the
candidate's text, so a node needs kernelfuse installed but not the suite's files; it runs the build and judge
phases in child processes on its node (the extension cache is per node) and returns both results and the
optimizer's file. Ray sets CUDA_VISIBLE_DEVICES for the task, and the children inherit it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kernelfuse.suite.child import Children, ChildResult
from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.job import JobSpec
from kernelfuse.suite.pool import Finished, WorkItem

INSTALL = "pip install 'kernelfuse[ray]'  (or: pip install 'ray[default]')"


def import_ray() -> Any:
    """The ray module, or a one-line error with the install command."""
    try:
        import ray
    except ImportError:
        raise SuiteError(f"--ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def run_ray(items: list[WorkItem], address: str | None, cpu_only: bool, timeout_s: float) -> Iterator[Finished]:
    """Yield each problem's result as its Ray task finishes (local cluster when `address` is None)."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    task = ray.remote(num_gpus=0 if cpu_only else 1, num_cpus=1, max_retries=0)(run_remote)
    pending = {}
    for item in items:
        candidate = item.candidate.read_text() if item.candidate else None
        ref = task.remote(item.spec, item.problem.path.read_text(), item.problem.path.name, candidate,
                          item.candidate.name if item.candidate else None, timeout_s, not cpu_only)
        pending[ref] = item
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        item = pending.pop(done[0])
        try:
            build, judged, output, node = ray.get(done[0])
        except Exception as err:  # noqa: BLE001 - a lost task (node died) is this problem's failure
            judged = ChildResult("judge", None, False, 0.0, {"error": f"Ray task failed: {type(err).__name__}: "
                                                                       f"{str(err).splitlines()[0]}"})
            yield Finished(item, None, judged, "ray")
            continue
        if output is not None:
            Path(item.spec.output).parent.mkdir(parents=True, exist_ok=True)
            Path(item.spec.output).write_text(output)
            judged["result"]["output"] = item.spec.output
        yield Finished(item, ChildResult.from_json(build) if build else None, ChildResult.from_json(judged),
                       f"ray:{node}")


def run_remote(spec: JobSpec, problem_text: str, problem_name: str, candidate_text: str | None,
               candidate_name: str | None, timeout_s: float, do_build: bool) -> tuple[Any, ...]:
    """The body of one Ray task: write the files on this node, run both phases, return what they found."""
    import platform

    workdir = Path(tempfile.mkdtemp(prefix="kernelfuse_ray_"))
    (workdir / "files").mkdir()
    problem = workdir / "files" / problem_name
    problem.write_text(problem_text)
    candidate = None
    if candidate_text is not None and candidate_name is not None:
        candidate = workdir / "files" / candidate_name
        candidate.write_text(candidate_text)
    local = replace(spec, problem=str(problem), candidate=str(candidate) if candidate else None,
                    output=str(workdir / "files" / "out" / Path(spec.output).name))
    children = Children()
    build = children.run(local, "build", workdir / "job", timeout_s) if do_build else None
    judged = children.run(local, "judge", workdir / "job", timeout_s)
    out = Path(local.output)
    output = out.read_text() if spec.candidate is None and out.exists() else None
    return build.to_json() if build else None, judged.to_json(), output, platform.node()
