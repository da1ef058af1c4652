"""Plans that survive their own stages: a kernel whose planning, code generation or emission raises ships as its
original torch calls instead of ending the run with an internal error.

The planner, code generator and emitter are pure functions of the graph, so a failure is repeatable: the nodes
being worked on when it raised (found on the traceback: the step or node in the failing frames) are kept as
torch calls and the plans are made again, the rest fused as before. A failure with no node to blame drops that
variant; with none left the caller ships the original ops. Each give-up is a `Fallback` the report lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType

from kernelfuse.capture import Graph, Node
from kernelfuse.errors import Fallback, KernelfuseError, one_line
from kernelfuse.plan import AttnStep, FusedStep, GenStep, Plan

# each round keeps at least one more kernel's nodes as torch calls (one plan, code generation and emission of
# every variant: about a second for level-3 ResNet101); past this many, a systematic failure ships the original ops
MAX_REPLANS = 64


class StageFailed(Exception):
    """A stage raised on a plan: which stage, and the original error (its traceback locates the kernel)."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {one_line(error)}")
        self.stage = stage
        self.error = error


def run_stage(stage: str, fn: Callable[..., object], *args: object) -> object:
    """`fn(*args)`, with a kernelfuse bug or unsupported construct raised as StageFailed (a user's error, a
    KernelfuseError, passes through: it has its own exit code)."""
    try:
        return fn(*args)
    except KernelfuseError:
        raise
    except Exception as err:  # noqa: BLE001 - any bug of a stage becomes a fallback, never an internal error
        raise StageFailed(stage, err) from err


def plans_with_fallbacks(graph: Graph, make_plans: Callable[[frozenset[str]], list[Plan]],
                         render: Callable[[Plan], object]) -> tuple[list[Plan], list[Fallback]]:
    """The plans `make_plans(keep)` gives that `render` (code generation and emission) accepts, keeping as torch
    calls the nodes of every kernel that failed; and what was given up, with why. [] plans: ship the original ops."""
    keep: frozenset[str] = frozenset()
    fallbacks: list[Fallback] = []
    dropped: set[str] = set()
    for _ in range(MAX_REPLANS):
        try:
            plans = [p for p in run_stage("plan", make_plans, keep) if p.variant not in dropped]
            for plan in plans:
                render(plan)
            return _distinct(plans), fallbacks
        except StageFailed as failed:
            blamed = culprit(failed.error.__traceback__, graph) - keep
            where = _variant(failed.error.__traceback__)
            if blamed:
                keep |= blamed
                fallbacks.append(Fallback(failed.stage, _describe(graph, blamed), one_line(failed.error)))
            elif failed.stage != "plan" and where is not None and where not in dropped:
                dropped.add(where)
                fallbacks.append(Fallback(failed.stage, f"variant {where}", one_line(failed.error)))
            else:
                fallbacks.append(Fallback(failed.stage, "every kernel", one_line(failed.error)))
                return [], fallbacks
    fallbacks.append(Fallback("plan", "every kernel", f"still failing after {MAX_REPLANS} re-plans"))
    return [], fallbacks


def _distinct(plans: list[Plan]) -> list[Plan]:
    """The first plan of each summary: kept nodes can make two layouts' plans one (no convolution left fused)."""
    seen: set[str] = set()
    return [p for p in plans if not (p.summary() in seen or seen.add(p.summary()))]


def culprit(tb: TracebackType | None, graph: Graph) -> frozenset[str]:
    """The graph nodes the failing code was working on: in the innermost frame holding a kernel step or a node of
    `graph`, the step's nodes (all it replaces), else that node."""
    by_name = {n.name: n for n in graph.nodes}
    for frame_locals in _frames(tb):
        steps = [v for v in frame_locals if isinstance(v, (FusedStep, GenStep, AttnStep))
                 and all(n in by_name for n in v.replaces)]
        if steps:
            return frozenset(steps[0].replaces)
        nodes = [v for v in frame_locals if isinstance(v, Node) and v.op not in ("input", "param", "buffer")
                 and v.name in by_name and by_name[v.name] == v]
        if nodes:
            return frozenset({nodes[0].name})
    return frozenset()


def _variant(tb: TracebackType | None) -> str | None:
    """The plan variant being rendered when the failure happened (the innermost Plan in the frames)."""
    for frame_locals in _frames(tb):
        for value in frame_locals:
            if isinstance(value, Plan):
                return value.variant
    return None


def _frames(tb: TracebackType | None) -> list[Sequence[object]]:
    """Each frame's local values, innermost first."""
    out: list[Sequence[object]] = []
    while tb is not None:
        out.append(list(tb.tb_frame.f_locals.values()))
        tb = tb.tb_next
    return out[::-1]


def _describe(graph: Graph, names: frozenset[str]) -> str:
    ops = [n.op for n in graph.nodes if n.name in names]
    return f"the kernel over {' -> '.join(op.split('.')[0] for op in ops)} ({len(ops)} node(s), kept as torch calls)"
