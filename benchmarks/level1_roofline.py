"""All dev level-1 problems through `kernelfuse bench`, then the roofline table: ours / eager / torch.compile
against the floor estimate (kernelfuse.suite.roofline), and the HTML report with its roofline plot.

    PYTHONPATH=. python benchmarks/level1_roofline.py [--seconds 540] [--state DIR] [--out DIR] [bench args...]

Resumable like benchmarks/run_suite.sh: the bench's JSONL lives in --state (default /tmp/kernelfuse_level1); the
bench is interrupted after --seconds (under the device tool's 10-minute limit) and the next call continues it with
--resume. Every call writes what is recorded so far to --out (default out/level1): level1.jsonl, level1_roofline.md
and level1.html. The problems come from ../shared/kernelbench/level1, else .device_carry/kernelbench/level1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kernelfuse.suite.roofline import roofline_table


def _level1() -> Path:
    for root in (Path("../shared/kernelbench/level1"), Path(".device_carry/kernelbench/level1")):
        if root.is_dir():
            return root
    raise SystemExit("level1_roofline: no dev level-1 folder (../shared or .device_carry/kernelbench/level1)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=540.0, help="stop the bench after this long (resumable)")
    parser.add_argument("--state", type=Path, default=Path("/tmp/kernelfuse_level1"))
    parser.add_argument("--out", type=Path, default=Path("out/level1"))
    args, bench_args = parser.parse_known_args(argv)
    args.state.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.state / "level1.jsonl"
    cmd = [sys.executable, "-m", "kernelfuse", "bench", str(_level1()), "--jsonl", str(jsonl),
           "--out-dir", str(args.state / "modelnew"), "--report", str(args.state / "level1.html"), *bench_args]
    if jsonl.is_file() and jsonl.stat().st_size:
        cmd.append("--resume")
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "."), "PYTHONUNBUFFERED": "1"}
    bench = subprocess.Popen(cmd, env=env)
    try:
        code = bench.wait(timeout=args.seconds)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGINT)  # the suite kills its children and writes what it has
        code = bench.wait(timeout=60)
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.is_file() else []
    table = roofline_table(records)
    print(table)
    (args.out / "level1_roofline.md").write_text(table + "\n")
    for name in ("level1.jsonl", "level1.html"):
        if (args.state / name).is_file():
            shutil.copy(args.state / name, args.out / name)
    print(f"bench exit code {code}; {len(records)} of {len(list(_level1().glob('*.py')))} problems recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
