"""The HTML report: one self-contained file with the summary, embedded plots (distribution, per-problem bars over
each baseline, floor) and a row per problem; a CPU-only bench run's report shows the plans instead of empty plots."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest

from kernelfuse.suite.plan_html import size
from kernelfuse.suite.report import render_report, write_report
from kernelfuse.suite.summary import summarize_records

TINY = Path(__file__).resolve().parent / "fixtures" / "problems" / "tiny_gemm_add_relu.py"

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
    assert len(images) == 5 and all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    assert not re.search(r"(src|href)=['\"](?!data:)", text) and "<script" not in text  # nothing to fetch or run
    for anchor in ("summary", "distribution", "per-problem", "per-problem-eager", "per-problem-compile", "floor",
                   "problems"):
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
    assert "data:image/png" not in text and "No problem was timed" in text and "not_verified" in text


def test_every_baseline_gets_bars_a_column_and_a_geomean() -> None:
    records = _records()
    for i, r in enumerate(records):
        if r["correctness"]:
            r["baselines"] = {"eager": {"ms": r["eager_ms"], "speedup": r["speedup_eager"]},
                              "compile": {"ms": r["compile_ms"], "speedup": r["speedup_compile"]},
                              "compile-ro": {"ms": 1.2 + i, "speedup": 0.9 + 0.01 * i}}
            r["custom_kernel_share"] = 0.25
    summary = summarize_records(records)
    assert summary.baselines == ["eager", "compile", "compile-ro"]
    assert summary.levels[-1].geomeans["compile-ro"] == pytest.approx(
        math.exp(sum(math.log(0.9 + 0.01 * i) for i in range(12) if i % 4 != 3) / 9))
    assert "geomean/compile-ro" in summary.format_table()
    text = render_report(records, summary)
    assert "id='per-problem-compile-ro'" in text and text.count("data:image/png;base64,") == 6
    assert "geomean vs torch.compile reduce-overhead" in text and "<th>vs compile-ro</th>" in text
    assert "<td>25%</td>" in text


def test_cpu_only_bench_report_shows_the_plans(tmp_path: Path) -> None:
    from kernelfuse.cli import main

    jsonl, report = tmp_path / "b.jsonl", tmp_path / "html" / "report.html"
    assert main(["bench", str(TINY), "--cpu-only", "--jsonl", str(jsonl), "--report", str(report)]) == 0
    text = report.read_text()
    assert "data:image/png" not in text and "No problem was timed" in text
    assert "precision: strict" in text and "device: no GPU" in text
    problems = text.split("class='problems'>")[1].split("</table>")[0]
    assert "ms</th>" not in problems and "<td>-</td>" not in problems  # nothing timed: no columns of dashes
    row = problems.split("<tr")[2]
    assert ">fused<" in row and "cuBLAS" in row and "+epilogue" in row
    link = re.search(r"<a href='([^']+)'>", row).group(1)
    assert not link.startswith("/") and (report.parent / link).resolve().is_file()
    plans = text.split("id='plans'>")[1]
    assert plans.count("<details class='plan'>") == 1 and "(shipped)" in plans
    assert "mm.default, add.Tensor, relu.default" in plans
    plan = json.loads(jsonl.read_text().splitlines()[0])["plans"][0]
    assert 0 < plan["bytes_fused"] < plan["bytes_eager"]
    assert f"eager {size(plan['bytes_eager'])}, fused {size(plan['bytes_fused'])}" in plans
