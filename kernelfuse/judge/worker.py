"""The child process that builds, checks and times one candidate: `python -m kernelfuse.judge.worker REQUEST.json`.

One child per candidate, so a CUDA fault (which kills the CUDA context for good), a segfault or a hang ends this
process only; the judge reads the outcome file, rewritten at every stage, and the log. Order of work:
setup (flags and identities captured before the candidate is imported) -> import -> construct -> guard check ->
parameters -> (no device: stop) -> move to device -> probe -> trials (per mode; robustness trials) -> streams ->
timing (checked timed calls, implausibility).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kernelfuse.bench import Timer
from kernelfuse.judge.accounting import mapped_libraries
from kernelfuse.judge.buildwatch import ExtensionBuild, watch_builds
from kernelfuse.judge.calls import CandidateCallError, Models, TrialSettings, synchronize
from kernelfuse.judge.diagnose import is_cuda_fault
from kernelfuse.judge.guard import Snapshot, new_threads, python_threads, record_thread_origins
from kernelfuse.judge.outcome import Failed, Outcome, describe_error, runtime_failure
from kernelfuse.judge.protocol import WorkerRequest
from kernelfuse.judge.sidechecks import check_streams, note_compiler_threads, robust_trials
from kernelfuse.judge.timing import run_timing
from kernelfuse.judge.trials import poison_reserve_for, probe_reference, run_trials
from kernelfuse.load import load_problem
from kernelfuse.verify import NumericsFlags, compare_state, float64_model, get_policy
from kernelfuse.verify.memory import float64_need, place_float64

CANDIDATE_MODULE = "kernelfuse_candidate"
MODE_RUNS = {"train": ("train",), "eval": ("eval",), "both": ("train", "eval")}  # "train": as constructed
MODE_LABELS = {"train": "as constructed", "eval": "eval"}
NO_DEVICE = "no CUDA device: not built or run"


def _import_candidate(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(CANDIDATE_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[CANDIDATE_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _prewarm_compiler() -> None:
    """Import torch.compile's machinery now: on first use (torch.compile, FlopCounterMode) it wraps torch.manual_seed
    and torch.nn.Module.__init__ once, which must not be blamed on the candidate."""
    try:
        import torch._dynamo  # noqa: F401
        from torch._dynamo.mutation_guard import install_generation_tagging_init

        install_generation_tagging_init()
    except Exception:  # noqa: BLE001 - older or newer torch: nothing to pre-install
        pass


def run(request: WorkerRequest, out: Outcome) -> None:
    """All stages; raises Failed (recorded in the outcome) to stop early."""
    out.stage("setup")
    want_cuda = request.device == "cuda"
    has_cuda = want_cuda and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if has_cuda else torch.device("cpu")
    out.set(device_type="cuda" if has_cuda else ("none" if want_cuda else "cpu"),
            device=torch.cuda.get_device_name(device) if has_cuda else "cpu", torch=torch.__version__,
            cuda=torch.version.cuda)
    policy = get_policy(request.precision)
    problem = load_problem(request.problem_path)
    init_inputs = problem.init_inputs()
    record_thread_origins()
    out.stage("compiler_import")
    _prewarm_compiler()
    out.stage("timer")
    timer = Timer(device) if has_cuda else Timer(device, flush=False)
    default_flags = NumericsFlags.capture()
    snapshot = Snapshot.take()
    threads_before = python_threads()
    libraries_before = mapped_libraries()

    out.stage("reference")
    reference = problem.make_model(request.seed, init_inputs)
    constructed = {id(reference): constructed_modes(reference)}  # per module, before anything flips them

    builds: list[ExtensionBuild] = []
    stub = NO_DEVICE if (want_cuda and not has_cuda) else None
    start = time.perf_counter()
    with watch_builds(builds, stub_reason=stub):
        out.stage("import")
        try:
            module = _import_candidate(request.candidate_path)
        except BaseException as err:  # noqa: BLE001 - SystemExit and friends from the candidate included
            out.set(extensions=[b.to_dict() for b in builds])
            kind = "build_error" if any(not b.ok and not b.stubbed for b in builds) else "import_error"
            raise out.fail(kind, **describe_error(err, request.candidate_path, request.line_offset)) from None
        import_s = time.perf_counter() - start
        model_new = getattr(module, "ModelNew", None)
        if model_new is None:
            raise out.fail("import_error", "the candidate module defines no ModelNew")
        out.stage("construct")
        try:
            torch.manual_seed(request.seed)
            candidate = model_new(*init_inputs)
        except BaseException as err:  # noqa: BLE001
            out.set(extensions=[b.to_dict() for b in builds])
            kind = "build_error" if any(not b.ok and not b.stubbed for b in builds) else "construct_error"
            raise out.fail(kind, **describe_error(err, request.candidate_path, request.line_offset)) from None
    build_s = time.perf_counter() - start
    out.set(built=not stub, build_s=round(build_s, 3), import_s=round(import_s, 3),
            extensions=[b.to_dict() for b in builds])
    if not isinstance(candidate, torch.nn.Module):
        raise out.fail("construct_error", f"ModelNew(...) returned {type(candidate).__name__}, not an nn.Module")
    constructed[id(candidate)] = constructed_modes(candidate)

    out.stage("guard")
    patched = snapshot.changes()
    if patched:
        out.set(patched=patched)
        raise out.fail("tamper", "the candidate replaced torch, timing or judge functions when imported: "
                       + ", ".join(patched[:12]) + (f" (+{len(patched) - 12} more)" if len(patched) > 12 else ""))
    candidate_flags = NumericsFlags.capture()
    flag_changes = candidate_flags.changes_from(default_flags)
    out.set(flags_changed=flag_changes)
    lowered = candidate_flags.lowers_precision_from(default_flags)
    if lowered and policy.name == "strict":
        raise out.fail("precision_flags", "the candidate changed global numerics flags when imported, lowering the "
                       "precision of all float32 work (the reference's too): " + "; ".join(lowered))
    if flag_changes:
        out.warn("the candidate changed global numerics flags when imported (applied to its own calls only; the "
                 "reference and baselines run with the original flags): " + "; ".join(flag_changes))
    threads = new_threads(threads_before)
    if threads:
        raise out.fail("threads", f"the candidate started Python thread(s) when imported: {', '.join(threads)}")

    out.stage("parameters")
    state = compare_state(reference, candidate)
    out.set(params={"ok": state.ok, "summary": state.summary()})
    if not state.ok:
        out.warn(state.summary())
    if stub:
        raise out.fail("no_device", NO_DEVICE)

    out.stage("to_device")
    reference.to(device)
    try:
        candidate.to(device)
        synchronize(device)
    except Exception as err:  # noqa: BLE001
        raise runtime_failure(out, request, err) from None
    def rebuild() -> torch.nn.Module:
        return problem.make_model(request.seed, init_inputs)

    with torch.no_grad():
        out.stage("probe")
        settings = TrialSettings(device, policy, request.seed, default_flags, candidate_flags, False, 0)
        probe = probe_reference(problem, reference, settings, request.trials)
        settings = TrialSettings(device, policy, request.seed, default_flags, candidate_flags, probe.uses_tf32,
                                 poison_reserve_for(probe), request.call_checks)
        wants64 = _wants_float64(request, policy) or (request.float64 == "auto" and probe.uses_tf32)
        reference64, where64 = _float64_reference(out, reference, rebuild, probe, device) if wants64 else (None, None)
        out.set(probe={"flops": probe.flops, "min_bytes": probe.min_bytes, "output_bytes": probe.output_bytes,
                       "uses_tf32": probe.uses_tf32, "output": probe.output, "peak_bytes": probe.peak_bytes},
                float64_reference=reference64 is not None,
                float64_device=None if where64 is None else where64.type)
        if reference64 is not None:  # a copy of the reference as constructed (float64_model copies the flags)
            constructed[id(reference64)] = constructed_modes(reference64)
        models = Models(reference, candidate, reference64, where64)

        out.stage("trials")
        results: list[dict[str, Any]] = []

        def after_trial(result: Any) -> str | None:
            results.append({**result.to_dict(), "mode": mode})
            out.set(trials=results)
            changes = snapshot.changes()
            if changes:
                return "the candidate replaced torch, timing or judge functions while running: " + ", ".join(changes)
            return None

        passed = True
        for mode in MODE_RUNS[request.mode]:
            for model in (reference, candidate, reference64):  # the float64 reference judges in the same mode
                if model is not None:
                    set_mode(model, mode, constructed[id(model)])
            try:
                trials = run_trials(problem, models, settings, request.trials, after_trial)
            except CandidateCallError as err:
                raise runtime_failure(out, request, err.error, when=_in_mode(err.when, mode, request)) from None
            out.set(trials=results)
            passed = all(t.passed for t in trials) and len(trials) == request.trials
            if not passed:
                break
        note_compiler_threads(out, threads_before)  # before the judge's own torch.compile baseline starts any
        if passed and request.robust:
            out.set(robust=robust_trials(problem, models, settings, request))
        for model in (reference, candidate, reference64):
            if model is not None:
                set_mode(model, MODE_RUNS[request.mode][0], constructed[id(model)])
        if not passed and not request.time_incorrect:
            return

        if device.type == "cuda":
            out.stage("streams")
            check_streams(out, models, problem, settings, request, libraries_before)

        out.stage("timing")
        try:
            report = run_timing(problem, models, settings, probe, timer, request.baselines, request.timing_reps,
                                request.warmup, request.input_sets, request.implausible_margin)
        except Exception as err:  # noqa: BLE001
            raise runtime_failure(out, request, err, when="timing") from None
        out.set(timing=report.to_dict())
        for warning in report.warnings:
            out.warn(warning)
        if report.patched:
            raise out.fail("tamper", "the candidate replaced torch, timing or judge functions while being timed: "
                           + ", ".join(report.patched))
        if report.threads:
            raise out.fail("threads", f"the candidate left Python thread(s) running while timed: "
                           f"{', '.join(report.threads)}")
        if report.escape:
            extra = out.data.get("streams", {}).get("extra")
            detail = f"; its kernels also ran on stream(s) {extra}" if extra else ""
            raise out.fail("timing_escape", report.escape + detail)
        if report.failure:
            raise out.fail(*report.failure)
        if report.implausible:
            raise out.fail("implausible", report.implausible + f" (verdict below {request.implausible_margin:g} x "
                           "the floor: --implausible-margin)")
    out.stage("done")


def _in_mode(when: str, mode: str, request: WorkerRequest) -> str:
    return when if request.mode == "train" else f"{when}, {MODE_LABELS[mode]} mode"


def constructed_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Each module's training flag as it is now: taken right after construction, the model as its author built it
    (torchvision's `resnet50().eval()` inside a module left in training mode, say)."""
    return [(module, module.training) for module in model.modules()]


def set_mode(model: torch.nn.Module, mode: str, constructed: list[tuple[torch.nn.Module, bool]]) -> None:
    """Mode "eval": `.eval()`; mode "train" (the models as constructed): every module's flag as recorded by
    `constructed_modes`, not `.train(True)`, which would flip eval-mode submodules (BatchNorm, Dropout) to training."""
    if mode == "eval":
        model.eval()
        return
    for module, training in constructed:
        module.training = training


def _float64_reference(out: Outcome, reference: torch.nn.Module, rebuild: Any, probe: Any, device: torch.device
                       ) -> tuple[torch.nn.Module | None, torch.device | None]:
    """The float64 reference where it fits (kernelfuse.verify.memory: the device, else the host), or none, with
    a warning in the verdict saying where it went or that the trials compare with eager only."""
    state = sum(t.numel() * t.element_size() for t in (*reference.parameters(), *reference.buffers()))
    placement = place_float64(float64_need(state, probe.peak_bytes), device)
    if placement.note:
        out.warn(placement.note)
    if placement.device is None:
        return None, None
    try:
        return float64_model(reference, rebuild, placement.device), placement.device
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.warn("the float64 reference did not fit in device memory after all: the trials compare with eager "
                 "under the policy's tolerance only")
        return None, None


def _wants_float64(request: WorkerRequest, policy: Any) -> bool:
    return request.float64 == "always" or (request.float64 == "auto" and policy.name == "strict")


def main(argv: list[str]) -> int:
    """Entry point: run, record, and leave with os._exit so stray threads or CUDA teardown cannot hang the child."""
    faulthandler.enable()
    request = WorkerRequest.load(Path(argv[1]))
    out = Outcome(request.outcome_path)
    code = 0
    try:
        run(request, out)
    except Failed:
        code = 0
    except torch.OutOfMemoryError as err:  # the judge's own copies beside the models: a verdict, not a judge bug
        out.fail("out_of_memory", **describe_error(err, request.candidate_path, request.line_offset))
    except BaseException as err:  # noqa: BLE001 - a judge bug must still produce an outcome
        info = describe_error(err, request.candidate_path, request.line_offset)
        kind = "cuda_fault" if is_cuda_fault(info["message"]) else "internal_error"
        out.fail(kind, **info)
        code = 1
    out.set(finished=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
