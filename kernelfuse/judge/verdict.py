"""The verdict: everything the judge found, as a frozen dataclass, JSON (with KernelBench's record fields) and a
readable table. Exit codes live here so the CLI and the docs agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kernelfuse.verify import POLICIES, SLACK_FACTOR, SLACK_REL

EXIT_OK = 0  # built and correct
EXIT_INCORRECT = 1  # built, but wrong, crashed, hung or rejected by an exploit defence while running
EXIT_USAGE = 2  # bad command line or unusable problem file
EXIT_NOT_BUILT = 3  # no code, syntax/import error, extension build failure, constructor failure
EXIT_NO_DEVICE = 4  # no CUDA device: parsed, imported and checked statically only

STATUS_EXIT = {
    "ok": EXIT_OK, "incorrect": EXIT_INCORRECT, "rejected": EXIT_INCORRECT, "runtime_error": EXIT_INCORRECT,
    "cuda_fault": EXIT_INCORRECT, "crashed": EXIT_INCORRECT, "timeout": EXIT_INCORRECT,
    "internal_error": EXIT_INCORRECT, "not_built": EXIT_NOT_BUILT, "no_device": EXIT_NO_DEVICE,
    "implausible": EXIT_INCORRECT,
}
ROBUST_NOTE = "correct only on the problem's input distribution"
BASELINE_LABELS = {"eager": "eager", "compile": "torch.compile", "compile-ro": "compile r-o",
                   "compile-max": "compile max-at"}


@dataclass(frozen=True)
class Verdict:
    """The judge's answer about one candidate for one problem (times in ms, build in seconds)."""

    problem: str
    candidate: str
    code_from: str
    precision: str
    status: str
    built: bool
    correct: bool
    reason: str | None = None
    defence: str | None = None
    build_s: float | None = None
    build_cause: str | None = None
    build_errors: tuple[str, ...] = ()
    trials: int = 0
    trials_run: int = 0
    trials_passed: int = 0
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    err64_ours: float | None = None
    err64_eager: float | None = None
    err64_base: float | None = None
    uses_tf32: bool | None = None
    params_match: bool | None = None
    runtime_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    ours_stats: dict[str, float] | None = None
    eager_stats: dict[str, float] | None = None
    compile_stats: dict[str, float] | None = None
    compile_s: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    floor_ms: float | None = None
    anchor_ms: float | None = None  # the forward's convolutions and matrix products timed alone, summed
    anchor_calls: list[dict[str, Any]] | None = None  # each distinct anchor call: op and shapes, count, ms
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # per baseline: ms, stats, speedup, compile_s
    custom_kernel_share: float | None = None  # of the forward's GPU time, in kernels the candidate built (GPU only)
    kernels: dict[str, Any] | None = None  # the kernel accounting behind it (kernelfuse.judge.accounting)
    signals: tuple[dict[str, Any], ...] = ()  # static bypass signals (kernelfuse.judge.bypass)
    float64_rule: dict[str, Any] | None = None  # the worst trial's numbers of the float64 rule (bound, ratio...)
    input_sets: int | None = None
    checked_timed_calls: int | None = None
    mode: str = "train"
    robust: bool | None = None
    robust_failures: tuple[str, ...] = ()
    device: str = "unknown"
    torch_version: str = ""
    warnings: tuple[str, ...] = ()
    log_tail: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 correct; 1 built but not correct; 3 not built; 4 no CUDA device (2 is the CLI's usage error)."""
        return STATUS_EXIT.get(self.status, EXIT_INCORRECT)

    def to_json(self) -> dict[str, Any]:
        """All fields plus KernelBench's record fields (compiled, correctness, runtime, ref_runtime, metadata)."""
        data = asdict(self)
        data["build_errors"] = list(self.build_errors)
        data["warnings"] = list(self.warnings)
        data["robust_failures"] = list(self.robust_failures)
        data["signals"] = list(self.signals)
        data["exit_code"] = self.exit_code
        data = _finite(data)
        data.update(self._kernelbench())
        return data

    def _kernelbench(self) -> dict[str, Any]:
        trials = self.details.get("trials", [])
        metadata: dict[str, Any] = {
            "hardware": self.device,
            "device": self.details.get("device_type", "unknown"),
            "correctness_trials": f"({self.trials_passed} / {self.trials})",
            "precision": self.precision,
            "kernelfuse_status": self.status,
        }
        if trials:
            metadata["max_difference"] = [_fmt(t.get("max_abs")) for t in trials]
            metadata["avg_difference"] = [_fmt(t.get("mean_abs")) for t in trials]
        if not self.built and self.status != "no_device":
            metadata["compilation_error"] = self.reason
        elif self.status in ("runtime_error", "cuda_fault", "crashed", "timeout", "internal_error"):
            metadata["runtime_error"] = self.reason
        elif not self.correct and self.reason:
            metadata["correctness_issue"] = self.reason
        if self.status == "no_device":
            metadata["skipped"] = self.reason
        return {
            "compiled": self.built,
            "correctness": self.correct,
            "runtime": self.runtime_ms if self.runtime_ms is not None and self.correct else -1.0,
            "ref_runtime": self.eager_ms if self.eager_ms is not None else -1.0,
            "runtime_stats": _kb_stats(self.ours_stats),
            "ref_runtime_stats": _kb_stats(self.eager_stats),
            "metadata": metadata,
        }

    def format_table(self) -> str:
        """A readable report: what was judged, the result, errors, timings and warnings."""
        policy = POLICIES.get(self.precision)
        lines = [
            f"kernelfuse eval  {self.problem}  <-  {self.candidate}",
            f"  code        {self.code_from}",
            f"  device      {self.device}" + (f" · torch {self.torch_version}" if self.torch_version else ""),
            f"  precision   {self.precision}" + (f" ({policy.description})" if policy else ""),
            "",
            f"  result      {_headline(self)}",
        ]
        if self.reason:
            lines.append(f"  reason      {self.reason}")
        if self.build_s is not None or self.build_cause:
            build = f"{self.build_s:.1f} s" if self.build_s is not None else "-"
            exts = self.details.get("extensions") or []
            if exts:
                build += "  (" + ", ".join(_extension(e) for e in exts) + ")"
            lines.append(f"  build       {'built' if self.built else 'not built'}, {build}")
        for key_line in self.build_errors:
            lines.append(f"    | {key_line}")
        if self.trials_run:
            lines.append(f"  trials      {self.trials_passed}/{self.trials} passed"
                         + (f" ({self.trials_run} run)" if self.trials_run != self.trials else ""))
        if self.max_abs_err is not None:
            lines.append(f"  error       max abs {_num(self.max_abs_err)} · max rel {_num(self.max_rel_err)} "
                         f"(vs eager)")
        if self.err64_ours is not None:
            base = "" if self.err64_base in (None, self.err64_eager) else f", policy baseline {_num(self.err64_base)}"
            rule = self.float64_rule or {}
            bound = f"; bound {_num(rule['bound'])}, ours at {rule['ratio']:.3f} of it" if rule.get("ratio") else ""
            lines.append(f"  vs float64  ours {_num(self.err64_ours)} · eager {_num(self.err64_eager)}{base} "
                         f"(rule: ours <= {SLACK_FACTOR:g} x baseline + {SLACK_REL:g} x max|ref|{bound})")
        if self.custom_kernel_share is not None:
            k = self.kernels or {}
            lines.append(f"  kernels     custom {self.custom_kernel_share:.1%} of the forward's GPU time "
                         f"(custom {k.get('custom_ms', 0):.3f} ms · library {k.get('library_ms', 0):.3f} ms · "
                         f"compiler {k.get('compiler_ms', 0):.3f} ms)")
        for signal in self.signals:
            where = f"line {signal['line']}: " if signal.get("line") else ""
            lines.append(f"  signal      {signal['code']}: {where}{signal['message']}")
        if self.mode != "train":
            lines.append(f"  mode        {self.mode} ("
                         + (".eval() on both models)" if self.mode == "eval" else "as constructed, then .eval())"))
        if self.robust is not None:
            robust = "yes: other input distributions pass too" if self.robust else f"NO: {ROBUST_NOTE}"
            lines.append(f"  robust      {robust}")
            lines += [f"    | {f}" for f in self.robust_failures]
        if self.input_sets is not None:
            lines.append(f"  timed calls {self.input_sets} input set(s) rotated, fresh contents each call; "
                         f"{self.checked_timed_calls} checked against the reference")
        if self.uses_tf32 is not None:
            lines.append(f"  reference   {'uses TF32 (float64 comparison applies)' if self.uses_tf32 else 'true fp32'}"
                         + ("" if self.params_match is None else
                            f" · parameters {'match' if self.params_match else 'DIFFER'}"))
        timing = _timing_rows(self)
        if timing:
            lines += ["", "  version          median ms   IQR (ms)          min ms    speedup of ours"] + timing
        if self.warnings:
            lines += ["", "  warnings"] + [f"   - {w}" for w in self.warnings]
        return "\n".join(lines)


def _extension(e: dict[str, Any]) -> str:
    if e.get("stubbed"):
        return f"{e['name']}: not built"
    return f"{e['name']}: {'ok' if e['ok'] else 'FAILED'} {e['seconds']:.1f} s"


def _headline(v: Verdict) -> str:
    if v.status == "ok":
        speed = f", {v.speedup_eager:.3f}x eager" if v.speedup_eager else ""
        return f"CORRECT (built, {v.trials_passed}/{v.trials} trials{speed})"
    labels = {"incorrect": "INCORRECT", "rejected": "REJECTED", "runtime_error": "RUNTIME ERROR",
              "cuda_fault": "CUDA FAULT", "crashed": "CRASHED", "timeout": "TIMED OUT", "not_built": "NOT BUILT",
              "no_device": "NOT RUN (no CUDA device)", "internal_error": "JUDGE ERROR",
              "implausible": "IMPLAUSIBLE (faster than the physical floor)"}
    text = labels.get(v.status, v.status.upper())
    if v.defence:
        text += f"  [defence: {v.defence}]"
    return text


def _timing_rows(v: Verdict) -> list[str]:
    rows = []
    baselines = v.baselines or {  # a verdict built before the per-baseline field (eager and default compile only)
        "eager": {"stats": v.eager_stats, "ms": v.eager_ms, "speedup": v.speedup_eager},
        "compile": {"stats": v.compile_stats, "ms": v.compile_ms, "speedup": v.speedup_compile,
                    "compile_s": v.compile_s}}
    versions = [("ours (ModelNew)", v.ours_stats, v.runtime_ms, None, None)]
    versions += [(BASELINE_LABELS.get(name, name), b.get("stats"), b.get("ms"), b.get("speedup"), b.get("compile_s"))
                 for name, b in baselines.items()]
    for label, stats, ms, speed, compile_s in versions:
        if ms is None or stats is None:
            continue
        iqr = f"{stats['p25']:.3f}-{stats['p75']:.3f}"
        extra = f"{speed:.3f}x" if speed is not None else ""
        if compile_s is not None:
            extra += f"  (compile {compile_s:.1f} s)"
        rows.append(f"  {label:<16} {ms:>9.3f}   {iqr:<17} {stats['min']:>7.3f}   {extra}")
    if v.floor_ms is not None and rows:
        floor = v.details.get("floor") or {}
        rows.append(f"  {'floor estimate':<16} {v.floor_ms:>9.3f}   {floor.get('bound', '')}-bound")
    if v.anchor_ms is not None and rows:
        rows.append(f"  {'bare anchors':<16} {v.anchor_ms:>9.3f}   the library convolutions and matrix products "
                    "alone")
    return rows


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _fmt(x: Any) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


def _kb_stats(stats: dict[str, float] | None) -> dict[str, Any]:
    if not stats:
        return {}
    return {"mean": stats["mean"], "std": stats["std"], "min": stats["min"], "max": stats["max"],
            "median": stats["median"], "num_trials": stats["n"]}


def _finite(value: Any) -> Any:
    """JSON has no NaN/Inf: replace them with None (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
