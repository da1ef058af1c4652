"""Each convolution's NCHW and channels-last cuDNN time for a folder of problems (GPU; what the optimizer measures).

    PYTHONPATH=. python benchmarks/layout_probe.py ../shared/kernelbench/level2 [--match Conv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernelfuse.bench.layout import measure_conv_layouts
from kernelfuse.capture import build_model, capture
from kernelfuse.load import load_problem
from kernelfuse.rewrite import rewrite


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--match", default="Conv", help="only problems whose file name contains this")
    args = parser.parse_args()
    files = sorted(args.folder.glob("*.py"), key=lambda p: (int(p.name.split("_")[0]), p.name))
    print("| problem | convolution | NCHW ms | channels-last ms | choice |\n|---|---|---|---|---|")
    for path in files:
        if args.match not in path.name:
            continue
        try:
            problem = load_problem(path)
            timings = measure_conv_layouts(rewrite(capture(problem, build_model(problem))))
        except Exception as err:  # noqa: BLE001 - a probe: report and go on
            print(f"| {path.stem} | error: {type(err).__name__}: {str(err)[:80]} | | | |")
            continue
        for t in timings or []:
            print(f"| {path.stem} | {t.node} | {t.nchw_ms:.3f} | {t.nhwc_ms:.3f} | {t.choice} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
