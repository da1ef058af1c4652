"""Stage 1 — load: problem files become Problems, or one clear ProblemError (exit code 2)."""

from __future__ import annotations

import pytest
import torch
from optimizer_helpers import EXAMPLE_NAMES, EXAMPLES, problem_text, run_kernelfuse, write_problem

from kernelfuse.errors import CaptureError, ProblemError
from kernelfuse.load import Problem, load_problem

GOOD_BODY = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(8, 4)

def forward(self, x):
    return torch.relu(self.lin(x))
"""

CTOR_RAISES_BODY = """
def __init__(self, size):
    super().__init__()
    self.lin = nn.Linear(size, 4)
    raise ValueError(f"unsupported size {size}")

def forward(self, x):
    return self.lin(x)
"""


def _bad_files(tmp_path):
    """name -> (path, substrings the one-line message must contain)."""
    good = problem_text(GOOD_BODY, "[torch.rand(2, 8)]")
    cases = {}
    cases["missing"] = (tmp_path / "does_not_exist.py", ["does_not_exist.py", "no such file"])
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import torch\n\n\ndef get_inputs(:\n    return []\n")
    cases["syntax"] = (syntax, ["syntax.py:4:", "syntax error"])
    for name in ("Model", "get_inputs", "get_init_inputs"):
        path = tmp_path / f"no_{name}.py"
        path.write_text(good.replace(f"def {name}(", f"def other_{name}(").replace(f"class {name}(", "class Other("))
        cases[f"no_{name}"] = (path, [f"missing {name}"])
    not_module = tmp_path / "not_module.py"
    not_module.write_text(good.replace("class Model(nn.Module):", "class Model:"))
    cases["not_module"] = (not_module, ["Model must be a subclass of torch.nn.Module"])
    import_raises = tmp_path / "import_raises.py"
    import_raises.write_text("import torch\nSIZE = int('twelve')\n" + good.split("\n", 1)[1])
    cases["import_raises"] = (import_raises, ["ValueError", "line 2: SIZE = int('twelve')"])
    return cases


@pytest.mark.parametrize("case", ["missing", "syntax", "no_Model", "no_get_inputs", "no_get_init_inputs",
                                  "not_module", "import_raises"])
def test_bad_problem_files_raise_problem_error(tmp_path, case):
    path, needles = _bad_files(tmp_path)[case]
    with pytest.raises(ProblemError) as info:
        load_problem(path)
    message = str(info.value)
    assert info.value.exit_code == 2
    assert "\n" not in message, "the CLI prints one line"
    for needle in needles:
        assert needle in message


def test_missing_names_are_all_listed(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("import torch\n")
    with pytest.raises(ProblemError, match="missing Model, get_inputs, get_init_inputs"):
        load_problem(path)


def test_constructor_error_names_the_problem_line(tmp_path):
    path = write_problem(tmp_path, "ctor", CTOR_RAISES_BODY, "[torch.rand(2, 12)]", init="[12]")
    problem = load_problem(path)  # loading constructs nothing
    with pytest.raises(ProblemError) as info:
        problem.make_model()
    message = str(info.value)
    assert "Model(*get_init_inputs()) raised ValueError: unsupported size 12" in message
    line_no = path.read_text().splitlines().index('        raise ValueError(f"unsupported size {size}")') + 1
    assert f'(line {line_no}: raise ValueError(f"unsupported size {{size}}"))' in message


def test_get_inputs_error_names_the_problem_line(tmp_path):
    path = write_problem(tmp_path, "inputs_raise", GOOD_BODY, "[torch.rand(2, 8)]")
    path.write_text(path.read_text().replace("    return [torch.rand(2, 8)]", "    return [torch.rand(2, 8)[5]]"))
    problem = load_problem(path)
    pattern = r"get_inputs\(\) raised IndexError.*\(line \d+: return \[torch.rand\(2, 8\)\[5\]\]\)"
    with pytest.raises(ProblemError, match=pattern):
        problem.make_inputs(seed=0)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_examples_load(name):
    problem = load_problem(EXAMPLES / f"{name}.py")
    assert isinstance(problem, Problem)
    assert problem.name == name
    assert issubclass(problem.model_cls, torch.nn.Module)
    assert problem.source == (EXAMPLES / f"{name}.py").read_text()
    assert all(not isinstance(a, torch.Tensor) for a in problem.init_inputs())


def test_make_model_and_inputs_are_seeded(tmp_path):
    problem = load_problem(write_problem(tmp_path, "good", GOOD_BODY, "[torch.rand(2, 8)]"))
    a, b = problem.make_model(seed=42), problem.make_model(seed=42)
    c = problem.make_model(seed=7)
    assert torch.equal(a.lin.weight, b.lin.weight)
    assert not torch.equal(a.lin.weight, c.lin.weight)
    assert torch.equal(problem.make_inputs(3)[0], problem.make_inputs(3)[0])
    assert not torch.equal(problem.make_inputs(3)[0], problem.make_inputs(4)[0])


def test_inputs_are_made_on_the_judged_device(tmp_path):
    # "meta" stands in for a GPU on the CI machine: the factories run under the device, nothing is drawn on the CPU
    problem = load_problem(write_problem(tmp_path, "good", GOOD_BODY, "[torch.rand(2, 8), 3]"))
    x, n = problem.make_inputs(3, "meta")
    assert x.device.type == "meta" and x.shape == (2, 8) and n == 3


def test_inputs_that_need_the_cpu_are_made_there_and_moved(tmp_path):
    # .tolist() cannot run on a meta (or lazily on any non-CPU) tensor: get_inputs runs on the CPU, then moves
    problem = load_problem(write_problem(tmp_path, "cpu_only", GOOD_BODY, "[torch.tensor(torch.rand(2, 8).tolist())]"))
    (x,) = problem.make_inputs(3, "meta")
    assert x.device.type == "meta" and x.shape == (2, 8)


def test_capture_error_is_exit_code_3():
    assert CaptureError("x").exit_code == 3


@pytest.mark.parametrize("case", ["missing", "syntax", "no_Model", "no_get_inputs", "no_get_init_inputs",
                                  "import_raises", "ctor_raises"])
def test_cli_exit_code_2(tmp_path, case):
    if case == "ctor_raises":
        path = write_problem(tmp_path, "ctor", CTOR_RAISES_BODY, "[torch.rand(2, 12)]", init="[12]")
        needles = ["unsupported size 12", 'raise ValueError(f"unsupported size {size}")']
    else:
        path, needles = _bad_files(tmp_path)[case]
    out = tmp_path / "out.py"
    result = run_kernelfuse("optimize", str(path), "-o", str(out), "--cpu-only")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("kernelfuse: error: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr
    assert not out.exists()


def test_missing_third_party_module_is_one_line_exit_2_with_the_fix(tmp_path):
    """A problem importing a package that is not installed (KernelBench's Mamba2 needs einops): exit 2, one
    line naming the module, the problem's line and the install command, no traceback."""
    path = write_problem(tmp_path, "needs_pkg", GOOD_BODY, "[torch.rand(2, 8)]",
                         header="from kernelfuse_no_such_pkg.sub import thing\n")
    with pytest.raises(ProblemError, match=r"needs a module that is not installed.*'kernelfuse_no_such_pkg'.*"
                                           r"line 4: from kernelfuse_no_such_pkg.sub import thing.*"
                                           r"pip install kernelfuse_no_such_pkg\)"):
        load_problem(path)
    proc = run_kernelfuse("optimize", str(path), "-o", str(tmp_path / "out.py"), "--cpu-only")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
