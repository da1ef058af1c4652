"""The HTML report: one self-contained file with the summary, three embedded plots and a row per problem."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from kernelfuse.suite.report import render_report, write_report
from kernelfuse.suite.summary import summarize_records

pytest.importorskip("matplotlib", reason="the report needs matplotlib: pip install 'kernelfuse[report]'")


def _records() -> list[dict]:
    recs = []
    for i in range(12):
        ok = i % 4 != 3
        recs.append({"key": f"level{1 + i % 2}/{i}_Problem", "level": 1 + i % 2, "problem_id": i,
                     "status": "ok" if ok else "not_built", "correctness": ok, "device": "NVIDIA H100",
                     "precision": "strict", "speedup_eager": 0.6 + 0.25 * i if ok else None,
                     "speedup_compile": 0.5 + 0.2 * i if ok else None, "runtime_ms": 1.0 + i, "eager_ms": 2.0 + i,
                     "compile_ms": 1.5 + i, "floor_ms": 0.2 + 0.1 * i, "build_cause": None if ok else "nvcc",
                     "reason": None if ok else "<b>bad</b> & worse"})
    return recs


def test_report_is_self_contained_with_plots_summary_and_every_problem(tmp_path: Path) -> None:
    records = _records()
    path = tmp_path / "r" / "report.html"
    write_report(records, summarize_records(records), path)
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(images) == 4 and all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    assert not re.search(r"(src|href)=['\"](?!data:)", text) and "<script" not in text  # nothing to fetch or run
    for anchor in ("summary", "distribution", "per-problem", "floor", "problems"):
        assert f"id='{anchor}'" in text
    summary = text.split("class='summary'>")[1].split("</table>")[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row)[:3] for row in summary.split("<tr>")[2:]]
    assert rows == [["level1", "6", "6"], ["level2", "6", "3"], ["all", "12", "9"]]
    problems = text.split("class='problems'>")[1].split("</table>")[0]
    assert problems.count("<tr") == 1 + len(records) and problems.count("class='fail'") == 3
    assert "&lt;b&gt;bad&lt;/b&gt; &amp; worse" in text and "<b>bad</b>" not in text
    assert "not_built (nvcc)" in text and "NVIDIA H100" in text


def test_report_without_timings_still_renders() -> None:
    records = [{"key": "x", "level": None, "status": "not_verified", "correctness": False, "reason": "no GPU"}]
    text = render_report(records, summarize_records(records))
    assert text.count("data:image/png;base64,") == 4 and "not_verified" in text
