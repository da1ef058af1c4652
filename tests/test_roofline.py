"""The roofline view of bench records (kernelfuse.suite.roofline): ratios over the floor, the level-1 criterion,
the markdown table and the plot the HTML report embeds."""

from __future__ import annotations

import pytest

from kernelfuse.suite.roofline import meets_criterion, over_floor, roofline_figure, roofline_table


def _record(name: str, ours: float, eager: float, compiled: float, floor: float | None, correct: bool = True) -> dict:
    return {"problem_name": name, "key": f"level1/{name}", "level": 1, "problem_id": int(name.split("_")[0]),
            "runtime_ms": ours, "eager_ms": eager, "compile_ms": compiled, "floor_ms": floor, "correctness": correct,
            "speedup_eager": eager / ours, "speedup_compile": compiled / ours, "shipped": "fused", "status": "ok"}


RECORDS = [
    _record("90_cumprod", 3.0, 4.7, 3.5, 2.9),      # 1.03x floor: met
    _record("42_pool", 4.4, 10.9, 4.6, 1.46),       # 3x floor, but faster than both: met
    _record("24_logsoftmax", 8.7, 8.7, 6.9, 4.4),   # 2x floor, slower than compile: missed
    _record("38_l1", 1.0, 1.0, 1.0, None),          # no floor: not met, no ratio
    _record("52_argmin", 1.0, 1.0, 1.0, 1.0, correct=False),
]


def test_ratios_and_criterion() -> None:
    assert over_floor(RECORDS[0], "runtime_ms") == pytest.approx(3.0 / 2.9)
    assert over_floor(RECORDS[3], "runtime_ms") is None
    assert [meets_criterion(r) for r in RECORDS] == [True, True, False, False, False]


def test_table_lists_every_problem_in_id_order_with_the_count_met() -> None:
    table = roofline_table(RECORDS)
    names = [line.split(" | ")[0].strip("| ") for line in table.splitlines()[2:7]]
    assert names == ["24_logsoftmax", "38_l1", "42_pool", "52_argmin", "90_cumprod"]
    assert "| 1.98 | 1.98 | 1.57 |" in table and "**missed**" in table
    assert table.endswith("2 of 5 within 1.25x of the floor or faster than both baselines")


def test_figure_draws_three_bars_per_timed_correct_problem() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = roofline_figure(RECORDS)
    assert len(fig.axes[0].patches) == 3 * 3  # ours, eager, compile for 90, 42 and 24
