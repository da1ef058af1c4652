"""Quick GPU smoke test of emitted ModelNew files: build, compare with eager (5 inputs), time both.

Usage (on the device): python benchmarks/smoke_emitted.py PROBLEM.py MODELNEW.py [PROBLEM.py MODELNEW.py ...]
The judge (`kernelfuse eval`) is the real verdict; this is a development probe with the same timing method.
"""

from __future__ import annotations

import runpy
import statistics
import sys
import time

import torch


def median_ms(fn, reps: int = 20) -> float:
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(pairs: list[str]) -> None:
    rows = []
    for problem_path, candidate_path in zip(pairs[::2], pairs[1::2]):
        problem = runpy.run_path(problem_path)
        t0 = time.perf_counter()
        cand = runpy.run_path(candidate_path)
        init = problem["get_init_inputs"]()
        torch.manual_seed(42)
        ref = problem["Model"](*init).cuda()
        torch.manual_seed(42)
        new = cand["ModelNew"](*init).cuda()
        build_s = time.perf_counter() - t0
        worst = 0.0
        with torch.no_grad():
            for trial in range(5):
                torch.manual_seed(trial)
                xs = [x.cuda() for x in problem["get_inputs"]()]
                a, b = ref(*xs), new(*xs)
                assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
                worst = max(worst, (a - b).abs().max().item())
                ok = torch.allclose(a, b, atol=1e-4, rtol=1e-4)
            eager = median_ms(lambda: ref(*xs))
            ours = median_ms(lambda: new(*xs))
        rows.append((problem_path.split("/")[-1], build_s, worst, ok, eager, ours))
        del ref, new, xs, a, b
        torch.cuda.empty_cache()
    print(f"\n{'problem':40s} {'build s':>8s} {'max err':>9s} {'ok':>3s} {'eager ms':>9s} {'ours ms':>8s} {'speedup':>8s}")
    for name, build_s, worst, ok, eager, ours in rows:
        print(f"{name:40s} {build_s:8.1f} {worst:9.2e} {'yes' if ok else 'NO':>3s} {eager:9.3f} {ours:8.3f} {eager / ours:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
