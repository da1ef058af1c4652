"""Which rewrite rules fire on which problems: capture every problem of a folder (fake tensors, CPU, seconds) and
list the firings. No timing: the GPU effect of the rewrites is measured by `kernelfuse optimize` / `eval`.

    .venv/bin/python benchmarks/rewrite_table.py [FOLDER] [--out TABLE.md] [--graphs]

FOLDER defaults to ../shared/kernelbench/level2. `--graphs` also prints each rewritten graph.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from kernelfuse.capture import capture
from kernelfuse.errors import KernelfuseError
from kernelfuse.load import load_problem
from kernelfuse.rewrite import apply_rules

IGNORED = {"drop_identities", "div_by_scalar_to_mul"}  # clean-ups that change no arithmetic


def table(folder: Path, graphs: bool = False) -> str:
    rows = ["| problem | rules fired (algebraic) | clean-ups | ATen ops before -> after | what changed |",
            "|---|---|---|---|---|"]
    extra = []
    for path in sorted(folder.glob("*.py"), key=lambda p: (int(p.name.split("_")[0]), p.name)
                       if p.name.split("_")[0].isdigit() else (10**9, p.name)):
        try:
            graph = capture(load_problem(path))
        except KernelfuseError as err:
            rows.append(f"| {path.stem} | capture failed: {err} | | | |")
            continue
        result = apply_rules(graph)
        algebraic = [r for r in result.rules_fired if r not in IGNORED]
        cleanups = [r for r in result.rules_fired if r in IGNORED]
        if not result.fired:
            continue
        count = lambda g: sum(n.op not in ("input", "param", "buffer") for n in g.nodes)  # noqa: E731
        notes = "; ".join(dict.fromkeys(f.note for f in result.fired if f.rule not in IGNORED))
        rows.append(f"| {path.stem} | {', '.join(algebraic) or '-'} | {', '.join(cleanups) or '-'} | "
                    f"{count(graph)} -> {count(result.graph)} | {notes} |")
        if graphs:
            extra += [f"\n## {path.stem}\n```", str(result.graph), "```"]
    return "\n".join(rows + extra) + "\n"


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path("../shared/kernelbench/level2"))
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--graphs", action="store_true", help="print each rewritten graph")
    args = parser.parse_args()
    text = table(args.folder, args.graphs)
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
