"""Where a forward's GPU time goes, kernel by kernel: eager's and ModelNew candidates', side by side.

Run on the device from the repo root (a candidate is an emitted file, e.g. from `kernelfuse optimize -o`):
    PYTHONPATH=. python benchmarks/kernel_profile.py PROBLEM.py [CANDIDATE.py ...] [--compile] [--compile-ro]
        [--bf16] > $OUT/profile.md
--compile adds torch.compile's (default mode) table, to see what Inductor fuses that the candidates do not;
--compile-ro its CUDA-graph mode (reduce-overhead). --bf16 runs eager and torch.compile under CUDA autocast to
bfloat16, as the bf16 policy's baselines run (a bf16 candidate carries its own casts).
Each table lists the kernels of 10 forwards (after a warm-up) by total device time, with calls per forward.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.load import load_problem

REPEATS = 10
ROWS = 25


def _table(title: str, call: Callable[[], Any]) -> None:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            call()
        torch.cuda.synchronize()
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                  key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / 1000 / REPEATS
    print(f"\n### {title}: {median_event_ms(call):.3f} ms per forward (events), kernels {total:.3f} ms\n")
    print("| kernel | ms per forward | calls per forward |")
    print("|---|---|---|")
    for e in rows[:ROWS]:
        print(f"| `{e.key[:90]}` | {e.self_device_time_total / 1000 / REPEATS:.4f} | {e.count / REPEATS:g} |")


def main(problem_path: str, candidates: list[str], modes: list[str], bf16: bool = False) -> None:
    problem = load_problem(problem_path)
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.make_inputs(0)]
    torch.manual_seed(0)
    model = problem.make_model().cuda()

    def baseline(run: Callable[[], Any]) -> Callable[[], Any]:
        if not bf16:
            return run

        def under_autocast() -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return run()
        return under_autocast

    print(f"## {problem.name} on {torch.cuda.get_device_name()}{' (bf16 autocast baselines)' if bf16 else ''}")
    with torch.no_grad():
        _table("eager", baseline(lambda: model(*inputs)))
        for path in candidates:
            ns = runpy.run_path(path)
            torch.manual_seed(0)
            new = ns["ModelNew"](*ns["get_init_inputs"]()).cuda()
            _table(f"candidate {path}", lambda new=new: new(*inputs))
        for mode in modes:
            compiled = torch.compile(model, mode=mode)
            for _ in range(3):  # the CUDA-graph mode records over its first calls
                baseline(lambda compiled=compiled: compiled(*inputs))()
            _table(f"torch.compile (mode {mode})", baseline(lambda compiled=compiled: compiled(*inputs)))


if __name__ == "__main__":
    flags = {"--compile": "default", "--compile-ro": "reduce-overhead"}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        sys.exit(__doc__)
    main(args[0], args[1:], [mode for flag, mode in flags.items() if flag in sys.argv[1:]], "--bf16" in sys.argv[1:])
