"""One problem file through the pipeline's public stages, checked on the CPU, and classified.

load -> capture -> rewrite -> plan (every variant) -> codegen -> emit, then: every plan interpreted on the problem's
own inputs (strides, NaN, Inf) against eager; every emitted file executed: its ModelNew built under the same seed
must hold the same state and (on the CPU: its original ops) compute the same outputs.

Classes: ok; mismatch (wrong numbers, shape or dtype; an emitted file that does not build or run); crash (an
exception inside kernelfuse that is not a KernelfuseError); unsupported (a clean KernelfuseError refusal); invalid
(eager itself cannot run the model, a generator bug, or two identical eager calls differ, so that no reference exists:
reported but never counted as a kernelfuse failure).
"""

from __future__ import annotations

import copy
import ctypes
import linecache
import re
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernelfuse.bench.layout import measure_conv_layouts
from kernelfuse.capture import Graph, build_model, capture
from kernelfuse.codegen import generate_checked
from kernelfuse.cpucheck import DEFAULT_TOLERANCE, TOLERANCE, CpuCheck, check_plans_on
from kernelfuse.emit import emit_modelnew
from kernelfuse.errors import KernelfuseError
from kernelfuse.load import DEFAULT_SEED, Problem, load_problem
from kernelfuse.plan import Plan, optimizer_variants
from kernelfuse.rewrite import apply_rules
from kernelfuse.verify.compare import compare_outputs, flatten_outputs
from kernelfuse.verify.params import compare_state

_MALLOPT = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None  # glibc's, or musl's no-op
_M_PERTURB = -6
FAILURES = ("mismatch", "crash")
STATUSES = ("ok", "mismatch", "crash", "unsupported", "invalid")


@dataclass(frozen=True)
class Outcome:
    status: str  # one of STATUSES
    stage: str  # where it was decided: load, eager, capture, rewrite, plan, codegen, check, file, nvcc, gpu,
    # process (the child running the stages died or hung: cli._Checker.classify)
    reason: str = ""

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    @property
    def signature(self) -> tuple[str, str, str]:
        """What a shrunk model must keep failing with: class, stage and the reason's wording without numbers."""
        return self.status, self.stage, _generic(self.reason)

    def describe(self) -> str:
        return f"{self.status} at {self.stage}: {self.reason}" if self.reason else f"{self.status} at {self.stage}"


@dataclass(frozen=True)
class Emitted:
    """One plan's product: the ModelNew file's text and the CUDA source inside it (None: no custom kernel)."""

    variant: str
    text: str
    cuda: str | None


@dataclass
class ModelRun:
    outcome: Outcome
    emitted: list[Emitted] = field(default_factory=list)


def run_problem(path: Path, measure_layouts: bool = False) -> ModelRun:
    """Classify one problem file (see the module docstring); never raises for a kernelfuse failure.
    `measure_layouts` (a GPU here): plan as the optimizer does on a GPU, each convolution's layout and TF32 use
    measured, so the variants judged on the GPU are the ones the optimizer would judge."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return _run(path, measure_layouts)
        except _Decided as decided:
            return ModelRun(decided.outcome)
        finally:  # what loading registered for tracebacks: thousands of models would keep every one
            sys.modules.pop(f"kernelfuse_problem_{path.stem}", None)
            linecache.cache.pop(str(path), None)


class _Decided(Exception):
    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.describe())
        self.outcome = outcome


def _stage(stage: str, fn, *args):  # noqa: ANN001, ANN202 - a thin guard around one stage's call
    try:
        return fn(*args)
    except KernelfuseError as err:
        raise _Decided(Outcome("unsupported", stage, _first_line(err))) from None
    except Exception as err:  # noqa: BLE001 - a failure of kernelfuse itself: the fuzzer's catch
        raise _Decided(Outcome("crash", stage, _crash_reason(err))) from None


def _run(path: Path, measure_layouts: bool) -> ModelRun:
    problem = _stage("load", load_problem, path)
    model = _stage("load", build_model, problem)
    inputs = _stage("load", problem.make_inputs, 0)
    try:
        expected, differs = _eager_reference(model, inputs)
    except Exception as err:  # noqa: BLE001 - eager cannot run it: the model is not a valid test
        return ModelRun(Outcome("invalid", "eager", _first_line(err)))
    if differs:
        return ModelRun(Outcome("invalid", "eager", "eager reference not deterministic: two identical eager calls "
                                                    f"differ ({differs})"))
    graph = _stage("capture", capture, problem, model)
    graph = _stage("rewrite", apply_rules, graph).graph
    plans: list[Plan] = _stage("plan", _plan_variants, graph, measure_layouts)
    emitted = [Emitted(p.variant, *_stage("codegen", _emit, problem, p)) for p in plans]
    checks: list[CpuCheck] = _stage("check", check_plans_on, model, plans, inputs)
    run = ModelRun(Outcome("ok", "check"), emitted)
    for check in checks:
        if check.note.startswith("interpreter raised"):
            run.outcome = Outcome("crash", "interpret", f"{check.variant}: {check.note}")
            return run
        if check.skipped:
            run.outcome = Outcome("unsupported", "check", check.note)
            return run
        if not check.ok:
            run.outcome = Outcome("mismatch", "check", f"{check.variant}: {check.note}")
            return run
    for e in emitted:
        problem_text = _check_file(problem, e, expected)
        if problem_text:
            run.outcome = Outcome("mismatch", "file", f"{e.variant}: {problem_text}")
            return run
    return run


def _eager_reference(model: torch.nn.Module, inputs: list) -> tuple[object, str]:
    """Eager's outputs (on a copy of the model, under seed 0: its buffers stay as built, dropout draws the same
    masks), and '' or how a second identical call's outputs differ from them (the verifier's comparison, exact).
    torch's own CPU bf16 Conv3d has read uninitialised memory (seed 85000, model 192): a reference that changes
    from call to call judges nothing. Called one after the other, both calls would find the same stale memory: so
    glibc's malloc fills what it hands out with a different byte in each (M_PERTURB; not the small blocks its
    per-thread cache hands back), and a call that reads memory it never wrote sees other values the second time."""
    outputs = []
    try:
        for byte in (0x5A, 0xA5):
            if _MALLOPT is not None:
                _MALLOPT(_M_PERTURB, byte)
            with torch.no_grad():
                torch.manual_seed(0)
                outputs.append(copy.deepcopy(model)(*inputs))
    finally:
        if _MALLOPT is not None:
            _MALLOPT(_M_PERTURB, 0)
    same = compare_outputs(outputs[0], outputs[1], atol=0.0, rtol=0.0)  # exact, NaN where NaN
    return outputs[0], same.reason or ""


def _plan_variants(graph: Graph, measure_layouts: bool) -> list[Plan]:
    """The optimizer's variants, the implicit-GEMM convolution's included: without a GPU both convolution
    layouts; with one, each convolution's layout as timed and cuDNN's TF32 off where eager's own call computes in
    full fp32 (a channels-last call would round to TF32 where eager did not: less accurate than eager, which the
    optimizer's judge rejects)."""
    timings = measure_conv_layouts(graph, strict=True) if measure_layouts else None
    if not timings:
        return optimizer_variants(graph)
    return optimizer_variants(graph, "strict", None, {t.node: t.choice for t in timings},
                              frozenset(t.node for t in timings if t.fp32))


def _emit(problem: Problem, plan: Plan) -> tuple[str, str | None]:
    sources = generate_checked(plan)
    text = emit_modelnew(problem, plan, sources, f"kernelfuse fuzz: variant {plan.variant}")
    return text, None if sources is None else sources.cuda


def _check_file(problem: Problem, emitted: Emitted, expected: object) -> str:
    """'' if the emitted file runs as its problem does on the CPU: it executes, ModelNew takes the same constructor
    arguments, the same seed gives the same state, and its forward (the original ops here) gives eager's outputs."""
    try:
        scope = load_emitted(emitted.text, f"{problem.name}_{emitted.variant}")
        init = problem.init_inputs()
        torch.manual_seed(DEFAULT_SEED)
        new = scope["ModelNew"](*init)
        state = compare_state(problem.make_model(), new)
        if not state.ok:
            return f"under the same seed, ModelNew's {state.summary()}"
        with torch.no_grad():
            torch.manual_seed(0)
            got = new(*problem.make_inputs(0))
    except Exception as err:  # noqa: BLE001 - the emitted file itself is broken
        return f"the emitted file raised {_crash_reason(err)}"
    # the same ops, yet not always the same bits: a BLAS path may depend on a copy's alignment (1 ulp seen)
    tol = loosest_tolerance([*problem.make_inputs(0), expected], TOLERANCE, DEFAULT_TOLERANCE)
    verdict = compare_outputs(expected, got, tol, tol)
    return "" if verdict.ok else f"ModelNew's CPU forward differs from eager: {verdict.reason}"


def loosest_tolerance(values: list, table: dict[torch.dtype, float], default: float) -> float:
    """The widest of `table`'s tolerances over the dtypes of `values`' tensors (a model's inputs and outputs): an
    fp32 output of a bf16 model (`x + x.float()`) was computed from bf16 roundings."""
    dtypes = {t.dtype for t in flatten_outputs(values) if isinstance(t, torch.Tensor)}
    return max((table.get(d, default) for d in dtypes), default=default)


def load_emitted(text: str, name: str) -> dict:
    """Execute an emitted ModelNew file's text as a module; its namespace."""
    scope: dict = {"__name__": f"kernelfuse_fuzz_{name}"}
    exec(compile(text, f"<{name}>", "exec"), scope)  # noqa: S102 - kernelfuse's own emitted file, under test
    return scope


def _crash_reason(err: BaseException) -> str:
    """`Type: message (at file.py:line in function)`, naming the deepest frame inside kernelfuse."""
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if "kernelfuse" in frame.filename and "/fuzz/" not in frame.filename:
            where = f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
            break
    return f"{type(err).__name__}: {_first_line(err)[:200]}{where}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _generic(reason: str) -> str:
    """The reason with paths, numbers and quoted names blanked: one bug, one wording."""
    reason = re.sub(r"\S*fuzz_s\d+_i\d+\S*", "<file>", reason)
    reason = re.sub(r"'[^']*'", "'_'", reason)
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", reason)[:120]
