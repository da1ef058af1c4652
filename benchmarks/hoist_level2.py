"""What the weight cache (kernelfuse.emit.hoist) saves on the dev split's GEMM-then-reduce problems, on the GPU.

For each problem: emit the fused plan (no judging), load its ModelNew on the GPU with the problem's seed, and time
in one process, alternating, each the median of --reps calls with L2 flushed first (kernelfuse.bench.Timer):
eager, torch.compile, ModelNew with its weight cache, and ModelNew with the weight values recomputed in every call
(the cache bypassed: the file as emitted before the cache existed). Correctness is the judge's job (`kernelfuse
eval`); here the largest difference from eager is printed. One JSON line per problem, and a table.

    PYTHONPATH=. python benchmarks/hoist_level2.py [PROBLEMS...] [--reps 20] [--out benchmarks/results/hoist.jsonl]

PROBLEMS default to level-2 problems 14, 18 and 98 of ../shared/kernelbench.
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import tempfile
from pathlib import Path

import torch

from kernelfuse.bench import Timer
from kernelfuse.capture import capture
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

LEVEL2 = Path(__file__).resolve().parents[1] / ".." / "shared" / "kernelbench" / "level2"
DEFAULT = ["14_Gemm_Divide_Sum_Scaling", "18_Matmul_Sum_Max_AvgPool_LogSumExp_LogSumExp",
           "98_Matmul_AvgPool_GELU_Scale_Max"]


def measure(path: Path, reps: int, workdir: Path, device: torch.device) -> dict:
    problem = load_problem(path)
    plan = plan_variants(rewrite(capture(problem)))[0]
    emitted = workdir / f"{problem.name}_new.py"
    emitted.write_text(emit_file(problem, plan, "benchmarks/hoist_level2.py"))
    ns = runpy.run_path(str(emitted))
    init = problem.init_inputs()
    torch.manual_seed(42)
    ref = problem.make_model(seed=42).to(device)
    torch.manual_seed(42)
    new = ns["ModelNew"](*init).to(device)
    new.load_state_dict(ref.state_dict())
    xs = [x.to(device) for x in problem.make_inputs(7)]
    compiled = torch.compile(ref)
    has_cache = hasattr(new, "_weight_values")

    def uncached():
        new._weights = new._weight_values  # the instance attribute shadows the cached method for this call
        try:
            return new(*xs)
        finally:
            del new._weights

    versions = {"eager": lambda: ref(*xs), "compile": lambda: compiled(*xs), "cached": lambda: new(*xs)}
    if has_cache:
        versions["uncached"] = uncached
    timer = Timer(device)
    samples: dict[str, list[float]] = {k: [] for k in versions}
    with torch.no_grad():
        diff = (new(*xs) - ref(*xs)).abs().max().item()
        for fn in versions.values():
            for _ in range(3):
                fn()
        for _ in range(reps):
            for name, fn in versions.items():
                sample, _ = timer.time(fn)
                samples[name].append(sample.event_ms)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    return {"problem": path.name, "variant": plan.variant, "cache": has_cache, "max_abs_diff_vs_eager": diff,
            "median_ms": ms, "speedup_compile": ms["compile"] / ms["cached"],
            "cache_gain": ms["uncached"] / ms["cached"] if has_cache else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="*", type=Path)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu for a dry run of the script (guarded files take the reference path there)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hoist_level2.jsonl"))
    args = parser.parse_args()
    paths = args.problems or [LEVEL2 / f"{name}.py" for name in DEFAULT]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as workdir, args.out.open("a") as out:
        for path in paths:
            row = measure(path, args.reps, Path(workdir), device)
            out.write(json.dumps({**row, "device": name}) + "\n")
            out.flush()
            rows.append(row)
            ms = row["median_ms"]
            print(f"{row['problem']}: eager {ms['eager']:.3f} ms, compile {ms['compile']:.3f} ms, cached "
                  f"{ms['cached']:.3f} ms, uncached {ms.get('uncached', float('nan')):.3f} ms; "
                  f"{row['speedup_compile']:.1f}x torch.compile; "
                  f"max |diff| vs eager {row['max_abs_diff_vs_eager']:.2e}",
                  flush=True)
    print("| problem | eager ms | compile ms | uncached ms | cached ms | x compile | cache gain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["median_ms"]
        gain = f"{r['cache_gain']:.1f}x" if r["cache_gain"] else "-"
        print(f"| {r['problem']} | {ms['eager']:.3f} | {ms['compile']:.3f} | {ms.get('uncached', float('nan')):.3f} "
              f"| {ms['cached']:.3f} | {r['speedup_compile']:.1f}x | {gain} |")


if __name__ == "__main__":
    main()
