"""The optimize pipeline: load -> capture -> rewrite -> plan -> codegen -> emit -> (GPU) build, judge, choose.

Without a GPU the plans are checked by the CPU interpreter against the original model and the default variant is
emitted, saying plainly that GPU verification did not run. With a GPU every variant is built (in parallel),
judged by `kernelfuse.judge` (the same judge as `kernelfuse eval`), and the fastest verified variant ships only
if it beats eager; otherwise the unfused file (the original ops) ships and the report says why. When the judge's
profile shows the GPU idle for long enough that a replay of the same kernels from a CUDA graph should be faster
(launch-bound: deep models, small batches, transformers' Python), that replay is judged too and ships if verified
and faster. The GPU-side choice of what ships is kernelfuse.choose.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from kernelfuse.bench.layout import LayoutTiming, measure_conv_layouts
from kernelfuse.capture import Graph, build_model, capture
from kernelfuse.choose import choose_then_graph, describe_verdict, emit_file, ship_unfused, try_graph
from kernelfuse.codegen import generate_checked
from kernelfuse.compilecheck import check_files
from kernelfuse.cpucheck import CpuCheck, check_plans
from kernelfuse.emit import check_emittable, emit_modelnew
from kernelfuse.errors import Fallback, KernelfuseError, Unsupported, one_line
from kernelfuse.fallback import plans_with_fallbacks, run_stage
from kernelfuse.judge.runner import judge_zygote
from kernelfuse.load import Problem, check_output_path, load_problem
from kernelfuse.optimize_result import OptimizeOptions, OptimizeResult, VariantResult, fall_back
from kernelfuse.plan import Plan, optimizer_variants, plan_variants
from kernelfuse.rewrite import RULE_NAMES, apply_rules
from kernelfuse.verify.policy import get_policy

# what other modules import from here: the GPU-side choice lives in kernelfuse.choose, the options and results in
# kernelfuse.optimize_result
__all__ = ["OptimizeOptions", "OptimizeResult", "VariantResult", "describe_verdict", "emit_file", "optimize_file"]


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
        fall_back(result, why.fallback, log)
        result.notes.append(f"{why.fallback}: shipping the original module")
        return ship_unfused(problem, result, log, options if use_gpu else None)
    except KernelfuseError:  # the forward cannot be traced (a branch on a tensor's value...): exit 3, one line
        raise
    except Exception as err:  # noqa: BLE001 - a capture bug: the original module ships, with the reason
        result = OptimizeResult(out_path, "unfused", [], [])
        fall_back(result, Fallback("capture", "the whole forward", one_line(err)), log)
        result.notes.append("the forward could not be captured: shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log, options if use_gpu else None)
    disabled = RULE_NAMES if options.no_rewrites else options.disabled_rewrites
    rewritten = apply_rules(captured, disabled)
    graph = rewritten.graph
    mode = "training mode" if graph.training else "eval mode"
    if graph.mixed_modes:
        mode = f"mixed modes: {graph.modes.count('0')} of {len(graph.modes)} modules in eval mode"
    log(f"[2/5] captured {len(graph.nodes)} ATen nodes on fake tensors ({mode}); {rewritten.summary()}")
    result = OptimizeResult(out_path, "unfused", [], [], rewrites=rewritten.fired)
    for fallback in rewritten.failed:
        fall_back(result, fallback, log)
    timings = _measure_conv_layouts(graph, options.precision, result, log) if use_gpu else None
    layouts = None if timings is None else {t.node: t.choice for t in timings}
    fp32 = frozenset(t.node for t in timings or [] if t.fp32)
    plans, fallbacks = plans_with_fallbacks(
        graph, lambda keep: optimizer_variants(graph, options.precision, options.max_fusions, layouts, fp32, keep),
        lambda plan: _render(problem, plan))
    for fallback in fallbacks:
        fall_back(result, fallback, log)
    for plan in plans:
        log("[3/5] " + plan.summary().replace("\n", "\n      "))
    result.plans = plans
    if not plans:
        result.notes.append("no plan could be made: shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log, options if use_gpu else None)
    result.shipped = plans[0].variant
    if not any(p.launches_kernels for p in plans) and not rewritten.fired:  # a rewritten graph is worth a plan
        result.notes.append("nothing to fuse (no library call with pointwise ops behind it): "
                            "shipping the unfused model")
        if not use_gpu:
            return ship_unfused(problem, result, log)
        return try_graph(problem, plans[:1], options, ship_unfused(problem, result, log, options), log)
    if use_gpu and not options.cpu_check:
        del model
        log("[4/5] CPU interpreter check skipped: the GPU judge verifies every plan")
        return choose_then_graph(problem, plans, options, result, log, in_order=_layout_decided(plans, timings))
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
            return ship_unfused(problem, result, log)
        ops_only = plan_variants(graph, options.precision, max_fusions=0)[0]  # the captured ops, no fusion
        return try_graph(problem, [ops_only], options, ship_unfused(problem, result, log, options), log)
    if not use_gpu:
        return _ship_compiled(problem, good, checks, result, log)
    return choose_then_graph(problem, good, options, result, log, in_order=_layout_decided(good, timings))


def _render(problem: Problem, plan: Plan) -> None:
    """Generate and emit `plan` once, so a kernel that code generation or emission fails on is found before any
    check (kernelfuse.fallback keeps its nodes as torch calls); the binding is dry-run too (check_bindings)."""
    sources = run_stage("codegen", generate_checked, plan)
    run_stage("emit", emit_modelnew, problem, plan, sources, "")



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
            fall_back(result, Fallback("compile", f"variant {c.variant}", c.note), log)
    plan = next((p for p in good if compiled[p.variant].ok), None)
    if plan is None:
        result.notes.append("no fused variant's CUDA compiles: shipping the unfused model (the original ops)")
        return ship_unfused(problem, result, log)
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
        fall_back(result, Fallback("plan", "the convolution layout timing", one_line(err)), log)
        return None
    for t in timings or []:
        log("[3/5] convolution layout " + t.describe())
    return timings or None
