"""A stage that raises on part of the model is a fallback, never an internal error: that part ships as the
original ops, the rest stays fused, the reason is printed and listed in --json, and the run exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_pipeline_choice import _run, _verdict, without_gemm_twins

import kernelfuse.choose as choose
import kernelfuse.codegen.cuda as cuda
import kernelfuse.codegen.dryrun as dryrun
import kernelfuse.pipeline as pipeline
import kernelfuse.plan.schedule as schedule
import kernelfuse.rewrite.rules as rules
from kernelfuse.cli import main
from kernelfuse.compilecheck import CompileCheck, check_files, cuda_source_of, find_nvcc, first_error
from kernelfuse.errors import Fallback
from kernelfuse.plan.fuse import KEPT_REASON

PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return torch.softmax(y, dim=1) * 2.0 + torch.sigmoid(x).sum()


def get_inputs():
    return [torch.rand(8, 16)]


def get_init_inputs():
    return []
'''


@pytest.fixture
def problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the nvcc results of this test only
    without_gemm_twins(monkeypatch)  # one plan to fall back from: no 3xTF32-GEMM twin of the Linear's
    path = tmp_path / "softmax_mlp.py"
    path.write_text(PROBLEM)
    return path


def optimize(problem: Path, capsys: pytest.CaptureFixture) -> tuple[int, dict, str, Path]:
    out, report = problem.with_name("out.py"), problem.with_name("report.json")
    code = main(["optimize", str(problem), "-o", str(out), "--cpu-only", "--json", str(report)])
    stdout, stderr = capsys.readouterr()
    assert "internal error" not in stderr, stderr
    return code, json.loads(report.read_text()), stdout, out


def is_softmax(step: object) -> bool:
    return any(name.startswith("_softmax") for name in getattr(step, "replaces", ()))


def test_codegen_failure_keeps_that_kernel_as_torch_calls(problem, capsys, monkeypatch):
    render = cuda.render_generated

    def failing(plan, gen):
        if is_softmax(gen):
            raise AssertionError  # no message: the report still names the exception
        return render(plan, gen)

    monkeypatch.setattr(cuda, "render_generated", failing)
    code, report, stdout, out = optimize(problem, capsys)
    assert code == 0
    [fallback] = report["fallbacks"]
    assert fallback["stage"] == "codegen" and fallback["reason"] == "AssertionError"
    assert "_softmax" in fallback["what"]
    [plan] = report["plans"]
    assert any(u["aten_op"].startswith("_softmax") and u["reason"] == KEPT_REASON for u in plan["unfused"])
    assert plan["kernels"], "the other kernels stay fused"
    assert all(not any(op.startswith("_softmax") for op in k["aten_ops"]) for k in plan["kernels"])
    assert "fallback: codegen" in stdout
    assert report["shipped"] == "fused" and "CUDA_SRC" in out.read_text()


def test_planner_failure_on_one_node_replans_without_it(problem, capsys, monkeypatch):
    reduction = schedule._reduction_kernel

    def failing(graph, node, *args, **kwargs):
        if node.op.startswith("_softmax"):
            raise KeyError(node.name)
        return reduction(graph, node, *args, **kwargs)

    monkeypatch.setattr(schedule, "_reduction_kernel", failing)
    code, report, _, _ = optimize(problem, capsys)
    assert code == 0
    [fallback] = report["fallbacks"]
    assert fallback["stage"] == "plan" and fallback["reason"].startswith("KeyError")
    unfused = report["plans"][0]["unfused"]
    assert [u["reason"] for u in unfused if u["aten_op"].startswith("_softmax")] == [KEPT_REASON]
    assert report["plans"][0]["kernels"]


def test_failure_with_nothing_to_blame_ships_the_original_ops(problem, capsys, monkeypatch):
    def failing(plan):
        raise RuntimeError("generator broke")

    monkeypatch.setattr(choose, "generate", failing)
    monkeypatch.setattr(dryrun, "generate", failing)  # the generator behind the render's dry run
    code, report, stdout, out = optimize(problem, capsys)
    assert code == 0
    assert report["shipped"] == "unfused"
    assert report["fallbacks"] == [{"stage": "codegen", "what": "variant fused",
                                    "reason": "RuntimeError: generator broke"}]
    assert "CUDA_SRC" not in out.read_text() and "class ModelNew" in out.read_text()


def test_failing_rewrite_rule_is_skipped_and_the_others_apply(problem, capsys, monkeypatch):
    def broken(graph):
        raise IndexError("rule bug")

    victim = rules.RULES[0]
    monkeypatch.setattr(rules, "RULES", (rules.Rule(victim.name, broken, victim.doc), *rules.RULES[1:]))
    code, report, _, _ = optimize(problem, capsys)
    assert code == 0
    assert report["fallbacks"] == [{"stage": "rewrite", "what": victim.name, "reason": "IndexError: rule bug"}]
    assert report["shipped"] == "fused"


def test_capture_bug_ships_the_original_module(problem, capsys, monkeypatch):
    def failing(problem, model):
        raise AssertionError

    monkeypatch.setattr(pipeline, "capture", failing)
    code, report, _, out = optimize(problem, capsys)
    assert code == 0
    assert report["shipped"] == "unfused" and report["plans"] == []
    assert report["fallbacks"][0]["stage"] == "capture"
    assert "class ModelNew" in out.read_text()


def test_a_file_that_does_not_compile_is_not_shipped(problem, capsys, monkeypatch):
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    generate = choose.generate

    def broken(plan):
        sources = generate(plan)
        return type(sources)(sources.cuda + "\n#error injected by the test\n", sources.binding, sources.functions)

    monkeypatch.setattr(choose, "generate", broken)
    code, report, stdout, out = optimize(problem, capsys)
    assert code == 0
    assert report["shipped"] == "unfused" and "CUDA_SRC" not in out.read_text()
    [check] = report["compile_checks"]
    assert check["status"] == "FAILED" and "injected by the test" in check["note"]
    assert report["fallbacks"] == [{"stage": "compile", "what": "variant fused", "reason": check["note"]}]


def test_without_nvcc_the_report_says_the_compile_check_did_not_run(problem, capsys, monkeypatch):
    monkeypatch.setattr("kernelfuse.compilecheck.find_nvcc", lambda: None)
    code, report, stdout, out = optimize(problem, capsys)
    assert code == 0 and report["shipped"] == "fused"
    assert report["compile_checks"][0]["status"] == "not run"
    assert "compile check did NOT run" in stdout


def test_compile_results_are_cached_by_source(tmp_path, monkeypatch):
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = 'CUDA_SRC = r"""\n__global__ void k1() {}\n__global__ void k1() {}\n"""\n'
    first = check_files({"a": text, "b": "no kernels here"})
    assert first["a"].status == "FAILED" and "k1" in first["a"].note
    assert first["b"] == CompileCheck("b", "not run", "no custom kernel to compile")
    assert len(list((tmp_path / "kernelfuse" / "nvcc").iterdir())) == 1
    monkeypatch.setattr("kernelfuse.compilecheck.subprocess.run", None)  # a second compile would now raise
    assert check_files({"a": text}, nvcc=find_nvcc())["a"] == first["a"]


def test_first_error_line_and_source_extraction():
    out = "kernels.cu(3): warning: unused\n/tmp/kernelfuse_nvcc_x/kernels.cu(4): error: redefinition of k1\n"
    assert first_error(out, 2) == "kernels.cu(4): error: redefinition of k1"
    assert cuda_source_of('x = 1\nCUDA_SRC = r"""\nint a;\n"""\n') == "int a;\n"


def test_gpu_path_ships_the_very_file_it_judged(monkeypatch, tmp_path):
    judged_texts: dict[str, str] = {}
    script = {"fused-nhwc": _verdict(True, 1.7), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}

    def remember() -> None:
        evaluate = choose.evaluate

        def seen(problem_path, candidate, options):
            judged_texts.setdefault(candidate.name, candidate.read_text())
            return evaluate(problem_path, candidate, options)

        monkeypatch.setattr(choose, "evaluate", seen)

    result, text, _ = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script, patch=remember)
    assert result.shipped == "fused-nhwc"
    [first] = [t for name, t in judged_texts.items() if name.endswith("_fused-nhwc.py")]
    assert text == first.replace("variant under evaluation: fused-nhwc",
                                 "verified on scripted GPU: variant fused-nhwc, strict precision")


def test_layout_timing_that_raises_is_a_fallback(monkeypatch, tmp_path):
    def broken(graph, strict):
        raise ZeroDivisionError("no samples")

    script = {"fused-nhwc": _verdict(True, 1.7), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}
    result, _, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                             patch=lambda: monkeypatch.setattr(pipeline, "measure_conv_layouts", broken))
    assert result.fallbacks == [Fallback("plan", "the convolution layout timing", "ZeroDivisionError: no samples")]
    assert result.shipped == "fused-nhwc" and judged[:2] == ["fused-nhwc", "fused-nchw"]


def test_python_api_returns_the_model_when_capture_fails(monkeypatch):
    import kernelfuse.api as api

    def failing(model, inputs, **options):
        raise AssertionError

    monkeypatch.setattr(api, "capture_module", failing)
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="could not be captured .AssertionError."):
        assert api.optimize(model, [torch.rand(2, 4)]) is model


def test_nvcc_that_cannot_start_is_no_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = 'CUDA_SRC = r"""\n__global__ void k0() {}\n"""\n'
    check = check_files({"a": text}, nvcc=str(tmp_path / "no-such-nvcc"))["a"]
    assert check.status == "not run" and check.ok and "did NOT run" in check.note
