"""Options of one evaluation, in one frozen dataclass (the CLI and the optimizer both build one)."""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.load import DEFAULT_SEED
from kernelfuse.verify import POLICIES

# torch.compile's modes as baselines: default (no CUDA graphs), reduce-overhead (CUDA graphs: the fair comparison
# for a candidate that replays its kernels from a graph) and max-autotune-no-cudagraphs (autotuned kernels; its
# compilation takes minutes per problem)
COMPILE_MODES = {"compile": None, "compile-ro": "reduce-overhead", "compile-max": "max-autotune-no-cudagraphs"}
BASELINES = ("eager", *COMPILE_MODES)
DEFAULT_BASELINES = ("eager", "compile")
BASELINES_HELP = ("comma-separated baselines to time, each side by side: eager, compile (torch.compile's default "
                  "mode), compile-ro (mode reduce-overhead: CUDA graphs), compile-max (mode "
                  "max-autotune-no-cudagraphs: autotunes for minutes per problem, best kept to a subset); default "
                  "eager,compile; '' for none")
DEVICES = ("cuda", "cpu")
FLOAT64_MODES = ("always", "auto", "never")
MODES = ("train", "eval", "both")
MIN_REPS_ADVISED = 20


def parse_baselines(text: str) -> tuple[str, ...]:
    """`eager,compile-ro` -> ("eager", "compile-ro"); ValueError naming the choices for an unknown one."""
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BASELINES]
    if unknown:
        raise ValueError(f"--baselines: unknown baseline(s) {','.join(unknown)}; choose from {','.join(BASELINES)}")
    return names


@dataclass(frozen=True)
class EvalOptions:
    """How to judge a candidate.

    trials: correctness trials, each with fresh inputs (seed + trial). precision: "strict", "tf32" or "bf16".
    timeout_s: wall-clock limit for the whole child (build, trials, timing). baselines: which of BASELINES to time
    against (eager; torch.compile in its default, reduce-overhead or max-autotune-no-cudagraphs mode); empty skips
    timing of baselines. timing_reps: timed
    calls per version (DESIGN.md: at least 20). device: "cuda" (the real judge) or "cpu" (tests and pure-torch
    candidates; no poisoning, no events). float64: "always" compare with a float64 reference, "auto" only under
    strict or where the reference uses TF32, "never". time_incorrect: also time a candidate that failed.
    input_sets: distinct input sets the timing loop rotates over (fewer where device memory is short).
    implausible_margin: a median runtime below this fraction of the floor estimate is the verdict "implausible"
    (0 turns the verdict off; below 0.8 x the floor is always a warning). mode: "train" (as constructed, the
    benchmark's way: every submodule's train/eval flag as the model was built, never `.train(True)`), "eval"
    (.eval() on both models) or "both" (correctness judged in each; timed as constructed).
    robust: extra trials on inputs of other distributions (standard normal, x100, all negative), reported in the
    verdict's `robust` field without changing `correct`. call_checks: False switches off the per-call checks added
    against timing games (timed-call comparison, input rotation, determinism, output type and aliasing, device state
    after each call) to measure what they cost: for benchmarking the judge only, never for verdicts (the verdict
    then carries a warning saying so). require_custom_kernel: a candidate that runs no kernel of its own fails
    ("no custom kernel ran"): judged by the profiler's kernel accounting on a GPU, by the static bypass signals
    where none ran.
    """

    trials: int = 5
    precision: str = "strict"
    timeout_s: float = 900.0
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    seed: int = DEFAULT_SEED
    timing_reps: int = 20
    warmup: int = 3
    device: str = "cuda"
    float64: str = "always"
    time_incorrect: bool = False
    keep_workdir: bool = False
    log_tail_lines: int = 30
    input_sets: int = 4
    implausible_margin: float = 0.5
    mode: str = "train"
    robust: bool = False
    call_checks: bool = True
    require_custom_kernel: bool = False

    def __post_init__(self) -> None:
        if self.precision not in POLICIES:
            raise ValueError(f"precision must be one of {', '.join(POLICIES)}, not {self.precision!r}")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise ValueError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.float64 not in FLOAT64_MODES:
            raise ValueError(f"float64 must be one of {', '.join(FLOAT64_MODES)}, not {self.float64!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.input_sets < 1 or not 0 <= self.implausible_margin < 1:
            raise ValueError("input_sets must be >= 1 and implausible_margin in [0, 1)")
        if self.trials < 1 or self.timing_reps < 1 or self.warmup < 0 or self.timeout_s <= 0:
            raise ValueError("trials and timing_reps must be >= 1, warmup >= 0, timeout_s > 0")
