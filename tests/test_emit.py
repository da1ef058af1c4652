"""Stage 6 — emit: the ModelNew file is valid, self-contained Python with the original weights and semantics.

The fused branch of the emitted forward is also run on the CPU, with the extension replaced by torch versions of
the epilogues (and cuDNN's fused conv+bias+relu by conv2d + relu): it checks the emitted wiring (which values
go into which kernel, in which order), which no GPU is needed for.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from optimizer_helpers import EXAMPLE_NAMES, shrunk_example, write_problem

from kernelfuse.capture import capture
from kernelfuse.emit import emit_reference
from kernelfuse.load import load_problem
from kernelfuse.ops import POINTWISE_BY_ATEN
from kernelfuse.pipeline import OptimizeOptions, emit_file, optimize_file
from kernelfuse.plan import FusedStep, plan_variants
from kernelfuse.rewrite import rewrite

CHAINS = {
    "gemm_add_relu": "mm -> add -> relu",
    "gemm_sigmoid_scaling_residualadd": "addmm -> sigmoid -> mul -> add",
    "conv2d_relu_biasadd": "convolution -> relu -> add",
}


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """name -> (problem path, fused ModelNew path, unfused ModelNew path, result)."""
    out = {}
    for name in EXAMPLE_NAMES:
        d = tmp_path_factory.mktemp(name)
        problem_path = shrunk_example(name, d)
        fused = d / f"{name}_new.py"
        result = optimize_file(problem_path, fused, OptimizeOptions(use_gpu=False), log=lambda s: None)
        unfused = d / f"{name}_unfused.py"
        unfused.write_text(emit_reference(load_problem(problem_path), "test: unfused"))
        out[name] = (problem_path, fused, unfused, result)
    return out


STANDALONE = textwrap.dedent("""
    import json, runpy, sys
    import torch
    problem = runpy.run_path(sys.argv[1])
    report = {}
    for path in sys.argv[2:]:
        emitted = runpy.run_path(path)
        init = emitted["get_init_inputs"]()
        assert init == problem["get_init_inputs"](), "the emitted file keeps the problem's constants"
        torch.manual_seed(42); ref = problem["Model"](*init)
        torch.manual_seed(42); new = emitted["ModelNew"](*init)
        params = [(n, tuple(p.shape)) for n, p in ref.named_parameters()]
        same_params = params == [(n, tuple(p.shape)) for n, p in new.named_parameters()] and all(
            torch.equal(a, b) for a, b in zip(ref.state_dict().values(), new.state_dict().values()))
        same_keys = list(ref.state_dict()) == list(new.state_dict())
        torch.manual_seed(7); xs = emitted["get_inputs"]()
        with torch.no_grad():
            a, b = ref(*xs), new(*xs)
        c = new(*xs)  # grad enabled: the reference path, autograd intact
        c.sum().backward()
        report[path] = {
            "same_params": same_params, "same_keys": same_keys, "n_params": len(params),
            "equal_out": bool(a.shape == b.shape and torch.equal(a, b)),
            "equal_grad_path": bool(torch.equal(a, c.detach())),
            "grads": all(p.grad is not None for p in new.parameters()),
        }
    report["kernelfuse_imported"] = any(m == "kernelfuse" or m.startswith("kernelfuse.") for m in sys.modules)
    print(json.dumps(report))
""")


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_emitted_files_run_standalone(emitted, name, tmp_path):
    problem_path, fused, unfused, _ = emitted[name]
    # run from an empty directory with a clean path: only torch (and the standard library) is importable besides
    proc = subprocess.run([sys.executable, "-I", "-c", STANDALONE, str(problem_path), str(fused), str(unfused)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("kernelfuse_imported") is False
    for path, r in report.items():
        assert r == {"same_params": True, "same_keys": True, "n_params": r["n_params"], "equal_out": True,
                     "equal_grad_path": True, "grads": True}, path
        assert r["n_params"] >= 2


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_emitted_text(emitted, name):
    _, fused, unfused, result = emitted[name]
    for path in (fused, unfused):
        text = path.read_text()
        ast.parse(text)
        compile(text, str(path), "exec")
        assert "import kernelfuse" not in text and "from kernelfuse" not in text
        assert "class ModelNew(nn.Module):" in text and "class Model(" not in text
        assert "def get_inputs():" in text and "def get_init_inputs():" in text
    text = fused.read_text()
    assert result.shipped == result.plans[0].variant
    assert "not verified on a GPU" in text
    assert f"fused k0: {CHAINS[name]}" in text.split('"""', 2)[1], "the docstring carries the plan summary"
    assert "CUDA_SRC = r\"\"\"" in text and "class _Kernels(_KernelLibrary):" in text
    assert "def _reference_forward(self, x):" in text
    assert "not verified" not in unfused.read_text() and "unfused (the original ops)" in unfused.read_text()


def _method_source(text: str, cls: str, method: str) -> str:
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = text.splitlines()
    return "\n".join(lines[fn.lineno - 1: fn.end_lineno])


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_forward_comments_name_the_replaced_chain(emitted, name):
    _, fused, _, result = emitted[name]
    text = fused.read_text()
    forward = _method_source(text, "ModelNew", "forward")
    assert f"# k0: {CHAINS[name]}" in forward
    plan = result.plans[0]
    (step,) = plan.fused
    where = "in place" if step.inplace else "into a new NCHW tensor"
    what = "; ".join(str(s) for s in step.epilogue.statements)
    assert f"# epilogue kernel k0 ({where}): {what}" in forward
    assert "if not _use_kernels(self, (x,)):\n            return self._reference_forward(x)" in forward
    # and the class keeps the problem's forward verbatim as the reference path
    original = _method_source(load_problem(emitted[name][0]).source, "Model", "forward")
    assert _method_source(text, "ModelNew", "_reference_forward") == original.replace(
        "def forward(", "def _reference_forward(", 1)


# ---- the fused branch, run on the CPU with a torch stand-in for the extension ---------------------------------

class FakeExtension:
    """The extension's functions, computed with the op table's torch references."""

    def __init__(self, plan):
        self.calls: list[str] = []
        for step in plan.fused:
            setattr(self, step.kernel, self._kernel(step))

    def to_channels_last(self, x):
        self.calls.append("to_channels_last")
        assert x.is_contiguous()
        return x.contiguous(memory_format=torch.channels_last)

    def _kernel(self, step: FusedStep):
        def run(acc, *operands):
            self.calls.append(step.kernel)
            assert len(operands) == len(step.epilogue.operands)
            if step.anchor.layout == "nhwc":
                assert acc.is_contiguous(memory_format=torch.channels_last)
            values = {"acc": acc, **{f"in{i}": t for i, t in enumerate(operands)}}
            for i, (t, operand) in enumerate(zip(operands, step.epilogue.operands, strict=True)):
                assert tuple(t.shape) == operand.meta.shape, f"in{i}"
            for st in step.epilogue.statements:
                args = [values[a] if isinstance(a, str) else a for a in st.args]
                values[st.name] = POINTWISE_BY_ATEN[st.aten].torch_fn(*args, *st.params)
            result = values[step.epilogue.result]
            if step.inplace:
                acc.copy_(result)
                return acc
            return result.contiguous()
        return run


class TorchWithCudnnRelu:
    """`torch`, plus a CPU stand-in for torch.cudnn_convolution_relu (CUDA-only)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def cudnn_convolution_relu(x, w, b, stride, padding, dilation, groups):
        return torch.relu(torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups))


def _exec_fused(text: str, plan, force_kernels: bool = True):
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)
    ext = FakeExtension(plan)
    if force_kernels:
        ns["_fallback_reason"] = lambda module, inputs: None  # the guard says yes: the fused path, counted
        ns["_extension"] = lambda: ext
        ns["torch"] = TorchWithCudnnRelu()
    return ns, ext


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_fused_branch_wiring_on_cpu(tmp_path, name):
    problem = load_problem(shrunk_example(name, tmp_path))
    plans = plan_variants(rewrite(capture(problem)))
    for plan in plans:
        text = emit_file(problem, plan, "test")
        ns, ext = _exec_fused(text, plan)
        torch.manual_seed(42)
        new = ns["ModelNew"](*problem.init_inputs())
        ref = problem.make_model(seed=42)
        torch.manual_seed(3)
        xs = problem.get_inputs()
        with torch.no_grad():
            got, expected = new(*xs), ref(*xs)
        expected_calls = ["k0"] if plan.fused[0].anchor.layout == "nchw" else ["to_channels_last", "k0"]
        assert ext.calls == expected_calls, plan.variant
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_emitted_forward_with_two_fused_steps_and_operands(tmp_path):
    path = write_problem(tmp_path, "two", """
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 24)
            self.b = nn.Linear(24, 8)
            self.s = nn.Parameter(torch.randn(24))

        def forward(self, x, y):
            h = torch.relu(self.a(x)) * self.s
            return torch.sigmoid(self.b(h)) - y, h
        """, "[torch.randn(4, 16), torch.randn(4, 8)]")
    problem = load_problem(path)
    (plan,) = plan_variants(rewrite(capture(problem)))
    assert len(plan.fused) == 2
    text = emit_file(problem, plan, "test")
    assert "if not _use_kernels(self, (x, y)):" in text
    ns, ext = _exec_fused(text, plan)
    new = ns["ModelNew"]()
    ref = problem.make_model(seed=42)
    new.load_state_dict(ref.state_dict())
    xs = problem.make_inputs(0)
    with torch.no_grad():
        got, expected = new(*xs), ref(*xs)
    assert ext.calls == ["k0", "k1"]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


CONV_RELU = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(3, 8, 3)

def forward(self, x):
    return torch.relu(self.conv(x))
"""


def test_library_only_fusion_keeps_the_reference_path(tmp_path):
    """conv -> relu in NCHW needs no kernel of ours (cuDNN's fused conv+bias+relu): the file still guards it."""
    problem = load_problem(write_problem(tmp_path, "convrelu", CONV_RELU, "[torch.rand(2, 3, 10, 10)]"))
    nhwc, nchw = plan_variants(rewrite(capture(problem)))
    assert nchw.fused and not nchw.fused[0].needs_kernel
    text = emit_file(problem, nchw, "test")
    assert "CUDA_SRC" not in text and "torch.cudnn_convolution_relu(" in text
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)
    torch.manual_seed(42)
    new = ns["ModelNew"]()
    ref = problem.make_model(seed=42)
    x = problem.make_inputs(0)
    with torch.no_grad():
        assert torch.equal(new(*x), ref(*x))  # CPU tensors: the reference path, not the CUDA-only cuDNN call
    new(*x).sum().backward()  # and autograd sees the original ops
    assert new.conv.weight.grad is not None
    # the fused branch itself, with the cuDNN call stood in for
    ns2, _ = _exec_fused(text, nchw)
    new2 = ns2["ModelNew"]()
    new2.load_state_dict(ref.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(new2(*x), ref(*x), rtol=1e-6, atol=1e-6)


def test_default_scale_is_specialised_not_refused(tmp_path):
    """forward(self, x, scale=2.0) with get_inputs() leaving scale out was refused at the end: the emitted forward
    keeps the parameter list and runs the kernels for scale == 2.0 only."""
    path = write_problem(tmp_path, "kw", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=2.0):
            return torch.relu(self.lin(x)) * scale
        """, "[torch.rand(2, 4)]")
    problem = load_problem(path)
    (plan,) = plan_variants(rewrite(capture(problem)))
    text = emit_file(problem, plan, "test")
    assert "def forward(self, x, scale=2.0):" in text and "CALL_PATTERNS" not in text
    assert "if not _use_kernels(self, (x,) if type(scale) is float and scale == 2.0 else None):" in text


def test_trailing_none_default_is_kept_and_served_by_the_original_ops_when_given(tmp_path):
    """forward(self, x, mask=None) with get_inputs() leaving mask out (level3 NetVLAD): the fused path serves
    mask=None calls; a call that passes mask runs the original ops."""
    path = write_problem(tmp_path, "opt", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            y = torch.relu(self.lin(x))
            return y if mask is None else y * mask
        """, "[torch.rand(2, 4)]")
    problem = load_problem(path)
    (plan,) = plan_variants(rewrite(capture(problem)))
    text = emit_file(problem, plan, "test")
    assert "def forward(self, x, mask=None):" in text
    assert "if not _use_kernels(self, (x,) if mask is None else None):" in text
    assert "return self._reference_forward(x, mask)" in text
    out = tmp_path / "opt_new.py"
    out.write_text(text)
    ns = __import__("runpy").run_path(str(out))
    torch.manual_seed(0)
    model = problem.make_model()
    torch.manual_seed(0)
    new = ns["ModelNew"](*problem.init_inputs())
    new.load_state_dict(model.state_dict())
    x, mask = torch.rand(2, 4), torch.rand(2, 4)
    with torch.no_grad():
        assert torch.equal(new(x), model(x)) and torch.equal(new(x, mask), model(x, mask))


def test_emit_reference_renames_super_calls(tmp_path):
    problem = load_problem(shrunk_example("gemm_add_relu", tmp_path))
    text = emit_reference(problem, "why: testing")
    assert "super(ModelNew, self).__init__()" in text and "super(Model," not in text
    assert "why: testing" in text
    ns: dict = {}
    exec(compile(text, "ref.py", "exec"), ns)
    assert isinstance(ns["ModelNew"](*ns["get_init_inputs"]()), torch.nn.Module)


def test_emitted_file_is_tidy(emitted):
    for name in EXAMPLE_NAMES:
        text = emitted[name][1].read_text()
        assert text.endswith("\n") and not text.endswith("\n\n")
        assert "\n\n\n\n" not in text
        assert not any(line != line.rstrip() for line in text.splitlines() if not line.startswith("//")), name


def test_no_kernelfuse_import_even_indirectly(emitted):
    for name in EXAMPLE_NAMES:
        tree = ast.parse(emitted[name][1].read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported <= {"torch", "ctypes", "hashlib", "inspect", "os", "warnings"}, imported


def test_optimize_writes_into_new_directory(tmp_path):
    problem_path = shrunk_example("gemm_add_relu", tmp_path)
    out = tmp_path / "nested" / "dir" / "new.py"
    result = optimize_file(problem_path, out, OptimizeOptions(use_gpu=False), log=lambda s: None)
    assert out.is_file() and result.output == Path(out)
    assert result.cpu_checks and all(c.ok for c in result.cpu_checks)  # every variant judged (fused, fused-tcgemm)


def test_model_without_its_own_constructor_gets_one_that_builds_the_kernels(tmp_path):
    """A Model that inherits nn.Module's __init__ (only a forward) is emitted, not refused: ModelNew gains a
    constructor that calls the parent's and builds the extension (the GPU run of zoo_mapped.py failed here)."""
    path = write_problem(tmp_path, "noinit", """
        def forward(self, a):
            return torch.relu(a) * 2.0
        """, "[torch.rand(2, 8)]")
    problem = load_problem(path)
    plan = plan_variants(rewrite(capture(problem)))[-1]
    assert plan.generated
    text = emit_file(problem, plan, "test")
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "ModelNew")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert "_extension()" in ast.unparse(init)
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)
    x = problem.make_inputs(0)
    with torch.no_grad():
        assert torch.equal(ns["ModelNew"]()(*x), problem.make_model()(*x))  # CPU: the reference path


def test_the_captured_ops_alone_define_the_constants_they_make(tmp_path):
    """A plan without kernels (what ships unfused under bf16: the captured ops) still makes a tensor forward builds
    from literals through the emitted `_constant`, so the file must define it (GPT-2's empty KV-cache tensor)."""
    path = write_problem(tmp_path, "empty_constant", textwrap.dedent("""
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            empty = torch.tensor([], dtype=x.dtype, device=x.device)
            return torch.cat([empty, self.lin(x).flatten()]).view(4, 16) + 1
        """), "[torch.randn(4, 16)]")
    problem = load_problem(path)
    ops_only = plan_variants(rewrite(capture(problem)), max_fusions=0)[0]
    text = emit_file(problem, ops_only, "the captured ops")
    assert "_constant(" in text
    namespace = {}
    exec(compile(text, str(path), "exec"), namespace)  # noqa: S102 - our emitted file
    model = namespace["ModelNew"]()
    torch.manual_seed(0)
    reference = load_problem(path).make_model()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
