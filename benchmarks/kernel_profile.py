"""Where a forward's GPU time goes, kernel by kernel: eager's and a ModelNew candidate's, side by side.

Run on the device from the repo root (the candidate is an emitted file, e.g. from `kernelfuse optimize -o`):
    PYTHONPATH=. python benchmarks/kernel_profile.py PROBLEM.py [CANDIDATE.py] [--compile] > $OUT/profile.md
--compile adds torch.compile's (default mode) table, to see what Inductor fuses that the candidate does not.
Each table lists the kernels of 10 forwards (after a warm-up) by total device time, with calls per forward.
"""

from __future__ import annotations

import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.load import load_problem

REPEATS = 10


def _table(title: str, call) -> None:  # noqa: ANN001
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
    for e in rows[:15]:
        print(f"| `{e.key[:90]}` | {e.self_device_time_total / 1000 / REPEATS:.4f} | {e.count / REPEATS:g} |")


def main(problem_path: str, candidate_path: str | None, with_compile: bool = False) -> None:
    problem = load_problem(problem_path)
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.make_inputs(0)]
    torch.manual_seed(0)
    model = problem.make_model().cuda()
    print(f"## {problem.name} on {torch.cuda.get_device_name()}")
    with torch.no_grad():
        _table("eager", lambda: model(*inputs))
        if candidate_path:
            ns = runpy.run_path(candidate_path)
            torch.manual_seed(0)
            new = ns["ModelNew"](*ns["get_init_inputs"]()).cuda()
            _table(f"candidate {candidate_path}", lambda: new(*inputs))
        if with_compile:
            compiled = torch.compile(model)
            _table("torch.compile (default mode)", lambda: compiled(*inputs))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--compile"]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    main(args[0], args[1] if len(args) == 2 else None, "--compile" in sys.argv[1:])
