"""`evaluate(problem, candidate, options) -> Verdict`: the judge, end to end, for the CLI and the optimizer.

Parent side only: extract the code, check it statically, run the worker in a child, and turn what came back (the
outcome file, the exit status, the log) into a Verdict. Candidate faults never raise; an unusable problem file
raises ProblemError (exit code 2).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from kernelfuse.bench.stats import speedup
from kernelfuse.judge.diagnose import describe_exit, diagnose_build_file, fatal_python_lines, tail
from kernelfuse.judge.options import MIN_REPS_ADVISED, EvalOptions
from kernelfuse.judge.protocol import LOG_FILE, OUTCOME_FILE, REQUEST_FILE, WorkerRequest
from kernelfuse.judge.reply import Candidate, NoCodeError, extract_candidate
from kernelfuse.judge.runner import ChildRun, run_worker
from kernelfuse.judge.static import static_check
from kernelfuse.judge.verdict import Verdict
from kernelfuse.load import load_problem
from kernelfuse.verify import SLACK_FACTOR, SLACK_REL

NOT_BUILT_KINDS = ("import_error", "build_error", "construct_error")
NO_CUSTOM_KERNEL = "no_custom_kernel"
REJECT_KINDS = ("tamper", "precision_flags", "threads", "timing_escape", "device_state")
INCORRECT_KINDS = ("timed_output_mismatch", "output_type", "inputs_modified")
CALL_CHECKS_OFF = ("per-call checks off (call_checks=False): timed-call comparison, input rotation, determinism, "
                   "output type and aliasing and device-state checks did not run; for measuring the judge's "
                   "overhead only, not a verdict on the candidate")
STAGE_WORDS = {
    "setup": "setup (importing torch, loading the problem)", "compiler_import": "importing torch.compile's machinery",
    "timer": "starting the GPU timer", "reference": "building the reference model",
    "import": "import of the candidate (building its extensions)", "construct": "ModelNew(...) construction",
    "guard": "checks after import", "parameters": "the parameter check", "to_device": "moving the models to the GPU",
    "probe": "the reference probe", "trials": "the correctness trials", "streams": "the stream check",
    "timing": "timing", "done": "the end",
}


def evaluate(problem_path: str | Path, candidate: str | Path, opts: EvalOptions | None = None) -> Verdict:
    """Judge `candidate` (a .py file or a text reply) against the problem file; never raises for candidate faults."""
    opts = opts or EvalOptions()
    problem = load_problem(problem_path)
    base: dict[str, Any] = {"problem": str(problem_path), "candidate": str(candidate), "precision": opts.precision,
                            "trials": opts.trials * (2 if opts.mode == "both" else 1)}
    try:
        cand = extract_candidate(candidate)
    except (NoCodeError, OSError) as err:
        return Verdict(code_from="-", status="not_built", built=False, correct=False, reason=str(err), **base)
    base["code_from"] = cand.describe()
    static = static_check(cand.source, problem, cand.line_offset)
    warnings = list(static.warnings)
    base["signals"] = tuple(s.to_dict() for s in static.signals)
    if not static.ok:
        return Verdict(status="not_built", built=False, correct=False, reason=static.errors[0],
                       warnings=tuple(warnings), **base)
    if opts.require_custom_kernel and opts.device == "cpu" and static.signals:  # no kernel of its own can run here
        return Verdict(status="incorrect", built=False, correct=False, defence=NO_CUSTOM_KERNEL,
                       reason=_no_custom_kernel({"signals": base["signals"]}), **base)
    workdir = Path(tempfile.mkdtemp(prefix="kernelfuse-eval-"))
    try:
        run = _run(workdir, problem.path, cand, opts)
        return _verdict(run, cand, opts, base, warnings)
    finally:
        if not opts.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(workdir: Path, problem_path: Path, cand: Candidate, opts: EvalOptions) -> ChildRun:
    stem = "".join(c if c.isalnum() or c in "_-" else "_" for c in cand.path.stem) or "candidate"
    source_path = workdir / f"{stem}_modelnew.py"
    source_path.write_text(cand.source)
    request = WorkerRequest(
        problem_path=str(Path(problem_path).resolve()), candidate_path=str(source_path),
        line_offset=cand.line_offset, outcome_path=str(workdir / OUTCOME_FILE), trials=opts.trials,
        precision=opts.precision, seed=opts.seed, timing_reps=opts.timing_reps, warmup=opts.warmup,
        baselines=tuple(opts.baselines), device=opts.device, float64=opts.float64,
        time_incorrect=opts.time_incorrect, input_sets=opts.input_sets, implausible_margin=opts.implausible_margin,
        mode=opts.mode, robust=opts.robust, call_checks=opts.call_checks,
    )
    request.save(workdir / REQUEST_FILE)
    return run_worker(workdir / REQUEST_FILE, workdir / OUTCOME_FILE, workdir / LOG_FILE, opts.timeout_s)


def _stage_seconds(outcome: dict[str, Any]) -> dict[str, float]:
    """Seconds the child spent in each stage it finished (from the stage timestamps): where a judgement's time goes."""
    stamps = outcome.get("stages") or []
    return {name: round(end - start, 3) for (name, start), (_, end) in zip(stamps, stamps[1:], strict=False)}


def _stage_words(outcome: dict[str, Any]) -> str:
    stage = outcome.get("stage", "setup")
    words = STAGE_WORDS.get(stage, stage)
    if stage == "trials":
        words += f" (trial {len(outcome.get('trials') or [])})"
    return words


def _where(failure: dict[str, Any], cand: Candidate) -> str:
    where = failure.get("where")
    if not where:
        return ""
    line = f"line {where['line']}" + (f" (reply line {where['reply_line']})" if cand.block else "")
    return f" at {line} (`{where['code']}`)" if where.get("code") else f" at {line}"


def _verdict(run: ChildRun, cand: Candidate, opts: EvalOptions, base: dict[str, Any], warnings: list[str]) -> Verdict:
    out = run.outcome
    failure = out.get("failure")
    built = bool(out.get("built"))
    trials = out.get("trials") or []
    fields: dict[str, Any] = dict(base)
    fields.update(_measurements(out, trials))
    fields["build_s"] = out.get("build_s")
    fields["device"] = out.get("device", "unknown")
    fields["torch_version"] = out.get("torch", "")
    fields["log_tail"] = tail(run.log_path, opts.log_tail_lines)
    fields["details"] = {k: out.get(k) for k in ("device_type", "stage", "extensions", "params", "probe", "streams",
                                                 "flags_changed", "patched", "float64_reference", "failure",
                                                 "compiler_threads")
                         if out.get(k) is not None}
    fields["details"]["trials"] = trials
    fields["details"]["stage_s"] = _stage_seconds(out)
    fields["details"]["worker"] = run.started  # forked from the warm server, or spawned with python -m
    if out.get("timing"):
        fields["details"]["timing_s"] = out["timing"].get("seconds")
        fields["details"]["floor"] = out["timing"].get("floor")
        fields["details"]["timing_escape"] = out["timing"].get("escape")
        fields["input_sets"] = out["timing"].get("input_sets")
        fields["checked_timed_calls"] = out["timing"].get("checked_calls")
    fields["mode"] = opts.mode
    if out.get("robust") is not None:
        fields["robust"] = out["robust"]["ok"]
        fields["robust_failures"] = tuple(out["robust"]["failures"])
    warnings = warnings + [w for w in out.get("warnings", []) if w not in warnings]
    skipped64 = [t["float64_skipped"] for t in trials if t.get("float64_skipped")]
    if skipped64:
        warnings.append(f"float64 reference skipped in {len(skipped64)} trial(s): {skipped64[0]}; those trials "
                        "compare with eager only (atol/rtol)")
    by_accuracy = [t for t in trials if t.get("passed") and t.get("by_accuracy")]
    if by_accuracy:
        warnings.append(f"{len(by_accuracy)} trial(s) passed on the float64 accuracy rule, not within the "
                        f"tolerance of eager: eager runs TF32 here, and the candidate is up to "
                        f"{max(t['max_abs'] for t in by_accuracy):.3g} from eager but no further from float64 "
                        f"({max(t['err64_ours'] for t in by_accuracy):.3g}) than twice eager's "
                        f"({max(t['err64_eager'] for t in by_accuracy):.3g})")
    if not opts.call_checks:
        warnings.append(CALL_CHECKS_OFF)
    if out.get("timing") and opts.timing_reps < MIN_REPS_ADVISED:
        warnings.append(f"{opts.timing_reps} timed runs per version: fewer than the {MIN_REPS_ADVISED} the method asks")
    status, reason, defence = _status(run, out, failure, cand, opts, fields, built, trials)
    if status == "no_device":  # the import ran against stubs: that time is no build time
        fields["build_s"] = None
    elif fields["build_s"] is None:  # a failed build: the seconds its extension builds took before failing
        spent = [e["seconds"] for e in out.get("extensions") or [] if not e.get("stubbed")]
        fields["build_s"] = round(sum(spent), 3) if spent else None
    if fields["custom_kernel_share"] == 0:
        warnings.append("no custom kernel ran: the profiled forward spent none of its GPU time in kernels of the "
                        "candidate's own (library: " + ", ".join((fields["kernels"] or {}).get("library", [])[:3])
                        + (f"; compiler: {', '.join(fields['kernels']['compiler'][:3])}"
                           if (fields["kernels"] or {}).get("compiler") else "") + ")")
    if opts.require_custom_kernel and status in ("ok", "no_device"):
        missing = _no_custom_kernel(fields)
        if missing:
            status, reason, defence = "incorrect", missing, NO_CUSTOM_KERNEL
    correct = status == "ok"
    if not correct:  # timings of a failed candidate stay in the record, but no speedup is claimed for it
        fields["speedup_eager"] = fields["speedup_compile"] = None
        fields["baselines"] = {k: {**b, "speedup": None} for k, b in fields["baselines"].items()}
    return Verdict(status=status, built=built and status != "no_device", correct=correct, reason=reason,
                   defence=defence, warnings=tuple(warnings), **fields)


def _measurements(out: dict[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any]:
    def worst(key: str) -> float | None:
        values = [t[key] for t in trials if t.get(key) is not None]
        return max(values) if values else None

    timing = out.get("timing") or {}
    stats = timing.get("stats") or {}
    ours, eager, comp = stats.get("candidate"), stats.get("eager"), stats.get("compile")
    compile_seconds = timing.get("compile_seconds") or {}
    baselines = {name: {"ms": s["median"], "stats": s, "speedup": speedup(s["median"], ours and ours["median"]),
                        "compile_s": compile_seconds.get(name)} for name, s in stats.items() if name != "candidate"}
    kernels = out.get("kernels")
    floor = timing.get("floor") or {}
    anchors = timing.get("anchors") or {}
    probe = out.get("probe") or {}
    params = out.get("params") or {}
    return {
        "trials_run": len(trials), "trials_passed": sum(bool(t.get("passed")) for t in trials),
        "max_abs_err": worst("max_abs"), "max_rel_err": worst("max_rel"), "err64_ours": worst("err64_ours"),
        "err64_eager": worst("err64_eager"), "err64_base": worst("err64_base"),
        "uses_tf32": probe.get("uses_tf32"), "params_match": params.get("ok"),
        "runtime_ms": ours["median"] if ours else None, "eager_ms": eager["median"] if eager else None,
        "compile_ms": comp["median"] if comp else None, "ours_stats": ours, "eager_stats": eager,
        "compile_stats": comp, "compile_s": timing.get("compile_s"),
        "speedup_eager": speedup(eager and eager["median"], ours and ours["median"]),
        "speedup_compile": speedup(comp and comp["median"], ours and ours["median"]),
        "floor_ms": floor.get("ms"), "anchor_ms": anchors.get("ms"), "anchor_calls": anchors.get("calls"),
        "baselines": baselines, "kernels": kernels,
        "custom_kernel_share": kernels["custom_kernel_share"] if kernels else None,
        "float64_rule": _float64_rule(trials),
    }


def _float64_rule(trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The float64 rule's numbers in the trial closest to (or furthest past) its bound: what measuring the rule's
    false rejections needs (both errors, the scale, the bound, ours over the bound, and the mean errors a rule on
    averages would use)."""
    rows = [t for t in trials if t.get("err64_bound") is not None and t.get("err64_ours") is not None]
    if not rows:
        return None
    worst = max(rows, key=lambda t: t["err64_ours"] / t["err64_bound"] if t["err64_bound"] else float("inf"))
    bound = worst["err64_bound"]
    return {"trial": worst["index"], "ours_err": worst["err64_ours"], "base_err": worst["err64_base"],
            "eager_err": worst["err64_eager"], "ref_scale": worst["err64_scale"], "bound": bound,
            "mean_ours_err": worst.get("err64_mean_ours"), "mean_base_err": worst.get("err64_mean_base"),
            "ratio": worst["err64_ours"] / bound if bound else None, "slack_factor": SLACK_FACTOR,
            "slack_rel": SLACK_REL, "passed": bool(worst.get("passed"))}


def _no_custom_kernel(fields: dict[str, Any]) -> str | None:
    """Why the candidate ran no kernel of its own (the GPU's accounting, else the static signals), or None."""
    share = fields.get("custom_kernel_share")
    if share is not None:
        if share > 0:
            return None
        library = ", ".join(((fields.get("kernels") or {}).get("library") or [])[:3]) or "none"
        return f"no custom kernel ran: 0 of the profiled forward's GPU time was in kernels of its own (top: {library})"
    signals = fields.get("signals") or ()
    if not signals:
        return None
    return "no custom kernel ran (static signals; no kernel profile of the candidate): " + "; ".join(
        s["message"] for s in signals)


def _status(run: ChildRun, out: dict[str, Any], failure: dict[str, Any] | None, cand: Candidate,
            opts: EvalOptions, fields: dict[str, Any], built: bool,
            trials: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """(status, reason, defence) from how the child ended and what it reported."""
    after_build = "incorrect" if built else "not_built"
    if run.timed_out:
        status = "timeout" if built else "not_built"
        return status, f"timed out after {opts.timeout_s:g} s during {_stage_words(out)}; the process group was " \
                       "killed", None
    if failure is None and not out.get("finished"):
        lines = fatal_python_lines(tail(run.log_path, 200), Path(cand.path).stem)
        code = describe_exit(run.returncode) if run.returncode is not None else "did not exit after SIGKILL"
        reason = f"the worker process {code} during {_stage_words(out)}"
        if lines:
            reason += ": " + " | ".join(lines)
        return ("crashed" if built else "not_built"), reason, None
    if failure is not None:
        kind, message = failure.get("kind"), failure.get("message", "")
        where = _where(failure, cand)
        if kind == "no_device":
            return "no_device", message, None
        if kind == "build_error":
            flags = [f for e in (out.get("extensions") or []) if not e.get("ok") for f in e.get("flags", [])]
            diag = diagnose_build_file(run.log_path, flags)
            fields["build_cause"] = diag.cause
            fields["build_errors"] = diag.key_lines
            failed = [e["name"] for e in (out.get("extensions") or []) if not e.get("ok")]
            return "not_built", f"build failed ({', '.join(failed)}): {diag.cause}", None
        if kind in NOT_BUILT_KINDS:
            label = {"import_error": "import failed", "construct_error": "ModelNew(*get_init_inputs()) failed"}[kind]
            return "not_built", f"{label}{where}: {message}", None
        if kind in REJECT_KINDS:
            return ("rejected" if built else "not_built"), message, kind
        if kind in INCORRECT_KINDS:
            return after_build, message, kind
        if kind == "implausible":
            return "implausible", message, kind
        if kind == "out_of_memory":
            return "runtime_error", (f"out of device memory at the judge's {failure.get('stage', '?')} stage{where}: "
                                     f"the models with the judge's input copies and outputs do not fit on this "
                                     f"device ({message.splitlines()[0][:200] if message else ''})"), None
        if kind in ("runtime_error", "cuda_fault"):
            when = failure.get("when")
            prefix = "CUDA fault" if kind == "cuda_fault" else "the candidate raised"
            return kind, f"{prefix}{' (' + when + ')' if when else ''}{where}: {message.splitlines()[0]}", None
        return "internal_error", f"judge error ({kind}){where}: {message.splitlines()[0] if message else ''}", None
    failed = [t for t in trials if not t.get("passed")]
    if failed:
        first = failed[0]
        label = {"train": "as constructed"}.get(first.get("mode"), first.get("mode"))
        mode = f" ({label} mode)" if opts.mode != "train" and first.get("mode") else ""
        reason = f"{len(failed)} of {len(trials)} trials failed; first{mode}: {first.get('reason')}"
        params = out.get("params") or {}
        if params.get("ok") is False and first.get("defence") == "mismatch":
            return after_build, f"{params.get('summary')}, so the same seed gives different weights: {reason}", \
                "parameters"
        return after_build, reason, first.get("defence")
    if len(trials) < fields["trials"]:
        return after_build, f"only {len(trials)} of {fields['trials']} trials ran", None
    return "ok", None, None
