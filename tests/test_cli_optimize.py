"""The command line: help texts, and `optimize` on the CPU (writes the file, says GPU verification did not run)."""

from __future__ import annotations

import ast

import pytest
from optimizer_helpers import EXAMPLES, run_kernelfuse, shrunk_example, write_problem

from kernelfuse.cli import build_parser, main


@pytest.mark.parametrize("args, needles", [
    (["--help"], ["optimize", "eval", "exit codes"]),
    (["optimize", "--help"], ["--output", "--precision", "--cpu-only", "--trials", "3 forward could not be traced"]),
    (["eval", "--help"], ["usage: kernelfuse eval"]),
])
def test_help_exits_0(args, needles):
    result = run_kernelfuse(*args)
    assert result.returncode == 0, result.stderr
    for needle in needles:
        assert needle in result.stdout


def test_optimize_without_gpu_writes_file(tmp_path):
    problem = shrunk_example("gemm_sigmoid_scaling_residualadd", tmp_path)
    out = tmp_path / "new.py"
    result = run_kernelfuse("optimize", str(problem), "-o", str(out), "--cpu-only")
    assert result.returncode == 0, result.stderr
    assert out.is_file()
    ast.parse(out.read_text())
    assert "class ModelNew" in out.read_text()
    assert "GPU build, verification and benchmark did NOT run" in result.stdout
    assert "fused k0: addmm -> sigmoid -> mul -> add" in result.stdout
    assert "CPU interpreter check (fused): ok" in result.stdout


def test_optimize_in_process_reports_cpu_only(tmp_path, capsys):
    problem = shrunk_example("conv2d_relu_biasadd", tmp_path)
    out = tmp_path / "conv_new.py"
    assert main(["optimize", str(problem), "-o", str(out), "--cpu-only"]) == 0
    printed = capsys.readouterr().out
    assert "CPU interpreter check (fused-nhwc): ok" in printed
    assert "CPU interpreter check (fused-nchw): ok" in printed
    assert "did NOT run" in printed
    assert "ext.to_channels_last(" in out.read_text()  # the first variant (nhwc) is written without a GPU


def test_optimize_with_nothing_to_fuse_ships_unfused(tmp_path, capsys):
    problem = write_problem(tmp_path, "mm_only", """
        def forward(self, a, b):
            return torch.mm(a, b)
        """, "[torch.rand(4, 8), torch.rand(8, 4)]")
    out = tmp_path / "new.py"
    assert main(["optimize", str(problem), "-o", str(out), "--cpu-only"]) == 0
    text = out.read_text()
    assert "unfused (the original ops)" in text and "CUDA_SRC" not in text
    assert "unfused: mm.default (library call, nothing to fuse behind it)" in capsys.readouterr().out


def test_bad_trials_is_an_error(tmp_path, capsys):
    problem = shrunk_example("gemm_add_relu", tmp_path)
    assert main(["optimize", str(problem), "-o", str(tmp_path / "x.py"), "--trials", "0"]) == 2
    assert "--trials must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "x.py").exists()


def test_parser_defaults():
    args = build_parser().parse_args(["optimize", "p.py", "-o", "o.py"])
    assert (args.precision, args.trials, args.cpu_only, args.no_compile_baseline) == ("strict", 5, False, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["optimize", "p.py"])  # -o is required


def test_max_fusions_caps_the_plan(tmp_path):
    out = tmp_path / "capped.py"
    result = run_kernelfuse("optimize", str(EXAMPLES / "gemm_sigmoid_scaling_residualadd.py"), "-o", str(out),
                            "--cpu-only", "--max-fusions", "0")
    assert result.returncode == 0, result.stderr
    assert "fused k0" not in result.stdout and "generated k" not in result.stdout
    bad = run_kernelfuse("optimize", str(EXAMPLES / "gemm_add_relu.py"), "-o", str(out), "--max-fusions", "-1")
    assert bad.returncode == 2 and "--max-fusions must be 0 or more" in bad.stderr
