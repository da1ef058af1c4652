"""Forward signatures users write (scalars, defaults, keyword-only, containers, structured outputs) and tensors made
inside forward: each regression problem in tests/fixtures/problems/sig_*.py goes through `optimize --cpu-only`,
its plan passes the CPU check, the emitted file imports and equals the original, and its guard hands calls that
differ from the traced one (another scalar value, None, another structure) to the original ops."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from optimizer_helpers import REPO, write_problem

import kernelfuse
from kernelfuse.capture import capture, capture_module
from kernelfuse.cli import main
from kernelfuse.codegen import generate
from kernelfuse.emit.module import build_module
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

FIXTURES = REPO / "tests" / "fixtures" / "problems"
# A call: (args, kwargs, whether the fused path serves it), built from the problem's own inputs
Call = tuple[list, dict, bool]
CASES: dict[str, Callable[[list], list[Call]]] = {
    "sig_scalar_float": lambda i: [([i[0], 3.5], {}, True), ([i[0], 4.0], {}, False), ([i[0], 3], {}, False)],
    "sig_default_scale": lambda i: [([i[0]], {}, True), ([i[0]], {"scale": 2.0}, True), ([i[0], 3.0], {}, False)],
    "sig_default_hidden": lambda i: [(i, {}, True), ([i[0]], {}, False)],
    "sig_kwonly": lambda i: [(i, {}, True), (i, {"alpha": 0.25}, False), (i, {"gelu": False}, False),
                             ([i[0]], {}, False), ([i[0], i[1], i[1]], {}, False)],
    "sig_tuple_input": lambda i: [(i, {}, True), ([i[0], 3], {}, False), ([list(i[0]), 2], {}, False)],
    "sig_dict_output": lambda i: [(i, {}, True), ([{**i[0], "y": i[0]["x"]}], {}, False),
                                  ([{"bias": i[0]["bias"], "x": i[0]["x"]}], {}, False)],
    "sig_structured_output": lambda i: [(i, {}, True)],
    "sig_tensor_constants": lambda i: [(i, {}, True)],
}


def _same(a: object, b: object, equal: Callable[[torch.Tensor, torch.Tensor], bool] = torch.equal) -> bool:
    """Equal values of the same structure and types (by name: the emitted file defines the problem's classes
    again), tensors of one dtype and `equal` (bit for bit by default)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and equal(a, b)
    if type(a).__qualname__ != type(b).__qualname__:
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], equal) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, equal) for x, y in zip(a, b, strict=True))
    return a == b


def _import(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(f"emitted_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _optimize(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[Path, dict, str]:
    out, report = tmp_path / f"{name}_new.py", tmp_path / f"{name}.json"
    assert main(["optimize", str(FIXTURES / f"{name}.py"), "-o", str(out), "--cpu-only", "--json", str(report)]) == 0
    return out, json.loads(report.read_text()), capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(CASES))
def test_signature_fixture_optimizes_checks_and_guards(name, tmp_path, capsys):
    out, report, printed = _optimize(name, tmp_path, capsys)
    assert report["shipped"].startswith("fused") and report["fallbacks"] == []
    assert [c["status"] for c in report["cpu_checks"]][:1] == ["ok"], printed
    problem = load_problem(FIXTURES / f"{name}.py")
    emitted = _import(out)
    model = problem.make_model()
    new = emitted.ModelNew(*problem.init_inputs())
    new.load_state_dict(model.state_dict())
    served = []
    # the guard is asked only if the call fits; it declines, so the original ops run
    emitted._fallback_reason = lambda module, inputs: served.append(inputs) or ("device", "a CPU tensor")
    for args, kwargs, fused in CASES[name](problem.make_inputs(seed=1)):
        served.clear()
        with torch.no_grad():
            assert _same(new(*args, **kwargs), model(*args, **kwargs))
        assert bool(served) == fused, (args, kwargs)


def test_scalar_guard_and_pattern_are_in_the_emitted_text(tmp_path, capsys):
    out, _, _ = _optimize("sig_scalar_float", tmp_path, capsys)
    text = out.read_text()
    assert "def forward(self, A, s: float):" in text and "_fits" not in text
    assert "if not _use_kernels(self, (A,) if type(s) is float and s == 3.5 else None):" in text
    assert "# s: specialised to 3.5 as traced (another value: the original ops)" in text


def test_containers_are_matched_against_their_traced_pattern(tmp_path, capsys):
    out, _, _ = _optimize("sig_kwonly", tmp_path, capsys)
    text = out.read_text()
    assert "CALL_PATTERNS = {'extra': (_TENSOR,)}" in text
    assert ("if not _use_kernels(self, (x, extra[0]) if _fits(extra, CALL_PATTERNS['extra']) and type(alpha) is "
            "float and alpha == 0.5 and gelu is True else None):") in text
    assert "return self._reference_forward(x, *extra, alpha=alpha, gelu=gelu)" in text


def test_tensor_constants_are_written_into_the_file(tmp_path, capsys):
    out, report, _ = _optimize("sig_tensor_constants", tmp_path, capsys)
    text = out.read_text()
    assert "_constant('_tensor_constant0', (1.0, 2.0, 3.0, 4.0), torch.float32, [4], _device)" in text
    assert "_constant('_tensor_constant2', (), torch.float32, [0], _device)" in text
    unfused = [u["aten_op"] for u in report["plans"][0]["unfused"]]
    assert unfused.count("constant") == 3


def test_large_constant_ships_the_original_module_with_the_reason(tmp_path, capsys):
    out, report, printed = _optimize("sig_large_constant", tmp_path, capsys)
    assert report["shipped"] == "unfused" and report["plans"] == []
    (fallback,) = report["fallbacks"]
    assert fallback["stage"] == "capture" and "5000 elements, more than the 1024" in fallback["reason"]
    assert "register_buffer" in printed and "Traceback" not in printed
    problem = load_problem(FIXTURES / "sig_large_constant.py")
    new = _import(out).ModelNew(*problem.init_inputs())
    model = problem.make_model()
    new.load_state_dict(model.state_dict())
    (x,) = problem.make_inputs(seed=1)
    with torch.no_grad():
        assert torch.equal(new(x), model(x))


def test_unsupported_argument_type_ships_the_original_module(tmp_path, capsys):
    path = write_problem(tmp_path, "odd_arg", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, cfg):
            return torch.relu(self.lin(x)) * cfg.scale
        """, "[torch.rand(2, 4), Cfg()]", header="""

        class Cfg:
            scale = 2.0
        """)
    report = tmp_path / "r.json"
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.py"), "--cpu-only", "--json", str(report)]) == 0
    (fallback,) = json.loads(report.read_text())["fallbacks"]
    assert fallback["what"] == "cfg" and "is a Cfg" in fallback["reason"]
    assert "fallback: capture fell back on cfg" in capsys.readouterr().out


def test_in_process_module_takes_the_same_signature():
    """`build_module` (kernelfuse.optimize's module) keeps forward's parameters, defaults and keyword-only ones,
    and specialises like the emitted file."""
    problem = load_problem(FIXTURES / "sig_kwonly.py")
    model = problem.make_model()
    x, e = problem.make_inputs(seed=1)
    (plan,) = plan_variants(rewrite(capture_module(model, [x, e])))
    fused = build_module(model, plan, None)
    assert str(__import__("inspect").signature(fused.forward)) == "(x, *extra, alpha=0.5, gelu=True)"
    served = []
    guard = lambda module, inputs: served.append(inputs) or ("device", "a CPU tensor")  # noqa: E731
    fused.forward.__func__.__globals__["_fallback_reason"] = guard
    with torch.no_grad():
        assert torch.equal(fused(x, e), model(x, e)) and len(served) == 1
        assert torch.equal(fused(x, e, alpha=0.1), model(x, e, alpha=0.1)) and len(served) == 1


def test_emitted_cuda_of_a_specialised_problem_compiles(tmp_path):
    from test_nvcc_compile import _nvcc

    nvcc = _nvcc()
    (plan,) = plan_variants(rewrite(capture(load_problem(FIXTURES / "sig_tensor_constants.py"))))
    cu = tmp_path / "constants.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(cu), "-o", str(tmp_path / "out.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_returned_constant_is_a_copy_of_the_shared_one(tmp_path, capsys):
    """A tensor made from literals that forward returns is the caller's to modify: the trace copies it
    (lift_fresh_copy, as eager makes a new tensor), so the shared per-device constant never leaves forward."""
    path = write_problem(tmp_path, "returns_constant", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x)), torch.tensor([1.0, 2.0])
        """, "[torch.rand(2, 4)]")
    out = tmp_path / "o.py"
    assert main(["optimize", str(path), "-o", str(out), "--cpu-only"]) == 0
    text = out.read_text()
    assert "v__tensor_constant0 = _constant('_tensor_constant0', (1.0, 2.0), torch.float32, [2], _device)" in text
    assert "= torch.ops.aten.lift_fresh_copy.default(v__tensor_constant0)" in text


def test_judge_accepts_the_references_own_container_class_only():
    """A namedtuple or ModelOutput the model returns is returned by ModelNew too (the file defines the problem's
    class again): the judge accepts that class where the reference has it, and still rejects any other subclass."""
    from collections import OrderedDict, namedtuple

    from kernelfuse.judge.outputs import impure_output

    t = torch.ones(2)
    pair, again = namedtuple("Pair", "a b"), namedtuple("Pair", "a b")

    class Out(OrderedDict):
        pass

    class Lazy(OrderedDict):
        def __getitem__(self, key):
            return torch.zeros(2)

    Lazy.__qualname__ = Out.__qualname__
    assert impure_output(again(t, t), pair(t, t)) is None and impure_output(Out(a=t), Out(a=t)) is None
    assert "subclass of OrderedDict" in impure_output(Lazy(a=t), Out(a=t))
    assert "subclass of tuple" in impure_output(pair(t, t), (t, t))
    assert "subclass of tuple" in impure_output({"x": pair(t, t)}, {"x": (t, t)})


def test_graphed_variant_of_a_dict_output_rebuilds_it_outside_the_graph(tmp_path):
    """The CUDA-graph replay clones a tensor or a tuple of tensors: for a dict output `_fused_forward` returns its
    tensors and forward rebuilds the dict, from the replay or from the kernels run one by one."""
    from kernelfuse.pipeline import emit_file

    problem = load_problem(FIXTURES / "sig_dict_output.py")
    plan = plan_variants(rewrite(capture(problem)))[0].as_graphed()
    path = tmp_path / "graphed.py"
    path.write_text(emit_file(problem, plan, "test"))
    text = path.read_text()
    assert "        out = graph.replay((batch['x'], batch['bias']))" in text
    assert "    return {'logits': out[0], 'parts': [out[1], out[2]], 'count': 8, 'cache': None}" in text
    assert "def _fused_forward(self, batch_x, batch_bias):" in text
    model = problem.make_model()
    new = _import(path).ModelNew(*problem.init_inputs())
    new.load_state_dict(model.state_dict())
    inputs = problem.make_inputs(seed=1)
    with torch.no_grad():
        assert _same(new(*inputs), model(*inputs))


@pytest.mark.parametrize("body, what", [
    ("""
    def forward(self, x, acc):
        return torch.relu(x) + acc
    """, "parameter 'acc' is a name the fused forward uses"),
    ("""
    forward = nn.Module.__call__
    """, "forward is not defined in the class body"),
])
def test_what_the_file_cannot_express_is_found_at_load(tmp_path, capsys, body, what):
    path = write_problem(tmp_path, "odd_forward", body, "[torch.rand(2, 4), torch.rand(2, 4)]")
    report = tmp_path / "r.json"
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.py"), "--cpu-only", "--json", str(report)]) == 0
    (fallback,) = json.loads(report.read_text())["fallbacks"]
    assert fallback["stage"] == "load" and what in fallback["reason"]
    assert "fallback: load fell back on Model.forward" in capsys.readouterr().out


def test_api_returns_the_model_for_a_parameter_it_cannot_name():
    class Shadowing(torch.nn.Module):
        def forward(self, x, acc):
            return torch.relu(x) + acc

    model = Shadowing()
    with pytest.warns(UserWarning, match="parameter 'acc' is a name the fused forward uses"):
        assert kernelfuse.optimize(model, [torch.rand(2), torch.rand(2)]) is model


def test_api_accepts_scalars_and_containers_in_example_inputs():
    """kernelfuse.optimize takes forward's arguments as get_inputs() gives them; on the CPU it captures and plans
    them, then returns the model because the inputs are not on a GPU (not because of the signature)."""
    problem = load_problem(FIXTURES / "sig_tuple_input.py")
    model = problem.make_model()
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        assert kernelfuse.optimize(model, problem.make_inputs(seed=1)) is model
