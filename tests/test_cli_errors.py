"""User errors on the command line: one line with the cause and the fix, exit code 2, before any work starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from optimizer_helpers import run_kernelfuse, write_problem

from kernelfuse import __version__
from kernelfuse.cli import main
from kernelfuse.report import SCHEMA_VERSION

FIXTURES = Path(__file__).parent / "fixtures" / "problems"
PROBLEM = FIXTURES / "tiny_gemm_add_relu.py"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2, err
    assert "[1/5]" not in out, "the error must be found before any stage runs"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernelfuse: error: "), err
    for w in words:
        assert w in lines[0], lines[0]


def test_output_is_a_directory(capsys, tmp_path):
    assert_usage_error(*run(capsys, "optimize", str(PROBLEM), "-o", str(tmp_path), "--cpu-only"), "is a directory")


def test_output_under_a_file(capsys, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    code, out, err = run(capsys, "optimize", str(PROBLEM), "-o", str(blocker / "sub" / "out.py"), "--cpu-only")
    assert_usage_error(code, out, err, "is a file, not a folder")


def test_output_equal_to_problem_is_refused(capsys, tmp_path):
    problem = tmp_path / "p.py"
    problem.write_text(PROBLEM.read_text())
    code, out, err = run(capsys, "optimize", str(problem), "-o", str(tmp_path / "." / "p.py"), "--cpu-only")
    assert_usage_error(code, out, err, "refusing to overwrite")
    assert problem.read_text() == PROBLEM.read_text()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: permissions cannot be denied")
def test_output_not_writable(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, out, err = run(capsys, "optimize", str(PROBLEM), "-o", str(locked / "out.py"), "--cpu-only")
    finally:
        locked.chmod(0o700)
    assert_usage_error(code, out, err, "not writable")


@pytest.mark.parametrize(("content", "words"), [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", ("binary file",)),
    ("x = 'caf\u00e9'\n".encode("latin-1"), ("not UTF-8", "save the problem file as UTF-8")),
])
def test_unusable_problem_file(capsys, tmp_path, content, words):
    problem = tmp_path / "p.py"
    problem.write_bytes(content)
    code, out, err = run(capsys, "optimize", str(problem), "-o", str(tmp_path / "o.py"), "--cpu-only")
    assert_usage_error(code, out, err, *words)
    assert not (tmp_path / "o.py").exists()


def test_problem_is_a_directory(capsys, tmp_path):
    assert_usage_error(*run(capsys, "optimize", str(tmp_path), "-o", str(tmp_path / "o.py")), "is a directory")


def test_eval_missing_candidate_is_a_usage_error(capsys, tmp_path):
    code, out, err = run(capsys, "eval", str(PROBLEM), str(tmp_path / "missing.py"))
    assert_usage_error(code, out, err, "missing.py: no such file")


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"kernelfuse {__version__} (torch ")


def test_inputs_forward_cannot_take_are_one_line(capsys, tmp_path):
    """A non-tensor input is specialised (tests/test_signatures.py); inputs forward cannot take at all are the
    problem file's error."""
    problem = write_problem(tmp_path, "too_many", """
        def __init__(self):
            super().__init__()

        def forward(self, x, k):
            return torch.relu(x) * k
        """, "[torch.rand(4, 8), 3, 4]")
    code, out, err = run(capsys, "optimize", str(problem), "-o", str(tmp_path / "o.py"), "--cpu-only")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "get_inputs(): forward(x, k) cannot take the 3 inputs given" in err


def test_shape_mismatch_is_one_line_without_torch_logs(tmp_path):
    problem = write_problem(tmp_path, "mismatch", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, x):
            return torch.relu(self.lin(x))
        """, "[torch.rand(4, 12)]")
    result = run_kernelfuse("optimize", str(problem), "-o", str(tmp_path / "o.py"), "--cpu-only")
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "could not trace forward" in lines[0] and "line 12 (return torch.relu(self.lin(x)))" in lines[0]


def test_json_report(capsys, tmp_path):
    report = tmp_path / "report.json"
    code, out, err = run(capsys, "optimize", str(FIXTURES / "tiny_half_ctor.py"), "-o", str(tmp_path / "o.py"),
                         "--cpu-only", "--json", str(report))
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["problem"]["captured_mode"] == "train"
    assert data["shipped"] == data["plans"][0]["variant"]
    kernels = data["plans"][0]["kernels"]
    assert kernels and kernels[0]["kind"] in ("library", "generated")
    assert "addmm.default" in kernels[0]["aten_ops"]
    assert [c["status"] for c in data["cpu_checks"]] == ["ok"]
    assert data["gpu"] is None
