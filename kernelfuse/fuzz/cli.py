"""`kernelfuse fuzz`: random models through the whole pipeline, differential checks, shrunk failures on disk.

Models run in chunks: each chunk through the CPU stages (in a child process: a model that kills or hangs it is
classified, and the run goes on), then its kernels through nvcc (no GPU) or built and run
on the GPU (parallel workers); a progress line follows every chunk and a failing model is written to --out as
soon as it is found. After the run the failures are shrunk (within --shrink-time) and written again, minimal.
The last line is always `N models, M mismatches, K crashes`; the exit code is 0 only when M and K are 0.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernelfuse.errors import UsageError
from kernelfuse.fuzz.device import GpuPool, compile_all, find_nvcc
from kernelfuse.fuzz.generate import ModelSpec, render
from kernelfuse.fuzz.run import Emitted, ModelRun, Outcome
from kernelfuse.fuzz.shrink import SHRINK_BUDGET_S, shrink
from kernelfuse.fuzz.worker import Worker

CHUNK = 32  # models per CPU -> nvcc round: a progress line after each; --time acts between models too
GPU_CHUNK = 64  # per CPU -> GPU round: more models, fewer idle workers while the round's slowest build ends
CPU_TIMEOUT_S = 600.0  # one model's CPU stages (seconds, typically): past this it counts as a hang


def add_fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=100, help="models to generate (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="run seed: model i is generated from (seed, i)")
    parser.add_argument("--cpu-only", action="store_true",
                        help="CPU checks only: no nvcc compile, no GPU run even where available")
    parser.add_argument("--out", type=Path, default=Path("fuzz_failures"),
                        help="where failing problem files go (default fuzz_failures/)")
    parser.add_argument("--time", type=float, default=None, metavar="S", help="stop generating after S seconds")
    parser.add_argument("--shrink-time", type=float, default=120.0, metavar="S",
                        help="seconds spent shrinking failures after the run, in all (default 120; 0: none)")


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    unsupported: Counter = field(default_factory=Counter)
    invalid: Counter = field(default_factory=Counter)
    failures: list[tuple[ModelSpec, Outcome]] = field(default_factory=list)

    def add(self, spec: ModelSpec, outcome: Outcome) -> None:
        self.counts[outcome.status] += 1
        if outcome.status == "unsupported":
            self.unsupported[outcome.signature[1:]] += 1
        elif outcome.status == "invalid":
            self.invalid[outcome.reason[:100]] += 1
        elif outcome.failed:
            self.failures.append((spec, outcome))

    @property
    def models(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        return f"{self.models} models, {self.counts['mismatch']} mismatches, {self.counts['crash']} crashes"


def run_fuzz(args: argparse.Namespace) -> int:
    if args.count < 0:
        raise UsageError("--count must be 0 or more")
    nvcc = None if args.cpu_only else find_nvcc()
    gpu = not args.cpu_only and torch.cuda.is_available()
    print(f"kernelfuse fuzz: {args.count} models from seed {args.seed}; checks: CPU interpreter and emitted file"
          f"{', GPU build and forward' if gpu else ', nvcc compile' if nvcc else ''}", flush=True)
    checker = _Checker(Path(tempfile.mkdtemp(prefix="kernelfuse_fuzz_")), nvcc, gpu, args.out / "gpu_logs")
    tally = Tally()
    started = time.monotonic()
    deadline = None if args.time is None else started + args.time
    try:
        chunk = GPU_CHUNK if gpu else CHUNK
        for lo in range(0, args.count, chunk):
            if deadline is not None and time.monotonic() >= deadline:
                print(f"stopped after {time.monotonic() - started:.0f} s (--time {args.time:g})", flush=True)
                break
            specs = []
            for i in range(lo, min(lo + chunk, args.count)):
                spec = checker.generate(args.seed, i)
                if isinstance(spec, Outcome):  # the generator's own eager run killed the process
                    tally.add(ModelSpec(args.seed, i, "float32", False, (), (), ()), spec)
                else:
                    specs.append(spec)
            for spec, outcome in checker.run_chunk(specs, deadline):
                tally.add(spec, outcome)
                if outcome.failed:
                    path = _write_failure(args.out, spec, spec, outcome)
                    print(f"FAIL {spec.name}: {outcome.describe()} -> {path}", flush=True)
            print(f"[{time.monotonic() - started:.0f} s] {tally.line()}, {tally.counts['unsupported']} unsupported",
                  flush=True)
        _summary(tally, checker, args)
    finally:
        checker.close()
    print(tally.line(), flush=True)
    return 1 if tally.counts["mismatch"] or tally.counts["crash"] else 0


def _write_failure(out: Path, spec: ModelSpec, small: ModelSpec, outcome: Outcome) -> Path:
    """The failing model (`small`: its shrunk form) as a problem file whose docstring says the failure and how
    to reproduce it."""
    out.mkdir(parents=True, exist_ok=True)
    shrunk = small is not spec
    header = (f"\nFAILURE ({outcome.status} at {outcome.stage}): {outcome.reason}\n"
              f"Reproduce: kernelfuse fuzz --count {spec.index + 1} --seed {spec.seed} (model {spec.index})"
              + (f"; shrunk from {len(spec.ops)} to {len(small.ops)} ops." if shrunk else "."))
    path = out / f"{spec.name}_{outcome.status}{'_min' if shrunk else ''}.py"
    path.write_text(render(small, header.replace('"""', "'''").replace("\\", "/")))
    return path


class _Checker:
    """Runs specs through every check this machine can do; also the shrinker's oracle."""

    def __init__(self, workdir: Path, nvcc: str | None, gpu: bool, logs: Path | None = None) -> None:
        self.workdir, self.gpu = workdir, gpu
        self.nvcc = None if gpu else nvcc  # on a GPU each file is built (and so compiled) by the GPU check
        self.pool = GpuPool(logs or workdir) if gpu else None
        self.stages = Worker("kernelfuse.fuzz.cpuworker", workdir / "stages.log")

    def write(self, spec: ModelSpec) -> Path:
        path = self.workdir / f"{spec.name}.py"
        path.write_text(render(spec))
        return path

    def run_chunk(self, specs: list[ModelSpec], deadline: float | None = None) -> list[tuple[ModelSpec, Outcome]]:
        runs: list[tuple[ModelSpec, Path, ModelRun]] = []
        for spec in specs:
            if deadline is not None and time.monotonic() >= deadline:
                break
            path = self.write(spec)
            runs.append((spec, path, self.classify(path)))
        if self.nvcc:
            errors = compile_all([e.cuda for _, _, r in runs if r.outcome.status == "ok" for e in r.emitted
                                  if e.cuda], self.nvcc)
            for _, _, run in runs:
                bad = next((e for e in run.emitted if e.cuda in errors), None)
                if run.outcome.status == "ok" and bad is not None:
                    run.outcome = Outcome("mismatch", "nvcc", f"{bad.variant}: {errors[bad.cuda]}")
        if self.gpu:
            self._gpu(runs)
        return [(spec, run.outcome) for spec, _, run in runs]

    def _gpu(self, runs: list[tuple[ModelSpec, Path, ModelRun]]) -> None:
        tasks, owners = [], []
        for spec, path, run in runs:
            if run.outcome.status == "ok":
                for e in run.emitted:
                    emitted = self.workdir / f"{spec.name}_{e.variant.replace('-', '_')}_new.py"
                    emitted.write_text(e.text)
                    tasks.append((path, emitted))
                    owners.append((run, e.variant))
        for (run, variant), wrong in zip(owners, self.pool.check_all(tasks), strict=True):
            if wrong and run.outcome.status == "ok":
                run.outcome = Outcome("mismatch", "gpu", f"{variant}: {wrong}")

    def generate(self, seed: int, index: int) -> ModelSpec | Outcome:
        """Model `index` of run `seed`, drawn in the stages' child: drawing runs each op on real tensors (eager can
        kill the process there too: then the model is invalid)."""
        answer = self.stages.ask({"generate": [seed, index]}, CPU_TIMEOUT_S)
        if isinstance(answer, dict):
            return pickle.loads(base64.b64decode(answer["spec"]))  # noqa: S301 - our own child's answer
        return Outcome("invalid", "generate", f"drawing the model's ops killed the process: {answer}")

    def classify(self, path: Path) -> ModelRun:
        """`run.run_problem` in the stages' child process. Where the child dies or hangs, a fresh child runs the
        model's eager forward alone: if that dies too, eager cannot run the model (invalid); else kernelfuse's
        stages killed the process, a crash."""
        answer = self.stages.ask({"problem": str(path), "measure_layouts": self.gpu}, CPU_TIMEOUT_S)
        if isinstance(answer, dict):
            return ModelRun(Outcome(answer["status"], answer["stage"], answer["reason"]),
                            [Emitted(*e) for e in answer["emitted"]])
        probe = Worker("kernelfuse.fuzz.cpuworker", self.workdir / "eager_probe.log")
        try:
            eager = probe.ask({"eager_only": str(path)}, CPU_TIMEOUT_S)
        finally:
            probe.close()
        if eager != {"eager": "ok"}:
            why = eager if isinstance(eager, str) else eager["eager"]
            return ModelRun(Outcome("invalid", "eager", f"eager alone, in a process of its own: {why}"))
        return ModelRun(Outcome("crash", "process", f"the process running kernelfuse's stages: {answer} (log "
                                                    f"{self.stages.log})"))

    def close(self) -> None:
        self.stages.close()
        if self.pool is not None:
            self.pool.close()

    def still_fails(self, outcome: Outcome) -> Callable[[ModelSpec], bool]:
        def check(spec: ModelSpec) -> bool:
            try:
                got = self.run_chunk([spec])[0][1]
            except Exception:  # noqa: BLE001 - a candidate the fuzzer itself cannot render: not the failure
                return False
            return got.signature == outcome.signature

        return check


def _summary(tally: Tally, checker: _Checker, args: argparse.Namespace) -> None:
    if tally.unsupported:
        print(f"unsupported (clean refusals), {tally.counts['unsupported']} in all; top reasons:")
        for (stage, reason), n in tally.unsupported.most_common(8):
            print(f"  {n:5d}  {stage}: {reason}")
    if tally.invalid:
        print(f"note: {tally.counts['invalid']} generated models eager itself cannot run or repeat (not "
              "counted as failures):")
        for reason, n in tally.invalid.most_common(3):
            print(f"  {n:5d}  {reason}")
    if not tally.failures:
        return
    print(f"failures ({len(tally.failures)}), in {args.out}/:")
    shrink_until = time.monotonic() + args.shrink_time
    seen: dict[tuple[str, str, str], str] = {}
    for spec, outcome in tally.failures:
        if outcome.signature in seen:
            print(f"  {spec.name}: {outcome.describe()[:150]} (as {seen[outcome.signature]})")
            continue
        seen[outcome.signature] = spec.name
        left = shrink_until - time.monotonic()
        small = shrink(spec, checker.still_fails(outcome), min(left, SHRINK_BUDGET_S)) if left > 0 else spec
        path = _write_failure(args.out, spec, small, outcome) if small != spec else None
        print(f"  {spec.name}: {outcome.describe()[:150]}" + (f" -> shrunk: {path}" if path else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelfuse fuzz")
    add_fuzz_arguments(parser)
    return run_fuzz(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
