"""The optimizer's options and results, shared by kernelfuse.pipeline (which makes the plans) and
kernelfuse.choose (which decides on the GPU which verified variant ships); kernelfuse.pipeline re-exports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kernelfuse.compilecheck import CompileCheck
from kernelfuse.cpucheck import CpuCheck
from kernelfuse.errors import Fallback
from kernelfuse.judge import Verdict
from kernelfuse.plan import Plan
from kernelfuse.rewrite import RuleFiring


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


def fall_back(result: OptimizeResult, fallback: Fallback, log: Callable[[str], None]) -> None:
    result.fallbacks.append(fallback)
    log(f"      fallback: {fallback.describe()}")
