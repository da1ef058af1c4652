"""Problems of other sizes: copies of development problems with their batch, channel and spatial sizes redrawn.

The held-out problems are not ours to read, but what was tuned on the development split shows as a loss at sizes
it was not tuned on. This rewrites a problem file's module-level size constants (`batch_size`, `in_channels`,
`height, width = 128, 128`, ...) by factors drawn from a seed, keeping channel counts divisible by the file's
`groups` / `num_groups`, and writes the copy under a new name; run the copies with `run_suite.sh` (LIST) against
eager and torch.compile like any problem.

    python benchmarks/perturb.py OUT_DIR PROBLEM.py [PROBLEM.py ...] [--seed S]
"""

from __future__ import annotations

import argparse
import ast
import math
import random
from collections.abc import Iterator
from pathlib import Path

BATCH = {"batch_size"}
SPATIAL = {"height", "width", "depth", "length", "H", "W", "D", "seq_len", "sequence_length"}
CHANNELS = {"in_channels", "out_channels", "in_features", "out_features", "input_size", "hidden_size",
            "channels", "features", "dim"}
DIVISORS = {"groups", "num_groups"}
MAX_GROWTH = 1.3  # the copy's activations at most this many times the original's (memory, run time)


def perturb(text: str, rng: random.Random) -> tuple[str, dict[str, tuple[int, int]]]:
    """`text` with its size constants redrawn, and what changed: {name: (old, new)}."""
    tree = ast.parse(text)
    values = _constants(tree)
    divisor = math.lcm(*[v for n, v in values.items() if n in DIVISORS and v > 0] or [1])
    factors = {"batch": rng.choice([0.5, 1.0]), "spatial": rng.choice([0.75, 1.0, 1.25]),
               "channels": rng.choice([0.5, 0.75, 1.25, 1.5])}
    spatial_names = [n for n in values if n in SPATIAL]
    growth = factors["batch"] * factors["spatial"] ** len(spatial_names) * factors["channels"]
    if growth > MAX_GROWTH:
        factors["batch"] /= 2
    changed: dict[str, tuple[int, int]] = {}
    for name, old in values.items():
        kind = "batch" if name in BATCH else "spatial" if name in SPATIAL else "channels" if name in CHANNELS else None
        if kind is None or old < 2:
            continue
        new = max(1, round(old * factors[kind]))
        if kind == "channels" and divisor > 1:
            new = max(divisor, round(new / divisor) * divisor)
        if new != old:
            changed[name] = (old, new)
    return _rewrite(text, tree, {n: new for n, (_, new) in changed.items()}), changed


def _assignments(tree: ast.Module) -> Iterator[tuple[str, ast.Constant]]:
    """Module-level `name = int` and `a, b = int, int` assignments, as (name, the literal's node)."""
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = list(zip(target.elts, value.elts, strict=False)) if isinstance(target, ast.Tuple) and \
            isinstance(value, ast.Tuple) else [(target, value)]
        for t, v in pairs:
            if isinstance(t, ast.Name) and isinstance(v, ast.Constant) and type(v.value) is int:
                yield t.id, v


def _constants(tree: ast.Module) -> dict[str, int]:
    return {name: int(v.value) for name, v in _assignments(tree)}


def _rewrite(text: str, tree: ast.Module, new: dict[str, int]) -> str:
    """`text` with the module-level constants named in `new` set to their new values (the rest untouched)."""
    lines = text.splitlines(keepends=True)
    edits = [(v.lineno - 1, v.col_offset, v.end_col_offset, str(new[name])) for name, v in _assignments(tree)
             if name in new and v.lineno == v.end_lineno]
    for line, col, end, rep in sorted(edits, reverse=True):
        lines[line] = lines[line][:col] + rep + lines[line][end:]
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("problems", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.problems:
        rng = random.Random(f"{args.seed}:{path.name}")
        text, changed = perturb(path.read_text(), rng)
        if not changed:
            print(f"{path.name}: no size constant to change; skipped")
            continue
        dest = args.out / f"{path.stem}_p{args.seed}.py"
        note = ", ".join(f"{n} {a}->{b}" for n, (a, b) in changed.items())
        dest.write_text(f"# perturbed from {path.name} (seed {args.seed}): {note}\n" + text)
        print(f"{dest}: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
