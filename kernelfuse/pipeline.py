"""The optimize pipeline: load -> capture -> rewrite -> plan -> codegen -> emit -> (GPU) build, judge, choose.

Without a GPU the plans are checked by the CPU interpreter against the original model and the default variant is
emitted, saying plainly that GPU verification did not run. With a GPU every variant is built (in parallel),
judged by `kernelfuse.judge` (the same judge as `kernelfuse eval`), and the fastest verified variant ships only
if it beats eager; otherwise the unfused file (the original ops) ships and the report says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernelfuse.capture import Graph, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew, emit_reference
from kernelfuse.judge import EvalOptions, Verdict, evaluate
from kernelfuse.load import Problem, load_problem
from kernelfuse.plan import Plan, interpret, plan_variants
from kernelfuse.rewrite import rewrite

CPU_CHECK_BATCH = 2
CPU_TOLERANCE = 1e-5


@dataclass(frozen=True)
class OptimizeOptions:
    precision: str = "strict"
    trials: int = 5
    timeout_s: float = 900.0
    use_gpu: bool | None = None  # None: use one when torch sees it
    final_baselines: tuple[str, ...] = ("eager", "compile")
    timing_reps: int = 50


@dataclass(frozen=True)
class CpuCheck:
    variant: str
    ok: bool
    max_abs_err: float | None
    note: str


@dataclass(frozen=True)
class VariantResult:
    variant: str
    verdict: Verdict


@dataclass
class OptimizeResult:
    output: Path
    shipped: str  # variant name, or "unfused"
    plans: list[Plan]
    cpu_checks: list[CpuCheck]
    variants: list[VariantResult] = field(default_factory=list)
    final: Verdict | None = None  # the judge's verdict on the shipped file (GPU only)
    notes: list[str] = field(default_factory=list)
    cold_build_s: float | None = None  # parallel first build of all variants (the judge's build_s is then cached)


def optimize_file(problem_path: str | Path, out_path: str | Path, options: OptimizeOptions = OptimizeOptions(),
                  log: Callable[[str], None] = print) -> OptimizeResult:
    problem = load_problem(problem_path)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"[1/5] loaded {problem.path}")
    graph = rewrite(capture(problem))
    log(f"[2/5] captured {len(graph.nodes)} ATen nodes on fake tensors")
    plans = plan_variants(graph, options.precision)
    for plan in plans:
        log("[3/5] " + plan.summary().replace("\n", "\n      "))
    checks = [check_on_cpu(problem, graph, plan) for plan in plans]
    for c in checks:
        log(f"[4/5] CPU interpreter check ({c.variant}): {'ok' if c.ok else 'FAILED'} — {c.note}")
    use_gpu = torch.cuda.is_available() if options.use_gpu is None else options.use_gpu
    result = OptimizeResult(out_path, plans[0].variant, plans, checks)
    good = [p for p, c in zip(plans, checks, strict=True) if c.ok]
    if not any(p.fused for p in plans):
        result.notes.append("nothing to fuse (no library call with pointwise ops behind it): "
                            "shipping the unfused model")
        return _ship_unfused(problem, result, log)
    if not good:
        result.notes.append("every fused plan failed the CPU check: shipping the unfused model")
        return _ship_unfused(problem, result, log)
    if not use_gpu:
        plan = good[0]
        out_path.write_text(emit_file(problem, plan, "not verified on a GPU (none available)"))
        result.shipped = plan.variant
        result.notes.append("no CUDA device: GPU build, verification and benchmark did NOT run; "
                            "the plan was checked with the CPU interpreter only")
        log(f"[5/5] wrote {out_path} ({plan.variant})")
        return result
    return _choose_on_gpu(problem, good, options, result, log)


def emit_file(problem: Problem, plan: Plan, report: str) -> str:
    return emit_modelnew(problem, plan, generate(plan), report)


def check_on_cpu(problem: Problem, graph: Graph, plan: Plan) -> CpuCheck:
    """Interpret the plan on the CPU against the original model, on the real weights and small batches."""
    try:
        model = problem.make_model()
        inputs = small_inputs(graph)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            torch.manual_seed(0)
            expected = model(*inputs)
            torch.manual_seed(0)
            got = interpret(plan, state, inputs)
    except Exception as err:  # noqa: BLE001 - the check reports, the pipeline decides
        return CpuCheck(plan.variant, False, None, f"interpreter raised {type(err).__name__}: {err}")
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if len(expected) != len(got):
        return CpuCheck(plan.variant, False, None, f"{len(got)} outputs, model returns {len(expected)}")
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        if e.shape != g.shape or e.dtype != g.dtype:
            what = f"output {tuple(g.shape)} {g.dtype} vs {tuple(e.shape)} {e.dtype}"
            return CpuCheck(plan.variant, False, None, what)
        if not torch.allclose(g, e, atol=CPU_TOLERANCE, rtol=CPU_TOLERANCE, equal_nan=True):
            err = (g.double() - e.double()).abs().max().item()
            return CpuCheck(plan.variant, False, err, f"mismatch, max abs error {err:.3g}")
        worst = max(worst, (g.double() - e.double()).abs().max().item() if g.numel() else 0.0)
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    return CpuCheck(plan.variant, True, worst, f"max abs error {worst:.3g} on inputs {shapes}")


def small_inputs(graph: Graph, batch: int = CPU_CHECK_BATCH) -> list[torch.Tensor]:
    """Random inputs with the captured shapes, the leading (batch) dimension cut to `batch` to fit the CPU."""
    out = []
    for node in graph.inputs:
        shape = list(node.meta.shape)
        if shape:
            shape[0] = min(shape[0], batch)
        out.append(torch.rand(shape, dtype=node.meta.dtype) if node.meta.dtype.is_floating_point
                   else torch.zeros(shape, dtype=node.meta.dtype))
    return out


def _choose_on_gpu(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
                   log: Callable[[str], None]) -> OptimizeResult:
    workdir = Path(tempfile.mkdtemp(prefix=f"kernelfuse_{problem.name}_"))
    files = {}
    for plan in plans:
        path = workdir / f"{problem.name}_{plan.variant}.py"
        path.write_text(emit_file(problem, plan, f"variant under evaluation: {plan.variant}"))
        files[plan.variant] = path
    log(f"[5/5] building {len(files)} variant(s) in parallel, then judging each ({options.trials} trials, "
        f"{options.precision})")
    started = time.perf_counter()
    prebuild(list(files.values()), options.timeout_s)
    result.cold_build_s = time.perf_counter() - started
    log(f"      cold build of {len(files)} extension(s) in parallel: {result.cold_build_s:.1f} s")
    quick = judge_options(options, ("eager",))
    best = None
    for plan in plans:
        verdict = evaluate(problem.path, files[plan.variant], quick)
        result.variants.append(VariantResult(plan.variant, verdict))
        log(f"      {plan.variant}: " + describe_verdict(verdict))
        faster = best is None or (verdict.runtime_ms or float("inf")) < best[1].runtime_ms
        if verdict.correct and verdict.runtime_ms is not None and faster:
            best = (plan, verdict)
    if best is None:
        result.notes.append("no fused variant verified: shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options)
    plan, verdict = best
    if verdict.speedup_eager is None or verdict.speedup_eager < 1.0:
        result.notes.append(f"fusion does not pay ({plan.variant}: {verdict.speedup_eager or 0:.3f}x eager): "
                            "shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options)
    report = f"verified on {torch.cuda.get_device_name()}: variant {plan.variant}, {options.precision} precision"
    result.output.write_text(emit_file(problem, plan, report))
    result.shipped = plan.variant
    result.final = evaluate(problem.path, result.output, judge_options(options, options.final_baselines))
    if not result.final.correct:  # the shipped text failed where its variant passed: never ship it
        result.notes.append(f"the final check of {plan.variant} failed ({result.final.reason}): "
                            "shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options)
    log(f"wrote {result.output} ({plan.variant})")
    return result


def judge_options(options: OptimizeOptions, baselines: tuple[str, ...]) -> EvalOptions:
    """The judge's options for the optimizer: its trials and policy, more timing repetitions than the minimum
    because the GEMM problems' gain (one pass over the output, ~1%) is close to run-to-run noise."""
    return EvalOptions(trials=options.trials, precision=options.precision, timeout_s=options.timeout_s,
                       baselines=baselines, timing_reps=options.timing_reps)


def _ship_unfused(problem: Problem, result: OptimizeResult, log: Callable[[str], None],
                  options: OptimizeOptions | None = None) -> OptimizeResult:
    result.output.write_text(emit_reference(problem, "; ".join(result.notes)))
    result.shipped = "unfused"
    log(f"wrote {result.output} (unfused): " + "; ".join(result.notes))
    if options is not None:
        result.final = evaluate(problem.path, result.output, judge_options(options, options.final_baselines))
    return result


def prebuild(files: list[Path], timeout_s: float = 900.0) -> None:
    """Build every candidate's extension at once in child processes, warming torch's cache for the judge.

    Failures and time-outs are not judged here: the judge builds again (a cache hit when this worked) and reports
    any error with its cause. Each child runs in its own session so a stuck compiler is killed with it.
    """
    code = "import runpy, sys; g = runpy.run_path(sys.argv[1]); f = g.get('_extension'); f and f()"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(f)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for f in files]
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def describe_verdict(v: Verdict) -> str:
    """One line per variant for the optimizer's progress and summary."""
    if not v.built:
        return f"did not build: {v.reason}"
    if not v.correct:
        return f"incorrect: {v.reason}"
    if v.runtime_ms is None or v.eager_ms is None or v.speedup_eager is None:
        return "correct, not timed"
    return f"correct, {v.runtime_ms:.3f} ms vs eager {v.eager_ms:.3f} ms ({v.speedup_eager:.3f}x)"
