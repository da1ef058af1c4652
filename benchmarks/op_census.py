"""Census: which ATen ops the KernelBench problems capture to, and which pointwise ones the op table lacks.

Captures every problem of the given levels on fake tensors (no data, no GPU) and counts node ops. An op counts as
pointwise when it is a table row, an elementwise op ATen leaves untagged (hardswish, ...), or its overload carries
`torch.Tag.pointwise`; ops marked `-` are pointwise but have no row in kernelfuse.ops.POINTWISE_BY_ATEN. Problems
that fail to capture are listed with their one-line error and skipped.

Run from the repo root:  PYTHONPATH=. python benchmarks/op_census.py [--levels 1 2 3] [--all] [--root DIR] [--timeout S]
(`--all` also lists the ops that are not pointwise). Writes nothing; redirect to a log to keep a record.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
from pathlib import Path

import torch

from kernelfuse.capture import capture
from kernelfuse.errors import KernelfuseError
from kernelfuse.load import load_problem
from kernelfuse.ops import POINTWISE_BY_ATEN

STRUCTURAL = ("input", "param", "buffer", "getitem")
# Elementwise overloads ATen does not tag pointwise (checked against torch 2.14's tags).
UNTAGGED_POINTWISE = frozenset({"hardswish.default", "log_sigmoid_forward.default", "_to_copy.default"})


def is_pointwise(op: str) -> bool:
    """True for a table row, an untagged elementwise op, or an overload ATen tags pointwise."""
    if op in POINTWISE_BY_ATEN or op in UNTAGGED_POINTWISE:
        return True
    packet, overload = op.split(".")
    return torch.Tag.pointwise in getattr(getattr(torch.ops.aten, packet), overload).tags


class CaptureTimeout(Exception):
    """A capture ran past the census's per-problem limit (a long unrolled RNN)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise CaptureTimeout("capture took too long (raise --timeout)")


def census(paths: list[Path], timeout_s: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """op -> problems using it (once per use), and problem -> capture error for those that failed."""
    uses: dict[str, list[str]] = collections.defaultdict(list)
    failed: dict[str, str] = {}
    signal.signal(signal.SIGALRM, _on_alarm)
    for path in paths:
        name = f"{path.parent.name}/{path.stem}"
        signal.alarm(timeout_s)
        try:
            graph = capture(load_problem(path))
        except (KernelfuseError, Exception) as err:  # noqa: BLE001 - a census lists every failure and goes on
            failed[name] = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            continue
        finally:
            signal.alarm(0)
        for node in graph.nodes:
            if node.op not in STRUCTURAL:
                uses[node.op].append(name)
        print(f"captured {name}", file=sys.stderr, flush=True)
    return uses, failed


def report(uses: dict[str, list[str]], failed: dict[str, str], show_all: bool) -> str:
    lines = []
    for title, keep in (("pointwise", True), ("not pointwise", False)):
        if not keep and not show_all:
            continue
        ops = sorted((op for op in uses if is_pointwise(op) == keep), key=lambda op: (-len(uses[op]), op))
        lines.append(f"== {title} ops: {len(ops)} ('-' = no row in the pointwise table)")
        for op in ops:
            problems = sorted(set(uses[op]))
            mark = "+" if op in POINTWISE_BY_ATEN else "-"
            shown = ", ".join(problems[:6]) + (f", ... ({len(problems)} problems)" if len(problems) > 6 else "")
            lines.append(f"{mark if keep else ' '} {op:40s} {len(uses[op]):5d}  {shown}")
    missing = [op for op in uses if is_pointwise(op) and op not in POINTWISE_BY_ATEN]
    lines.append(f"== pointwise ops without a row: {len(missing)}: {' '.join(sorted(missing))}")
    lines.append(f"== capture failed: {len(failed)}")
    lines += [f"  {name}: {err}" for name, err in sorted(failed.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared/kernelbench")
    parser.add_argument("--levels", nargs="+", default=["1", "2", "3"])
    parser.add_argument("--all", action="store_true", help="also list ops that are not pointwise")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per problem's capture")
    args = parser.parse_args()
    paths = sorted(p for level in args.levels for p in (args.root / f"level{level}").glob("*.py"))
    if not paths:
        sys.exit(f"no problems under {args.root}/level{{{','.join(args.levels)}}}: pass --root DIR")
    uses, failed = census(paths, args.timeout)
    print(report(uses, failed, args.all))


if __name__ == "__main__":
    main()
