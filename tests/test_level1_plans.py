"""Every dev level-1 problem's plan (../shared/kernelbench/level1): each op that stays a torch call carries a
decision as its reason ("library call", "library at the floor", "allocation only"...), never "no kernel yet"; the
scans and the pools are generated kernels. Skipped where the dev split is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfuse.capture import capture
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

LEVEL1 = Path(__file__).resolve().parents[1].parent / "shared" / "kernelbench" / "level1"
PROBLEMS = sorted(LEVEL1.glob("*.py")) if LEVEL1.is_dir() else []


@pytest.mark.skipif(not PROBLEMS, reason=f"the dev split is not at {LEVEL1}")
@pytest.mark.parametrize("path", PROBLEMS, ids=[p.stem for p in PROBLEMS])
def test_every_torch_call_has_a_decided_reason(path: Path) -> None:
    for plan in plan_variants(rewrite(capture(load_problem(path)))):
        undecided = [f"{s.node.op}: {s.reason}" for s in plan.unfused if "no kernel yet" in s.reason]
        assert not undecided, plan.summary()
        name = path.stem.lower()
        if "pool" in name or "cum" in name:
            assert plan.generated and not plan.unfused, plan.summary()
