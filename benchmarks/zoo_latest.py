"""The zoo's closing table (issue 24): each model's latest record per precision policy, merged from several
`kernelfuse bench` JSONL files (later files win), with ours / eager / torch.compile (and compile-ro, torch.compile
with CUDA graphs, where it was timed) and the geometric means the issue asks for. Not one run: each row names the file
it came from, so a reader sees how old it is.

Usage: python benchmarks/zoo_latest.py RESULTS.jsonl [RESULTS.jsonl ...]   (oldest first)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def latest(paths: list[str]) -> dict[tuple[str, str], tuple[str, dict]]:
    """(model, policy) -> (file name, record) of the last record seen; zoo models only (benchmarks/zoo/)."""
    found: dict[tuple[str, str], tuple[str, dict]] = {}
    for path in paths:
        for line in open(path):
            if not line.strip():
                continue
            record = json.loads(line)
            problem = str(record.get("problem", ""))
            if "/zoo/" not in problem:
                continue
            found[(Path(problem).stem, str(record.get("precision")))] = (Path(path).name, record)
    return found


def _ms(record: dict, baseline: str) -> float | None:
    return ((record.get("baselines") or {}).get(baseline) or {}).get("ms")


def table(found: dict[tuple[str, str], tuple[str, dict]], policy: str) -> list[str]:
    rows = sorted((model, name, r) for (model, pol), (name, r) in found.items() if pol == policy)
    lines = [f"### {policy}", "",
             "| model | shipped | ours ms | eager ms | compile ms | compile-ro ms | vs eager | vs compile | "
             "vs compile-ro | correct | record |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {"eager": [], "compile": [], "compile-ro": []}
    for model, name, r in rows:
        ours = r.get("runtime_ms")
        cells = []
        for baseline in ratios:
            ms = _ms(r, baseline)
            cells.append(f"{ms:.3f}" if ms else "-")
            if ms and ours:
                ratios[baseline].append(ms / ours)
        speed = [f"{_ms(r, b) / ours:.3f}x" if ours and _ms(r, b) else "-" for b in ratios]
        lines.append(f"| {model} | {r.get('shipped')} | {ours:.3f} | " + " | ".join(cells) + " | " + " | ".join(speed)
                     + f" | {r.get('correct')} | {name} |" if ours else f"| {model} | {r.get('status')} | - |")
    lines.append("")
    means = [f"{b} {math.exp(sum(map(math.log, v)) / len(v)):.3f}x over {len(v)}" for b, v in ratios.items() if v]
    slowest = min(ratios["eager"], default=float("nan"))
    lines.append(f"{len(rows)} models, {sum(bool(r.get('correct')) for _, _, r in rows)} correct; geometric mean "
                 + ", ".join(means) + f"; slowest vs eager {slowest:.3f}x")
    return lines


def main(paths: list[str]) -> None:
    found = latest(paths)
    for policy in sorted({pol for _, pol in found}):
        print("\n".join(table(found, policy)), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
