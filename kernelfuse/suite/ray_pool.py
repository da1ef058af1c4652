"""`bench --ray [ADDRESS]`: the same two phases as the local pool, as Ray tasks.

Ray is optional (`pip install kernelfuse[ray]`) and imported only here. As in the local pool, builds run ahead of
the GPUs: every problem's build is a task of its own (CORES_PER_BUILD CPUs and a sliver of one GPU, which the
build needs visible to pick the kernels' architecture), and when it lands its judge task is submitted on the same
node (the extension cache is per node), taking JUDGE_GPU_SHARE of a GPU: more than half, so one judge times on a
GPU at a time, with room beside it for builds. Tasks carry the problem's and the candidate's text, so a node needs
kernelfuse installed but not the suite's files; each phase runs in a child process on its node, forked warm from
that node's judge zygote (owned by a `NodeZygote` actor per node, as the local pool forks from its own): spawned
cold, the judge phases of 10 level-2 problems took 297 s in all, forked 245 s (2 H200s). Ray sets
CUDA_VISIBLE_DEVICES for a task, and the children inherit it. CPU-only: judge tasks alone, no GPU.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kernelfuse.judge.runner import ZYGOTE_ENV, judge_zygote
from kernelfuse.suite.child import Children, ChildResult
from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.job import JobSpec
from kernelfuse.suite.pool import CORES_PER_BUILD, Finished, WorkItem

INSTALL = "pip install 'kernelfuse[ray]'  (or: pip install 'ray[default]')"


def import_ray() -> Any:
    """The ray module, or a one-line error with the install command."""
    try:
        import ray
    except ImportError:
        raise SuiteError(f"--ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


BUILD_GPU_SHARE = 0.05
JUDGE_GPU_SHARE = 0.6  # > 0.5: one judge per GPU; 0.4 left for up to 8 builds beside it
ZYGOTE_ACTOR = "kernelfuse_zygote_"  # + the node's Ray id: the actor's name


class NodeZygote:
    """A Ray actor holding one node's judge zygote (`judge_zygote`) open while the suite runs; the zygote exits
    with it."""

    def __init__(self, omp: str | None) -> None:
        _threads_as_driver(omp)  # the zygote's children take their environment from each request, but torch's
        self._block = judge_zygote()  # imports happen here
        self._block.__enter__()

    def address(self) -> str | None:
        return os.environ.get(ZYGOTE_ENV)


def _threads_as_driver(omp: str | None) -> None:
    """Undo Ray's OMP_NUM_THREADS (it sets the task's CPU count, 1 for a judge) so that a phase's child runs with
    the threads it has in the local pool: the driver's setting, or torch's default. One thread made the CPU side
    of a judge (inputs drawn with torch.randn, tens of millions of elements) several seconds slower."""
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def task_options(cpu_only: bool) -> dict[str, dict[str, Any]]:
    """`ray.remote` options of the build and judge tasks. The local pool's shares: builds of CORES_PER_BUILD cores
    each, a judge limited by its GPU alone (CPU-only: by one core, else nothing would limit them). `max_calls=0`:
    Ray retires a worker after one task that holds a GPU share unless told otherwise, so every build and judge
    started a fresh Python and re-imported torch and kernelfuse (2 H200s, 10 level-2 problems: 184 s against the
    local pool's 140 s). Reuse is safe: a task's own process never touches CUDA, its phase runs in a child."""
    return {"build": {"num_gpus": BUILD_GPU_SHARE, "num_cpus": CORES_PER_BUILD, "max_retries": 0, "max_calls": 0},
            "judge": {"num_gpus": 0 if cpu_only else JUDGE_GPU_SHARE, "num_cpus": 1 if cpu_only else 0,
                      "max_retries": 0, "max_calls": 0}}


def _start_zygotes(ray: Any) -> list[Any]:
    """One NodeZygote per live node, named by the node's id (tasks find their node's)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0)(NodeZygote)
    return [actor.options(name=ZYGOTE_ACTOR + node["NodeID"],
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                              os.environ.get("OMP_NUM_THREADS"))
            for node in ray.nodes() if node.get("Alive")]


def _join_node_zygote(omp: str | None) -> None:
    """In a task: the driver's thread setting, and this task's children forked from its node's zygote, where the
    suite started one."""
    import ray

    _threads_as_driver(omp)
    try:
        actor = ray.get_actor(ZYGOTE_ACTOR + ray.get_runtime_context().get_node_id())
    except ValueError:  # none on this node (it joined after the suite started): children are spawned
        return
    address = ray.get(actor.address.remote())
    if address:
        os.environ[ZYGOTE_ENV] = address


def run_ray(items: list[WorkItem], address: str | None, cpu_only: bool, timeout_s: float) -> Iterator[Finished]:
    """Yield each problem's result as its judge task finishes (local cluster when `address` is None)."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    shares = task_options(cpu_only)
    build = ray.remote(**shares["build"])(build_remote)
    judge = ray.remote(**shares["judge"])(judge_remote)
    texts = {item.problem.key: _texts(item) for item in items}
    zygotes = _start_zygotes(ray)
    try:
        yield from _drive(ray, items, build, judge, texts, cpu_only, timeout_s, os.environ.get("OMP_NUM_THREADS"))
    finally:
        for zygote in zygotes:
            ray.kill(zygote)


def _drive(ray: Any, items: list[WorkItem], build: Any, judge: Any, texts: dict[str, Any], cpu_only: bool,
           timeout_s: float, omp: str | None) -> Iterator[Finished]:
    """Submit every build (CPU-only: every judge), each judge as its build lands, and yield each judged problem."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pending: dict[Any, tuple[WorkItem, str]] = {}
    for item in items:
        if cpu_only:
            pending[judge.remote(item.spec, None, texts[item.problem.key], timeout_s, omp)] = (item, "judge")
        else:
            pending[build.remote(item.spec, texts[item.problem.key], timeout_s, omp)] = (item, "build")
    built: dict[str, ChildResult] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        item, phase = pending.pop(done[0])
        try:
            answer = ray.get(done[0])
        except Exception as err:  # noqa: BLE001 - a lost task (node died) is this problem's failure
            judged = ChildResult("judge", None, False, 0.0, {"error": f"Ray task failed in the {phase} phase: "
                                                                       f"{type(err).__name__}: "
                                                                       f"{str(err).splitlines()[0]}"})
            yield Finished(item, built.get(item.problem.key), judged, "ray")
            continue
        if phase == "build":
            workdir, result, node_id = answer
            built[item.problem.key] = ChildResult.from_json(result)
            where = NodeAffinitySchedulingStrategy(node_id, soft=True)  # its cache; elsewhere it builds again
            ref = judge.options(scheduling_strategy=where).remote(item.spec, workdir, texts[item.problem.key],
                                                                   timeout_s, omp)
            pending[ref] = (item, "judge")
            continue
        judged, output, node = answer
        if output is not None:
            Path(item.spec.output).parent.mkdir(parents=True, exist_ok=True)
            Path(item.spec.output).write_text(output)
            judged["result"]["output"] = item.spec.output
        yield Finished(item, built.get(item.problem.key), ChildResult.from_json(judged), f"ray:{node}")


def _texts(item: WorkItem) -> tuple[str, str, str | None, str | None]:
    """What a task needs of the suite's files: the problem's text and name, the candidate's (or None)."""
    candidate = item.candidate
    return (item.problem.path.read_text(), item.problem.path.name,
            candidate.read_text() if candidate else None, candidate.name if candidate else None)


def _local_spec(spec: JobSpec, texts: tuple[str, str, str | None, str | None], workdir: Path) -> JobSpec:
    """`spec` pointed at copies of its files in `workdir` on this node (written if they are not there yet)."""
    problem_text, problem_name, candidate_text, candidate_name = texts
    files = workdir / "files"
    files.mkdir(parents=True, exist_ok=True)
    problem = files / problem_name
    if not problem.exists():
        problem.write_text(problem_text)
    candidate = None
    if candidate_text is not None and candidate_name is not None:
        candidate = files / candidate_name
        if not candidate.exists():
            candidate.write_text(candidate_text)
    return replace(spec, problem=str(problem), candidate=str(candidate) if candidate else None,
                   output=str(files / "out" / Path(spec.output).name))


def build_remote(spec: JobSpec, texts: tuple[str, str, str | None, str | None], timeout_s: float,
                 omp: str | None) -> tuple[str, dict[str, Any], str]:
    """One build task: its work folder on this node, the build phase's result, and this node's Ray id."""
    import ray

    _join_node_zygote(omp)
    workdir = Path(tempfile.mkdtemp(prefix="kernelfuse_ray_"))
    build = Children().run(_local_spec(spec, texts, workdir), "build", workdir / "job", timeout_s)
    return str(workdir), build.to_json(), ray.get_runtime_context().get_node_id()


def judge_remote(spec: JobSpec, workdir: str | None, texts: tuple[str, str, str | None, str | None],
                 timeout_s: float, omp: str | None) -> tuple[dict[str, Any], str | None, str]:
    """One judge task (in its build's folder where it runs on the build's node): the judge phase's result, the
    optimizer's file (optimize mode) and this node's name."""
    import platform

    _join_node_zygote(omp)
    folder = Path(workdir) if workdir and Path(workdir).is_dir() else Path(tempfile.mkdtemp(prefix="kernelfuse_ray_"))
    local = _local_spec(spec, texts, folder)
    judged = Children().run(local, "judge", folder / "job", timeout_s)
    out = Path(local.output)
    output = out.read_text() if spec.candidate is None and out.exists() else None
    return judged.to_json(), output, platform.node()
