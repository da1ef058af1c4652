"""Run `kernelfuse optimize --cpu-only` over every problem of a KernelBench-style folder and tabulate the outcomes.

Each problem runs in its own child process (own session, killed with its children at the time limit) under a
memory limit, at most `--jobs` at a time. One JSON line per problem goes to the log; the table of outcomes per
level (exit 0 with the CPU check ok / skipped (reason) / failed, exit 2 and why, other failures) is printed.

    python benchmarks/cpu_sweep.py ../shared/kernelbench --log benchmarks/results/cpu_sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK_LINE = re.compile(r"CPU interpreter check \([^)]*\): (ok|skipped|FAILED) — (.*)")
COMPILE_LINE = re.compile(r"nvcc compile check \([^)]*\): (ok|FAILED|not run) — (.*)")
FALLBACK_LINE = re.compile(r"fallback: (.*)")


def limit_memory(limit_bytes: int) -> None:
    """In the child: cap its private writable memory (RLIMIT_DATA: heap and anonymous mappings, which is where
    tensors live; RLIMIT_AS would also count the address space CUDA libraries reserve at import)."""
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))
    os.setsid()


def run_one(problem: Path, outdir: Path, timeout_s: float, mem_bytes: int) -> dict:
    """Optimize one problem in a child process; its peak RSS comes from wait4 (the child and the children it
    reaped), so the memory target is measured, not only enforced."""
    out = outdir / f"{problem.parent.name}_{problem.stem}_new.py"
    cmd = [sys.executable, "-m", "kernelfuse", "optimize", str(problem), "-o", str(out), "--cpu-only"]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keeps extra packages
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out_f, stderr=err_f, text=True,
                                preexec_fn=lambda: limit_memory(mem_bytes))  # noqa: PLW1509 - only resource calls
        fired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (fired.set(), os.killpg(proc.pid, signal.SIGKILL)))
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    checks = CHECK_LINE.findall(stdout)
    compiled = COMPILE_LINE.findall(stdout)
    return {
        "level": problem.parent.name, "problem": problem.name, "rc": proc.returncode, "timed_out": fired.is_set(),
        "seconds": round(time.monotonic() - started, 1), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "max_rss_mb": round(usage.ru_maxrss / 1024),
        "check": checks[0][0] if checks else None, "check_note": checks[0][1] if checks else None,
        "compile": compiled[0][0] if compiled else None, "compile_note": compiled[0][1] if compiled else None,
        "fallbacks": FALLBACK_LINE.findall(stdout),
        "nothing_to_fuse": "nothing to fuse" in stdout,
        "traceback": "Traceback (most recent call last)" in stderr,
        "error": stderr.strip().splitlines()[-1] if stderr.strip() else "",
        "stderr_lines": len(stderr.strip().splitlines()),
    }


def outcome(r: dict) -> str:
    if r["timed_out"]:
        return "timeout"
    if r["rc"] == 0:
        if r.get("fallbacks"):
            return f"exit 0, {len(r['fallbacks'])} fallback(s): " + r["fallbacks"][0][:60]
        if r.get("compile") == "FAILED":
            return "exit 0, nvcc FAILED: " + (r.get("compile_note") or "")[:60]
        nvcc = f", nvcc {r['compile']}" if r.get("compile") else ""
        if r["check"] == "ok":
            return "exit 0, check ok" + nvcc
        if r["check"] == "skipped":
            return "exit 0, check skipped: " + re.sub(r"\(.*", "", r["check_note"].removeprefix("skipped: "))[:60] \
                + nvcc
        if r["check"] == "FAILED":  # the pipeline then ships the unfused model: still a failure of the plan
            return "exit 0, check FAILED: " + r["check_note"][:60]
        if r["nothing_to_fuse"]:
            return "exit 0, nothing to fuse (original ops shipped, no check needed)"
        return f"exit 0, check {r['check']}"
    if r["traceback"]:
        return f"exit {r['rc']}, traceback"
    if r["rc"] < 0:
        return f"killed by signal {-r['rc']} (memory?)"
    return f"exit {r['rc']}"


def table(results: list[dict]) -> str:
    """Markdown: problems per outcome and level, then the slowest wall and CPU seconds and the largest peak RSS."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        counts[outcome(r)][r["level"]] += 1
    levels = sorted({r["level"] for r in results})
    lines = ["| outcome | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels)]
    lines += [f"| {name} | " + " | ".join(str(c[lv]) for lv in levels) + " |" for name, c in sorted(counts.items())]
    lines.append("| **problems** | " + " | ".join(str(sum(r["level"] == lv for r in results)) for lv in levels) + " |")
    for key, label in (("seconds", "max wall s"), ("cpu_seconds", "max CPU s"), ("max_rss_mb", "max RSS MB")):
        worst = [max((r for r in results if r["level"] == lv), key=lambda r: r.get(key, 0)) for lv in levels]
        lines.append(f"| {label} | " + " | ".join(f"{w.get(key, '?')} ({w['problem'].split('_')[0]})"
                                                    for w in worst) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", help="folder holding level1/, level2/, level3/")
    parser.add_argument("--log", type=Path, default=REPO / "benchmarks" / "results" / "cpu_sweep.jsonl")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--mem-gb", type=float, default=4.0)
    parser.add_argument("--only", default="", help="substring a problem's path must contain")
    parser.add_argument("--table", type=Path, nargs="+", metavar="JSONL",
                        help="print the table of earlier logs (a later line for the same problem wins); run nothing")
    args = parser.parse_args()
    if args.table:
        latest = {}
        for path in args.table:
            for line in path.read_text().splitlines():
                r = json.loads(line)
                latest[(r["level"], r["problem"])] = r
        print(table(list(latest.values())))
        return 0
    if args.root is None:
        parser.error("a problem folder, or --table JSONL...")
    problems = sorted(p for p in args.root.glob("level*/*.py") if args.only in str(p))
    args.log.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as outdir, args.log.open("w") as log, \
            ThreadPoolExecutor(args.jobs) as pool:
        for r in pool.map(lambda p: run_one(p, Path(outdir), args.timeout, int(args.mem_gb * 2**30)), problems):
            results.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
            print(f"{r['level']}/{r['problem']}: {outcome(r)} ({r['seconds']} s, {r['cpu_seconds']} CPU s, "
                  f"{r['max_rss_mb']} MB) {r['error'][:150]}", flush=True)
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
