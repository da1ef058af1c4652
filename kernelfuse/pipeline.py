"""The optimize pipeline: load -> capture -> rewrite -> plan -> codegen -> emit -> (GPU) build, judge, choose.

Without a GPU the plans are checked by the CPU interpreter against the original model and the default variant is
emitted, saying plainly that GPU verification did not run. With a GPU every variant is built (in parallel),
judged by `kernelfuse.judge` (the same judge as `kernelfuse eval`), and the fastest verified variant ships only
if it beats eager; otherwise the unfused file (the original ops) ships and the report says why. When the judge's
profile shows the GPU idle for long enough that a replay of the same kernels from a CUDA graph should be faster
(launch-bound: deep models, small batches, transformers' Python), that replay is judged too and ships if verified
and faster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kernelfuse.bench.layout import LayoutTiming, measure_conv_layouts
from kernelfuse.capture import Graph, build_model, capture, draws_random_numbers
from kernelfuse.codegen import generate, generate_checked
from kernelfuse.compilecheck import CompileCheck, check_files
from kernelfuse.cpucheck import CpuCheck, check_plans
from kernelfuse.emit import check_emittable, emit_modelnew, emit_reference
from kernelfuse.errors import Fallback, KernelfuseError, Unsupported, one_line
from kernelfuse.fallback import plans_with_fallbacks, run_stage
from kernelfuse.judge import EvalOptions, Verdict, evaluate
from kernelfuse.judge.runner import judge_zygote
from kernelfuse.load import Problem, check_output_path, load_problem
from kernelfuse.plan import Plan, optimizer_variants, plan_variants, torch_calls_plan
from kernelfuse.rewrite import RULE_NAMES, RuleFiring, apply_rules
from kernelfuse.verify.policy import get_policy

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


@dataclass(frozen=True)
class OptimizeOptions:
    precision: str = "strict"
    trials: int = 5
    timeout_s: float = 900.0
    use_gpu: bool | None = None  # None: use one when torch sees it
    final_baselines: tuple[str, ...] = ("eager", "compile")
    timing_reps: int = 50
    no_rewrites: bool = False  # --no-rewrites: plan the graph as captured
    disabled_rewrites: tuple[str, ...] = ()  # --no-rewrite NAME: rewrite rules switched off
    max_fusions: int | None = None  # --max-fusions N: fuse at most N kernels (bisecting a numerical failure)
    # False: on a GPU the judge alone verifies the plans (kernelfuse bench: the CPU check, seconds to tens of
    # seconds, would sit on the GPU worker's critical path; the judge verifies every plan before it ships)
    cpu_check: bool = True
    # False: the variants are not built in parallel first (kernelfuse bench: its build phase built them on other
    # cores; the judge builds whatever it does not find in the cache)
    prebuild: bool = True
    require_custom_kernel: bool = False  # --require-custom-kernel: a shipped file running no kernel of its own fails


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
    rewrites: tuple[RuleFiring, ...] = ()  # the rewrite rules that fired, in order
    fallbacks: list[Fallback] = field(default_factory=list)  # parts shipped as the original ops, and why
    compile_checks: list[CompileCheck] = field(default_factory=list)  # without a GPU: nvcc on each checked file


def optimize_file(problem_path: str | Path, out_path: str | Path, options: OptimizeOptions = OptimizeOptions(),
                  log: Callable[[str], None] = print) -> OptimizeResult:
    """Optimize the problem file into a self-contained ModelNew file at `out_path`: capture, rewrite, plan, check
    on the CPU, then build, verify and time each variant on the GPU (where there is one) and ship the best."""
    use_gpu = torch.cuda.is_available() if options.use_gpu is None else options.use_gpu
    # the judge's fork server imports torch.compile's machinery while the problem is captured and planned
    with judge_zygote() if use_gpu else nullcontext():
        return _optimize(problem_path, out_path, options, log, use_gpu)


def _optimize(problem_path: str | Path, out_path: str | Path, options: OptimizeOptions, log: Callable[[str], None],
              use_gpu: bool) -> OptimizeResult:
    out_path = check_output_path(Path(problem_path), Path(out_path))
    problem = load_problem(problem_path)
    log(f"[1/5] loaded {problem.path}")
    model = build_model(problem)
    try:
        check_emittable(problem)
        captured = capture(problem, model, autocast=get_policy(options.precision).autocast)
    except Unsupported as why:  # found before any planning: the original module ships, saying why
        result = OptimizeResult(out_path, "unfused", [], [])
        _fall_back(result, why.fallback, log)
        result.notes.append(f"{why.fallback}: shipping the original module")
        return _ship_unfused(problem, result, log, options if use_gpu else None)
    except KernelfuseError:  # the forward cannot be traced (a branch on a tensor's value...): exit 3, one line
        raise
    except Exception as err:  # noqa: BLE001 - a capture bug: the original module ships, with the reason
        result = OptimizeResult(out_path, "unfused", [], [])
        _fall_back(result, Fallback("capture", "the whole forward", one_line(err)), log)
        result.notes.append("the forward could not be captured: shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options if use_gpu else None)
    disabled = RULE_NAMES if options.no_rewrites else options.disabled_rewrites
    rewritten = apply_rules(captured, disabled)
    graph = rewritten.graph
    mode = "training mode" if graph.training else "eval mode"
    if graph.mixed_modes:
        mode = f"mixed modes: {graph.modes.count('0')} of {len(graph.modes)} modules in eval mode"
    log(f"[2/5] captured {len(graph.nodes)} ATen nodes on fake tensors ({mode}); {rewritten.summary()}")
    result = OptimizeResult(out_path, "unfused", [], [], rewrites=rewritten.fired)
    for fallback in rewritten.failed:
        _fall_back(result, fallback, log)
    timings = _measure_conv_layouts(graph, options.precision, result, log) if use_gpu else None
    layouts = None if timings is None else {t.node: t.choice for t in timings}
    fp32 = frozenset(t.node for t in timings or [] if t.fp32)
    plans, fallbacks = plans_with_fallbacks(
        graph, lambda keep: optimizer_variants(graph, options.precision, options.max_fusions, layouts, fp32, keep),
        lambda plan: _render(problem, plan))
    for fallback in fallbacks:
        _fall_back(result, fallback, log)
    for plan in plans:
        log("[3/5] " + plan.summary().replace("\n", "\n      "))
    result.plans = plans
    if not plans:
        result.notes.append("no plan could be made: shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options if use_gpu else None)
    result.shipped = plans[0].variant
    if not any(p.launches_kernels for p in plans) and not rewritten.fired:  # a rewritten graph is worth a plan
        result.notes.append("nothing to fuse (no library call with pointwise ops behind it): "
                            "shipping the unfused model")
        if not use_gpu:
            return _ship_unfused(problem, result, log)
        return _try_graph(problem, plans[:1], options, _ship_unfused(problem, result, log, options), log)
    if use_gpu and not options.cpu_check:
        del model
        log("[4/5] CPU interpreter check skipped: the GPU judge verifies every plan")
        return _choose_then_graph(problem, plans, options, result, log, in_order=_layout_decided(plans, timings))
    checks = check_plans(problem, model, graph, plans, lambda g: apply_rules(g, disabled).graph)
    result.cpu_checks = checks
    del model  # the weights are not needed past the check: the judge builds its own copies
    for c in checks:
        log(f"[4/5] CPU interpreter check ({c.variant}): {c.status} — {c.note}")
    # a plan that passed comes first; a skipped check is no pass, but the GPU judge still verifies such a plan
    good = [p for p, c in sorted(zip(plans, checks, strict=True), key=lambda pc: not pc[1].ok)
            if c.ok or c.skipped]
    if not good:
        result.notes.append("every fused plan failed the CPU check: shipping the unfused model")
        if not use_gpu:
            return _ship_unfused(problem, result, log)
        ops_only = plan_variants(graph, options.precision, max_fusions=0)[0]  # the captured ops, no fusion
        return _try_graph(problem, [ops_only], options, _ship_unfused(problem, result, log, options), log)
    if not use_gpu:
        return _ship_compiled(problem, good, checks, result, log)
    return _choose_then_graph(problem, good, options, result, log, in_order=_layout_decided(good, timings))


def _render(problem: Problem, plan: Plan) -> None:
    """Generate and emit `plan` once, so a kernel that code generation or emission fails on is found before any
    check (kernelfuse.fallback keeps its nodes as torch calls); the binding is dry-run too (check_bindings)."""
    sources = run_stage("codegen", generate_checked, plan)
    run_stage("emit", emit_modelnew, problem, plan, sources, "")


def _fall_back(result: OptimizeResult, fallback: Fallback, log: Callable[[str], None]) -> None:
    result.fallbacks.append(fallback)
    log(f"      fallback: {fallback.describe()}")


def _ship_compiled(problem: Problem, good: list[Plan], checks: list[CpuCheck], result: OptimizeResult,
                   log: Callable[[str], None]) -> OptimizeResult:
    """Without a GPU: the first plan whose file nvcc compiles ships (all files compile at once); a file that does
    not compile is never written, its variant a fallback with the compiler's first error; none left, the
    original ops. Without nvcc the first plan ships and the notes say the compile check did not run."""
    texts = {p.variant: emit_file(problem, p, "not verified on a GPU (none available)") for p in good}
    compiled = check_files(texts)
    result.compile_checks = list(compiled.values())
    for c in result.compile_checks:
        log(f"[4/5] nvcc compile check ({c.variant}): {c.status} — {c.note}")
        if not c.ok:
            _fall_back(result, Fallback("compile", f"variant {c.variant}", c.note), log)
    plan = next((p for p in good if compiled[p.variant].ok), None)
    if plan is None:
        result.notes.append("no fused variant's CUDA compiles: shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log)
    check, compile_check = checks[result.plans.index(plan)], compiled[plan.variant]
    result.output.write_text(texts[plan.variant])
    result.shipped = plan.variant
    result.notes.append("no CUDA device: GPU build, verification and benchmark did NOT run; " + (
        "the plan was checked with the CPU interpreter only" if check.ok else f"the CPU check was {check.note}") + (
        "; its CUDA compiles with nvcc" if compile_check.status == "ok" else f"; {compile_check.note}"))
    log(f"[5/5] wrote {result.output} ({plan.variant})")
    return result


def _layout_decided(plans: list[Plan], timings: list[LayoutTiming] | None) -> bool:
    """Do the convolution timings alone order the plans (judge the first, the rest only if it fails)? Not where
    a generated kernel reads a convolution's channels-last output: its reads follow that layout, and a norm's
    rows interleaved across channels cost more than the layout saves (level-2 60, ConvTranspose3d + GroupNorm:
    cuDNN 0.87 ms faster channels-last, the group norm 3.9 ms in that layout). Both plans are judged whole then;
    so is a plan whose convolution is our own kernel with the epilogue inside, and the channels-last graph's (no
    layout timing predicts either)."""
    return timings is not None and not any(s.keeps_layout for p in plans[:1] for s in p.fused) \
        and not any(s.anchor.epilogue_inside for p in plans for s in p.fused) \
        and not any(getattr(p.options, "channels_last_graph", False) for p in plans)


def _measure_conv_layouts(graph: Graph, precision: str, result: OptimizeResult,
                          log: Callable[[str], None]) -> list[LayoutTiming] | None:
    """Each convolution's layout, timed both ways on this GPU (None: no convolution, or one that could not be
    measured: then both layouts' plans are judged whole)."""
    try:
        timings = measure_conv_layouts(graph, strict=precision == "strict")
    except Exception as err:  # noqa: BLE001 - a measurement's bug: both layouts are judged whole instead
        _fall_back(result, Fallback("plan", "the convolution layout timing", one_line(err)), log)
        return None
    for t in timings or []:
        log("[3/5] convolution layout " + t.describe())
    return timings or None


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
        return _ship_unfused(problem, result, log, options)
    plan, verdict = best
    if verdict.speedup_eager is None or verdict.speedup_eager < 1.0:
        result.notes.append(f"fusion does not pay ({plan.variant}: {verdict.speedup_eager or 0:.3f}x eager): "
                            "shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options)
    _write_verified(files[plan.variant], plan, options, result)
    result.final = evaluate(problem.path, result.output, judge_options(options, options.final_baselines))
    if not result.final.correct:  # the shipped text failed where its variant passed: never ship it
        result.notes.append(f"the final check of {plan.variant} failed ({result.final.reason}): "
                            "shipping the unfused model (the original ops)")
        return _ship_unfused(problem, result, log, options)
    log(f"wrote {result.output} ({plan.variant})")
    return result


RETIME_WITHIN = 1.25  # a runner-up this close to the fastest variant is timed again before one ships


def _retimed_best(problem: Problem, judged: list[tuple[Plan, Verdict]], files: dict[str, Path],
                  quick: EvalOptions, log: Callable[[str], None]) -> tuple[Plan, Verdict] | None:
    """The fastest verified variant. Each was timed once, at its own moment, and a moment of host contention (the
    suite building the next problem beside the judge) slowed one host-bound variant by 30%: where the runner-up is
    within RETIME_WITHIN of the fastest, both are timed again (one trial) and each keeps its better time."""
    ranked = sorted(judged, key=lambda pv: pv[1].runtime_ms)  # type: ignore[arg-type, return-value]
    if len(ranked) < 2 or ranked[1][1].runtime_ms > ranked[0][1].runtime_ms * RETIME_WITHIN:  # type: ignore[operator]
        return ranked[0] if ranked else None
    again = replace(quick, trials=1)
    times = {}
    for plan, verdict in ranked[:2]:
        second = evaluate(problem.path, files[plan.variant], again)
        ms = [t for t in (verdict.runtime_ms, second.runtime_ms if second.correct else None) if t is not None]
        times[plan.variant] = min(ms)
        log(f"      {plan.variant} timed again: {second.runtime_ms or float('nan'):.3f} ms")
    return min(ranked[:2], key=lambda pv: times[pv[0].variant])


def _choose_then_graph(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
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
    return _try_graph(problem, [candidate] + ([lean] if lean is not None and lean is not candidate else []),
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


def _try_graph(problem: Problem, plans: list[Plan], options: OptimizeOptions, result: OptimizeResult,
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
            _fall_back(result, Fallback("emit", f"variant {graphed.variant}", one_line(err)), log)
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
    return _ship_unfused(problem, result, log, options)


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


def _ship_unfused(problem: Problem, result: OptimizeResult, log: Callable[[str], None],
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
