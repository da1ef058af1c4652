"""`kernelfuse bench` on a GPU: the bundled examples optimized and judged, candidates judged, the build phase
warming the caches, several GPUs (where present) and Ray giving the same verdicts, and the emitted loader building
for the GPU at hand only.

    PYTHONPATH=. python -m pytest -m gpu tests/test_suite_gpu.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from judge_support import EXAMPLES, REPO
from suite_support import EXPECTED_STATUS, candidates_folder, kernelbench_tree

from kernelfuse.capture import capture
from kernelfuse.cli import main
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite
from kernelfuse.suite.records import read_records

pytestmark = pytest.mark.gpu
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))


def test_bench_optimizes_the_examples_and_reports(tmp_path: Path) -> None:
    jsonl, report = tmp_path / "ex.jsonl", tmp_path / "ex.html"
    args = ["bench", *map(str, EXAMPLE_FILES), "--jsonl", str(jsonl), "--timeout", "600"]
    if _has_matplotlib():
        args += ["--report", str(report)]
    assert main(args) == 0
    records = read_records(jsonl)
    assert sorted(r["key"] for r in records) == sorted(p.stem for p in EXAMPLE_FILES)
    for r in records:
        assert r["status"] == "ok" and r["correctness"] is True, (r["key"], r.get("reason"))
        assert r["runtime"] > 0 and r["ref_runtime"] > 0 and r["speedup_eager"] > 0 and r["compile_ms"] > 0
        assert r["worker"].startswith("gpu") and r["build_phase"]["prebuilt"] >= 1
        assert Path(r["output"]).is_file()
    if _has_matplotlib():
        assert report.read_text().count("data:image/png;base64,") == 5  # distribution, 2 bar charts, floor, roofline


def test_bench_judges_candidates_on_the_gpu(tmp_path: Path) -> None:
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "c")
    jsonl = tmp_path / "c.jsonl"
    assert main(["bench", str(root), "--candidates", str(cands), "--jsonl", str(jsonl), "--baselines", "eager",
                 "--timeout", "300"]) == 0
    records = {r["key"]: r for r in read_records(jsonl)}
    assert {k: r["status"] for k, r in records.items()} == EXPECTED_STATUS
    good = records["level1/1_TinyGemmA"]
    assert good["device"] not in ("cpu", "unknown") and good["runtime"] > 0 and good["worker"].startswith("gpu")


def test_all_gpus_give_the_same_verdicts(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "c")
    jsonl = tmp_path / "all.jsonl"
    assert main(["bench", str(root), "--candidates", str(cands), "--jsonl", str(jsonl), "--gpus", "all",
                 "--baselines", "eager"]) == 0
    records = read_records(jsonl)
    assert {r["key"]: r["status"] for r in records} == EXPECTED_STATUS
    assert len({r["worker"] for r in records if r["status"] != "no_candidate"}) >= 2


def test_ray_on_one_gpu_machine_gives_the_same_records(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is optional: pip install 'kernelfuse[ray]'")
    root, cands = kernelbench_tree(tmp_path / "kb"), candidates_folder(tmp_path / "c")
    jsonl = tmp_path / "ray.jsonl"
    assert main(["bench", str(root), "--candidates", str(cands), "--jsonl", str(jsonl), "--ray",
                 "--baselines", "eager"]) == 0
    records = read_records(jsonl)
    assert {r["key"]: r["status"] for r in records} == EXPECTED_STATUS


def test_emitted_loader_builds_for_this_gpu_only_and_restores_the_arch_list(tmp_path: Path) -> None:
    # the fused plan's file as emitted (what ships depends on a ~1% timing margin; the loader does not)
    problem = load_problem(EXAMPLES / "gemm_add_relu.py")
    plan = plan_variants(rewrite(capture(problem)))[0]
    out = tmp_path / "gemm_new.py"
    out.write_text(emit_file(problem, plan, "loader test"))
    assert "CUDA_SRC" in out.read_text()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "TORCH_CUDA_ARCH_LIST": "7.0;8.0;9.0+PTX",
           "PYTHONPATH": str(REPO)}
    code = ("import os, runpy, sys; g = runpy.run_path(sys.argv[1]); g['_extension'](); "
            "print(os.environ['TORCH_CUDA_ARCH_LIST'])")
    done = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "7.0;8.0;9.0+PTX"  # the user's setting is back
    (ninja,) = (tmp_path / "ext").glob("*/build.ninja")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")  # Hopper: sm_90a, for the wgmma GEMM
    assert re.findall(r"-gencode=arch=compute_(\w+),code=sm_\w+", ninja.read_text()) == [arch]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
