"""Deciding on the GPU which verified variant ships: kernelfuse.pipeline makes the plans, this module builds
every variant (in parallel), has `kernelfuse.judge` verify and time each, and ships the fastest verified one only
if it beats eager; otherwise the unfused file (the original ops) ships and the report says why. Where the judge's
profile shows the shipped forward launch-bound, its replay from a CUDA graph is judged too and ships if verified
and faster. Kept apart from the pipeline so each module stays small; what both ship with (`emit_file`,
`ship_unfused`) lives here, below the pipeline, so imports run one way (pipeline -> choose).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kernelfuse.capture import Graph, draws_random_numbers
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew, emit_reference
from kernelfuse.errors import Fallback, KernelfuseError, one_line
from kernelfuse.judge import EvalOptions, Verdict, evaluate
from kernelfuse.load import Problem
from kernelfuse.optimize_result import OptimizeOptions, OptimizeResult, VariantResult, fall_back
from kernelfuse.plan import Plan, plan_variants, torch_calls_plan

# A CUDA-graph variant is judged where its predicted time beats the shipped forward's by GRAPH_MIN_GAIN: the
# replay keeps the GPU busy as long as the forward's kernels (the judge's profile) plus the copies it adds (inputs
# into the graph's buffers, outputs cloned out: each read and written once, at GRAPH_COPY_GBPS) and a fixed cost.
# Measured on an H100 (benchmarks/graph_probe.py): graphs gained 2-6x where the GPU was busy for 0.14-0.49 of the
# call and lost up to 20% where it was busy for 0.96-1.0 with large inputs, the copies then costing; on 2 H200s
# (stop 32) transformers' forwards idled for 4-13% of the call with copies of under 0.05 ms (Llama, BERT, Whisper).
GRAPH_COPY_GBPS = 1500.0  # effective copy bandwidth, well under an H100's 3.3 TB/s peak
GRAPH_REPLAY_MS = 0.02  # the replay's launch and the runtime's checks of inputs and weights
# ...and ships only if at least this much faster than what ships without it (a graph is more machinery: copies,
# capture memory, a fallback path; a gain within timing noise does not pay for it)
GRAPH_MIN_GAIN = 1.02
_UNDER_EVALUATION = "variant under evaluation: {}"  # a judged file's header line, replaced when it ships


def emit_file(problem: Problem, plan: Plan, report: str) -> str:
    return emit_modelnew(problem, plan, generate(plan), report)


def _choose_on_gpu(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
                   log: Callable[[str], None], in_order: bool = False) -> OptimizeResult:
    """Build every plan, then ship a verified one faster than eager: the first that is (`in_order`: the plans
    are best first, the layouts already measured), or the fastest of all; else the original ops."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kernelfuse_{problem.name}_"))
    files = {}
    for plan in plans:
        path = workdir / f"{problem.name}_{plan.variant}.py"
        path.write_text(emit_file(problem, plan, _UNDER_EVALUATION.format(plan.variant)))
        files[plan.variant] = path
    log(f"[5/5] building {len(files)} variant(s) in parallel, then judging each ({options.trials} trials, "
        f"{options.precision})")
    if options.prebuild:
        started = time.perf_counter()
        prebuild(list(files.values()), options.timeout_s)
        result.cold_build_s = time.perf_counter() - started
        log(f"      cold build of {len(files)} extension(s) in parallel: {result.cold_build_s:.1f} s")
    if len(plans) == 1 or in_order:  # each plan's judgement (with every baseline) decides, in order
        return _ship_first_faster(problem, plans, files, options, result, log)
    quick = judge_options(options, ("eager",))
    judged = []
    for plan in plans:
        verdict = evaluate(problem.path, files[plan.variant], quick)
        result.variants.append(VariantResult(plan.variant, verdict))
        log(f"      {plan.variant}: " + describe_verdict(verdict))
        if verdict.correct and verdict.runtime_ms is not None:
            judged.append((plan, verdict))
    best = _retimed_best(problem, judged, files, quick, log)
    if best is None:
        result.notes.append("no fused variant verified: shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log, options)
    plan, verdict = best
    if verdict.speedup_eager is None or verdict.speedup_eager < 1.0:
        result.notes.append(f"fusion does not pay ({plan.variant}: {verdict.speedup_eager or 0:.3f}x eager): "
                            "shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log, options)
    _write_verified(files[plan.variant], plan, options, result)
    result.final = evaluate(problem.path, result.output, judge_options(options, options.final_baselines))
    if not result.final.correct:  # the shipped text failed where its variant passed: never ship it
        result.notes.append(f"the final check of {plan.variant} failed ({result.final.reason}): "
                            "shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log, options)
    log(f"wrote {result.output} ({plan.variant})")
    return result


RETIME_WITHIN = 1.25  # a runner-up this close to the fastest variant is timed again before one ships
# ...and so is a variant whose eager baseline, the same model every time, ran this much slower than the quickest of
# the problem's eager runs: it was timed while the machine was busy
LOADED_EAGER = 1.25


def _retimed_best(problem: Problem, judged: list[tuple[Plan, Verdict]], files: dict[str, Path],
                  quick: EvalOptions, log: Callable[[str], None]) -> tuple[Plan, Verdict] | None:
    """The fastest verified variant. Each was timed once, at its own moment, and a moment of host contention (the
    suite building the next problem beside the judge) slowed one host-bound variant by 30%: where the runner-up is
    within RETIME_WITHIN of the fastest, both are timed again (one trial) and each keeps its better time. A variant
    timed on a busy machine (its eager baseline LOADED_EAGER slower than the problem's quickest: level-3
    MobileNetV2's first variant at 10.0 ms beside eager's 9.9, where eager took 4.9 for a later one) is timed again
    too, and the fastest then with it."""
    ranked = sorted(judged, key=lambda pv: pv[1].runtime_ms)  # type: ignore[arg-type, return-value]
    if len(ranked) < 2:
        return ranked[0] if ranked else None
    eager = [v.eager_ms for _, v in ranked if v.eager_ms]
    loaded = [pv for pv in ranked[1:] if eager and pv[1].eager_ms and pv[1].eager_ms > min(eager) * LOADED_EAGER]
    close = ranked[1][1].runtime_ms <= ranked[0][1].runtime_ms * RETIME_WITHIN  # type: ignore[operator]
    again_for = [pv for pv in ranked[1:] if (close and pv is ranked[1]) or pv in loaded]
    if not again_for:
        return ranked[0]
    again = replace(quick, trials=1)
    times = {plan.variant: verdict.runtime_ms for plan, verdict in ranked}
    for plan, verdict in [ranked[0], *again_for]:
        second = evaluate(problem.path, files[plan.variant], again)
        if second.correct and second.runtime_ms is not None:
            times[plan.variant] = min(verdict.runtime_ms, second.runtime_ms)  # type: ignore[type-var]
        log(f"      {plan.variant} timed again: {second.runtime_ms or float('nan'):.3f} ms")
    return min(ranked, key=lambda pv: times[pv[0].variant])  # type: ignore[arg-type, return-value]


def choose_then_graph(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
                       log: Callable[[str], None], in_order: bool = False) -> OptimizeResult:
    """`_choose_on_gpu`, then the CUDA-graph variant of what it chose (for the original ops: of the fastest plan
    that verified, or of the captured ops unfused) where the shipped forward is launch-bound; and of the verified
    plan with the least GPU time, where that is another one: launch overhead, which a graph removes, decided the
    choice among plans timed without one (level-3 MobileNetV2 on 2 H200s: the implicit-GEMM plan chosen at 4.96 ms
    against 5.76, 1.90 ms graphed, where the cuDNN plan graphed had measured 1.56 ms)."""
    result = _choose_on_gpu(problem, plans, options, result, log, in_order)
    by_name = {p.variant: p for p in plans}
    if result.shipped in by_name:
        candidate = by_name[result.shipped]
    else:
        verified = [v for v in result.variants if v.verdict.correct and v.verdict.runtime_ms is not None]
        fastest = min(verified, key=lambda v: v.verdict.runtime_ms or 0.0, default=None)
        candidate = by_name[fastest.variant] if fastest is not None else \
            plan_variants(plans[0].graph, options.precision, max_fusions=0)[0]
    busy = [(b, v.variant) for v in result.variants if v.variant in by_name and v.verdict.correct
            for b in [_busy_ms(v.verdict)] if b is not None]
    lean = by_name[min(busy)[1]] if busy else None
    return try_graph(problem, [candidate] + ([lean] if lean is not None and lean is not candidate else []),
                      options, result, log)


def _busy_ms(verdict: Verdict | None) -> float | None:
    """The GPU time of the candidate's forward, by the judge's profile (None: not profiled)."""
    return ((verdict.details or {}).get("streams") or {}).get("candidate_busy_ms") if verdict is not None else None


def graph_predicted_ms(graph: Graph, busy_ms: float) -> float:
    """A CUDA-graph replay's predicted time: the forward's kernels (`busy_ms`, by the judge's profile), the copy of
    each input into the graph's buffers and of each output out of it, and the replay's fixed cost."""
    metas = [n.meta for n in graph.inputs] + [graph[r].meta for r in graph.outputs]
    nbytes = sum(m.numel * m.dtype.itemsize for m in metas if m is not None)
    return busy_ms + 2 * nbytes / (GRAPH_COPY_GBPS * 1e6) + GRAPH_REPLAY_MS


def try_graph(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
               log: Callable[[str], None]) -> OptimizeResult:
    """Judge each of `plans` replayed from a CUDA graph when the shipped file's forward is launch-bound (the GPU
    replay's predicted time, `graph_predicted_ms`, is GRAPH_MIN_GAIN times under the shipped one's); each ships if
    verified, faster than eager and GRAPH_MIN_GAIN times faster than what ships by then. Plans with random ops are
    not graphed."""
    final = result.final
    busy = _busy_ms(final)
    if final is None or not final.correct or not final.runtime_ms or busy is None:
        return result
    if graph_predicted_ms(plans[0].graph, busy) * GRAPH_MIN_GAIN > final.runtime_ms:
        return result
    if draws_random_numbers(plans[0].graph):
        result.notes.append("launch-bound, but not graphed: the forward draws random numbers")
        return result
    graphs = [plan.as_graphed() for plan in plans]
    log(f"      launch-bound: the GPU is busy {busy:.3f} of {final.runtime_ms:.3f} ms; judging "
        f"{', '.join(g.variant for g in graphs)}")
    for graphed in graphs:
        path = Path(tempfile.mkdtemp(prefix=f"kernelfuse_{problem.name}_")) / f"{problem.name}_{graphed.variant}.py"
        try:
            path.write_text(emit_file(problem, graphed, _UNDER_EVALUATION.format(graphed.variant)))
        except KernelfuseError:
            raise
        except Exception as err:  # noqa: BLE001 - the graphed file's bug: what ships stays as it is
            fall_back(result, Fallback("emit", f"variant {graphed.variant}", one_line(err)), log)
            continue
        verdict = evaluate(problem.path, path, judge_options(options, options.final_baselines))
        result.variants.append(VariantResult(graphed.variant, verdict))
        log(f"      {graphed.variant}: " + describe_verdict(verdict))
        now = result.final
        if verdict.correct and verdict.runtime_ms is not None and (verdict.speedup_eager or 0.0) >= 1.0 \
                and now is not None and now.runtime_ms is not None \
                and verdict.runtime_ms * GRAPH_MIN_GAIN <= now.runtime_ms:
            _write_verified(path, graphed, options, result)
            result.final = verdict
            result.notes.append(f"{graphed.variant} ships: {verdict.runtime_ms:.3f} ms against {now.runtime_ms:.3f} "
                                f"ms without the graph")  # an earlier note may say the original ops ship
            log(f"wrote {result.output} ({graphed.variant})")
        else:
            why = f"not verified: {verdict.reason}" if not verdict.correct else \
                f"{verdict.runtime_ms or 0:.3f} ms against {(now.runtime_ms or 0) if now else 0:.3f} ms"
            result.notes.append(f"{graphed.variant} does not ship ({why})")
    return result


def _ship_first_faster(problem: Problem, plans: list[Plan], files: dict[str, Path], options: OptimizeOptions,
                       result: OptimizeResult, log: Callable[[str], None]) -> OptimizeResult:
    """One judgement per plan against every baseline, in order: the first verified and faster than eager ships."""
    for plan in plans:
        verdict = evaluate(problem.path, files[plan.variant], judge_options(options, options.final_baselines))
        result.variants.append(VariantResult(plan.variant, verdict))
        log(f"      {plan.variant}: " + describe_verdict(verdict))
        if verdict.correct and verdict.speedup_eager is not None and verdict.speedup_eager >= 1.0:
            _write_verified(files[plan.variant], plan, options, result)
            result.final = verdict
            log(f"wrote {result.output} ({plan.variant})")
            return result
        why = f"not verified: {verdict.reason}" if not verdict.correct else f"{verdict.speedup_eager or 0:.3f}x eager"
        result.notes.append(f"{plan.variant} does not ship ({why})")
    result.notes[-1] += ": shipping the unfused model (the original ops)"
    return ship_unfused(problem, result, log, options)


def _write_verified(judged: Path, plan: Plan, options: OptimizeOptions, result: OptimizeResult) -> None:
    """The shipped file: the very file the judge built and verified, its header line saying so instead."""
    report = f"verified on {torch.cuda.get_device_name()}: variant {plan.variant}, {options.precision} precision"
    text = judged.read_text()
    result.output.write_text(text.replace(_UNDER_EVALUATION.format(plan.variant), report, 1))
    result.shipped = plan.variant


def judge_options(options: OptimizeOptions, baselines: tuple[str, ...]) -> EvalOptions:
    """The judge's options for the optimizer: its trials and policy, more timing repetitions than the minimum
    because the GEMM problems' gain (one pass over the output, ~1%) is close to run-to-run noise."""
    return EvalOptions(trials=options.trials, precision=options.precision, timeout_s=options.timeout_s,
                       baselines=baselines, timing_reps=options.timing_reps,
                       require_custom_kernel=options.require_custom_kernel)


def ship_unfused(problem: Problem, result: OptimizeResult, log: Callable[[str], None],
                  options: OptimizeOptions | None = None) -> OptimizeResult:
    """Ship the original ops; with `options` (a GPU) the judge also verifies and times them against the
    baselines, so a suite's record of an unfused problem carries eager's and torch.compile's times too. Under a
    policy that captures under autocast (bf16) the original ops are the captured ones, autocast's casts included:
    the original module would run in fp32."""
    graph = result.plans[0].graph if result.plans else None
    if graph is not None and graph.autocast is not None:
        report = "unfused: the captured ops under autocast; " + "; ".join(result.notes)
        result.output.write_text(emit_file(problem, torch_calls_plan(graph), report))
    else:
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
