"""fast_p per level, geometric means, failures by cause, and the progress lines."""

from __future__ import annotations

import io

import pytest

from kernelfuse.suite.progress import Progress
from kernelfuse.suite.summary import geomean, summarize_records


def _rec(key: str, level: int | None, ok: bool, eager: float | None = None, comp: float | None = None,
         status: str | None = None, cause: str | None = None) -> dict:
    return {"key": key, "level": level, "correctness": ok, "speedup_eager": eager, "speedup_compile": comp,
            "status": status or ("ok" if ok else "incorrect"), "build_cause": cause}


RECORDS = [
    _rec("a", 1, True, 0.9, 0.5), _rec("b", 1, True, 1.2, 1.0), _rec("c", 1, True, 1.6, 2.0),
    _rec("d", 1, True, 2.5, 4.0), _rec("e", 1, False),
    _rec("f", 2, True, 3.0), _rec("g", 2, False, status="not_built", cause="nvcc error"),
    _rec("h", 2, False, status="timeout"),
]


def test_fast_p_counts_all_problems_of_the_level() -> None:
    levels = {s.level: s for s in summarize_records(RECORDS).levels}
    one, two, both = levels["level1"], levels["level2"], levels["all"]
    assert (one.problems, one.correct) == (5, 4)
    assert one.fast_p == {0.0: 0.8, 1.0: 0.6, 1.5: 0.4, 2.0: 0.2}
    assert two.fast_p == pytest.approx({0.0: 1 / 3, 1.0: 1 / 3, 1.5: 1 / 3, 2.0: 1 / 3})
    assert both.problems == 8 and both.fast_p[1.0] == pytest.approx(4 / 8)
    assert one.geomean_eager == pytest.approx((0.9 * 1.2 * 1.6 * 2.5) ** 0.25)
    assert one.geomean_compile == pytest.approx((0.5 * 1.0 * 2.0 * 4.0) ** 0.25)
    assert two.geomean_compile is None and two.timed_compile == 0


def test_failures_by_cause_and_table() -> None:
    summary = summarize_records(RECORDS)
    assert summary.failures == {"incorrect": 1, "not_built (nvcc error)": 1, "timeout": 1}
    table = summary.format_table()
    assert "level1" in table and "fast_1.5" in table and "timeout 1" in table
    assert summary.to_json()["levels"][0]["fast_p"]["1.5"] == 0.4


def test_one_level_has_no_all_row_and_geomean_ignores_missing() -> None:
    assert [s.level for s in summarize_records(RECORDS[:2]).levels] == ["level1"]
    assert [s.level for s in summarize_records([_rec("x", None, True, 2.0)]).levels] == ["other"]
    assert geomean([2.0, 8.0, None, 0.0]) == pytest.approx(4.0)
    assert geomean([]) is None


def test_progress_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(3, out, live=False)
    progress.finished({**RECORDS[1], "judge_wall_s": 2.0})
    progress.finished({**RECORDS[6], "reason": "nvcc said no"})
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/3] b: ok 1.200x eager 1.000x compile [2.0 s]")
    assert lines[1].startswith("[2/3] g: not_built (nvcc said no)")
    assert (progress.verified, progress.faster, progress.failed) == (1, 1, 1)


def test_progress_live_line_redraws_with_eta() -> None:
    out = io.StringIO()
    progress = Progress(4, out, live=True)
    progress.finished(RECORDS[0])
    progress.finished(RECORDS[4])
    progress.close()
    text = out.getvalue()
    assert text.count("\r\033[K") == 2 and text.endswith("\n")
    assert "[2/4] verified 1 · faster 0 · failed 1" in text and "ETA" in text
