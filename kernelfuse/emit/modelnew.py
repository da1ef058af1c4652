"""Emit the product: a self-contained ModelNew file (torch and the standard library only).

The file keeps the problem's own code (imports, constants, get_inputs, get_init_inputs), and ModelNew is the
problem's Model class verbatim — same constructor, hence the same parameters and weights under the same seed —
with its forward renamed `_reference_forward` and a new forward that runs the plan's kernels. The reference path
runs whenever the kernels cannot (autograd needs gradients, CPU tensors, other shapes or dtypes).
"""

from __future__ import annotations

import ast
import re
import textwrap

import torch

from kernelfuse.capture import Node, Ref
from kernelfuse.codegen import CudaSources
from kernelfuse.codegen.binding import runtime_source
from kernelfuse.codegen.common import channels_last_format
from kernelfuse.codegen.generated import tensor_args
from kernelfuse.emit.flags import _with_tf32, _without_tf32, source_of
from kernelfuse.emit.graphed import GRAPH_RUNTIME, graphed_forward_source
from kernelfuse.emit.hoist import cached_tuple, plan_hoist, step_out, weight_methods
from kernelfuse.errors import ProblemError
from kernelfuse.load import Problem, class_source
from kernelfuse.plan.ir import FusedStep, GenStep, Plan, Step, TorchStep

# Readable spellings for common ATen calls; anything else is written `torch.ops.aten.<op>(...)`.
PY_SPELLING = {
    "getitem": "{0}[{1}]",
    "t.default": "{0}.t()",
    "mm.default": "torch.mm({0}, {1})",
    "addmm.default": "torch.addmm({0}, {1}, {2})",
}

# The run-time support of an emitted file (also exec'd by kernelfuse.emit.module for in-process modules).
LOADER = '''
_EXTENSION = None


def _extension():
    """The kernels below, built on first use as a plain library (no torch headers, no C++ binding: a fast build)
    or loaded from torch's extension cache (keyed by source hash), behind the `_Kernels` methods."""
    global _EXTENSION
    if _EXTENSION is None:
        import os

        from torch.utils.cpp_extension import load_inline

        digest = hashlib.sha256(CUDA_SRC.encode()).hexdigest()[:16]
        # Keep torch's headers out of the kernel file where this torch allows it: a much faster build.
        options = {"no_implicit_headers": True} if "no_implicit_headers" in inspect.signature(load_inline).parameters else {}
        # Compile the kernels for the GPU at hand only (not a long TORCH_CUDA_ARCH_LIST from the environment).
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
        try:
            path = load_inline(
                name=f"kernelfuse_{NAME}_{digest}",
                cpp_sources="",  # nothing on the C++ side: Python calls the kernels' C launchers through ctypes
                cuda_sources=CUDA_SRC,
                extra_cuda_cflags=["-O3"],
                is_python_module=False,
                **options,
            )
        finally:
            if arch is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        _EXTENSION = _Kernels(path)
    return _EXTENSION
'''

# The guard any fused forward needs, with or without custom kernels: library-only fusions such as
# torch.cudnn_convolution_relu also run only on CUDA tensors and have no backward.
GUARD = '''
def _use_kernels(module, inputs):
    """The fused path serves inference on the captured shapes and mode; anything else runs the original ops."""
    if any(m.training != CAPTURED_TRAINING for m in module.modules()):
        return False  # BatchNorm, Dropout...: the kernels were planned for the other train/eval mode
    if torch.is_grad_enabled() and (
        any(p.requires_grad for p in module.parameters()) or any(t.requires_grad for t in inputs)
    ):
        return False  # the kernels have no backward: autograd must see the original ops
    return all(
        t.is_cuda and tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        for t, (shape, dtype) in zip(inputs, INPUT_SPECS)
    ) and all(p.is_cuda for p in module.parameters())
'''


def runtime_text(plan: Plan, sources: CudaSources | None) -> str:
    """The module-level support code a fused forward calls: loader, guard, TF32 helper (as needed)."""
    parts = [LOADER, runtime_source(), sources.binding] if sources is not None else []
    parts.append(GUARD)
    if any(s.anchor.tf32 for s in plan.fused):
        parts.append(source_of(_with_tf32))  # a matmul under the tf32 policy
    if any(s.anchor.fp32 for s in plan.fused):
        parts.append(source_of(_without_tf32))  # a channels-last conv in full fp32
    if plan.graphed:
        parts.append(GRAPH_RUNTIME)
    return "\n\n".join(p.strip("\n") + "\n" for p in parts)


def emit_modelnew(problem: Problem, plan: Plan, sources: CudaSources | None, report: str) -> str:
    """The text of the ModelNew file for `plan` (`sources` None: the plan needs no custom kernel)."""
    cls = class_source(problem)
    forward = _find_method(cls, "forward", problem)
    arg_names, optional = _forward_args(forward, problem, len(plan.graph.inputs))
    prelude = _problem_without_model(problem, cls)
    header = _docstring(problem, plan, report)
    guarded = sources is not None or bool(plan.fused) or bool(optional) or plan.graphed
    body = _model_new_class(problem, cls, forward, plan, arg_names, sources is not None, guarded, optional)
    imports = "import ctypes\nimport hashlib\nimport inspect\n" if sources is not None else "import hashlib\nimport inspect\n"
    parts = [header, imports, prelude.rstrip() + "\n", body]
    specs = ", ".join(f"({tuple(n.meta.shape)}, {n.meta.dtype})" for n in plan.graph.inputs)
    if guarded:
        parts.append(runtime_text(plan, sources))
        parts.append(f"INPUT_SPECS = [{specs}]\nCAPTURED_TRAINING = {plan.graph.training}\n")
    if sources is not None:
        parts.append(f"NAME = {problem.name!r}\n")
        parts.append(f'CUDA_SRC = r"""\n{sources.cuda}"""\n')
    return _tidy("\n\n".join(p.strip("\n") + "\n" for p in parts))


def emit_reference(problem: Problem, report: str) -> str:
    """The unfused ModelNew: the original Model under the new name (what ships when fusion does not pay)."""
    cls = class_source(problem)
    text = "\n".join(problem.source.splitlines()[cls.lineno - 1: cls.end_lineno])
    text = _rename_class(text, cls.name)
    header = f'"""ModelNew for {problem.path.name}, generated by kernelfuse: unfused (the original ops).\n\n{report}\n"""\n'
    return _tidy("\n\n".join([header, _problem_without_model(problem, cls).strip("\n") + "\n", text + "\n"]))


def _rename_class(text: str, name: str) -> str:
    """`class Model(` -> `class ModelNew(`, and `super(Model, self)` to match: nothing else in the body changes."""
    return text.replace(f"class {name}(", "class ModelNew(", 1).replace(f"super({name}, self)", "super(ModelNew, self)")


def _tidy(text: str) -> str:
    """At most two blank lines in a row, one newline at the end."""
    return re.sub(r"\n{4,}", "\n\n\n", text).rstrip("\n") + "\n"


def _docstring(problem: Problem, plan: Plan, report: str) -> str:
    lines = [f"ModelNew for {problem.path.name}, generated by kernelfuse.", "", plan.summary()]
    if report:
        lines += ["", report]
    text = "\n".join(lines).replace('"""', "'''")
    return f'"""{text}\n"""\n'


def _problem_without_model(problem: Problem, cls: ast.ClassDef) -> str:
    lines = problem.source.splitlines()
    start = (cls.decorator_list[0].lineno if cls.decorator_list else cls.lineno) - 1
    kept = lines[:start] + lines[cls.end_lineno:]
    return "\n".join(kept)


def _find_method(cls: ast.ClassDef, name: str, problem: Problem) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ProblemError(f"{problem.path}: Model has no {name}() method")


def _forward_args(forward: ast.FunctionDef, problem: Problem, captured: int) -> tuple[list[str], list[str]]:
    """(the positional tensor arguments the graph was captured with, trailing `=None` arguments it was captured
    without: the fused path serves calls that leave them None)."""
    a = forward.args
    names = [arg.arg for arg in a.args[1:]]
    optional = names[len(names) - len(a.defaults):] if a.defaults else []
    plain_defaults = all(isinstance(d, ast.Constant) and d.value is None for d in a.defaults)
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or not plain_defaults \
            or len(names) - len(optional) != captured:
        raise ProblemError(f"{problem.path}:{forward.lineno}: forward() must take plain positional tensors "
                           "(no *args, **kwargs, keyword-only arguments, or defaults other than trailing "
                           "=None ones get_inputs() leaves out) to be compiled")
    return names[:len(names) - len(optional)], optional


def _model_new_class(problem: Problem, cls: ast.ClassDef, forward: ast.FunctionDef, plan: Plan,
                     arg_names: list[str], has_kernels: bool, guarded: bool, optional: list[str]) -> str:
    lines = problem.source.splitlines()
    text_lines = lines[cls.lineno - 1: cls.end_lineno]
    # forward -> _reference_forward (kept verbatim: it is the path for autograd and unsupported inputs)
    def_line = forward.lineno - cls.lineno
    text_lines[def_line] = text_lines[def_line].replace("def forward(", "def _reference_forward(", 1)
    if has_kernels:  # build the kernels at construction, not inside the first (timed) forward
        build = "if torch.cuda.is_available():\n    _extension()"
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:  # the Model inherits its constructor: ModelNew gets one that adds the build
            init_text = "def __init__(self, *args, **kwargs):\n" + textwrap.indent(
                "super().__init__(*args, **kwargs)\n" + build, "    ")
            text_lines.insert(def_line, textwrap.indent(init_text, " " * forward.col_offset) + "\n")
        else:
            text_lines.insert(init.end_lineno - cls.lineno + 1, textwrap.indent(build, " " * init.body[-1].col_offset))
    text = "\n".join(text_lines)
    text = _rename_class(text, cls.name)
    indent = " " * (forward.col_offset)
    new_forward = forward_source(plan, arg_names, has_kernels, guarded, optional=optional)
    return text + "\n\n" + textwrap.indent(new_forward, indent)


def forward_source(plan: Plan, arg_names: list[str], has_kernels: bool, guarded: bool, state: str = "self",
                   optional: list[str] | tuple[str, ...] = ()) -> str:
    """The text of the fused `forward` method, and of the weight cache methods it calls (kernelfuse.emit.hoist)
    where the plan computes values from the weights alone; module state is read as `{state}.<attribute path>`.
    `optional`: trailing `=None` arguments the graph was captured without (given, the original ops run)."""
    graph = plan.graph
    hoist = plan_hoist(plan)
    state_names = {n.name: _state_expr(state, str(n.target), n.op) for n in graph.state}
    names = dict(state_names)
    for node in graph.inputs:
        names[node.name] = arg_names[int(node.target)]  # type: ignore[arg-type]
    args = ", ".join(arg_names)
    params = ", ".join(["self", *arg_names, *(f"{o}=None" for o in optional)])
    if plan.graphed:  # forward replays the graph; the plan's kernels run from _fused_forward, guard checked before
        out = [f"def _fused_forward(self, {args}):" if args else "def _fused_forward(self):",
               '    """The plan\'s kernels one by one: what the CUDA graph captures."""']
    else:
        out = [f"def forward({params}):",
               '    """Fused kernels on the captured shapes; the original ops otherwise (see _use_kernels)."""']
    if guarded and not plan.graphed:
        given = "".join(f"{o} is not None or " for o in optional)
        out.append(f"    if {given}not _use_kernels(self, ({args}{',' if len(arg_names) == 1 else ''})):")
        out.append(f"        return self._reference_forward({', '.join([*arg_names, *optional])})")
    if has_kernels:
        out.append("    ext = _extension()")
    if any(isinstance(a, torch.device) for n in graph.nodes for a in _flat(n.args)):
        first = arg_names[0] if arg_names else "next(self.parameters())"
        out.append(f"    _device = {first}.device")
    if hoist.cached:
        out.append(f"    {cached_tuple(hoist)} = self._weights()  # computed once per weight version")
        names.update({n: f"v_{n}" for n in hoist.cached})
    for step in plan.steps:
        if step_out(step) not in hoist.skipped:
            out += _step_lines(graph, step, names)
    results = ", ".join(names[r.name] for r in graph.outputs)
    out.append(f"    return {results}")
    text = "\n".join(out) + "\n"
    if plan.graphed:
        text = graphed_forward_source(arg_names, optional, "_fused_forward") + "\n" + text
    if hoist.cached:
        text += "\n" + weight_methods(hoist, state_names, lambda s, n: _step_lines(graph, s, n), has_kernels)
    return text


def _step_lines(graph, step: Step, names: dict[str, str]) -> list[str]:
    """One plan step as lines of a method body; `names` gains the variable holding its value."""
    if isinstance(step, TorchStep):
        names[step.node.name] = f"v_{step.node.name}"
        return [f"    v_{step.node.name} = {_call(step.node, names)}"]
    if isinstance(step, GenStep):
        return _generated_lines(graph, step, names)
    return _fused_lines(graph, step, names)


def _fused_lines(graph, step: FusedStep, names: dict[str, str]) -> list[str]:
    anchor = step.anchor
    node = anchor.node
    lines = [f"    # {step.kernel}: {step.chain(graph)}"]
    if anchor.epilogue_inside:
        return lines + _generated_anchor_lines(graph, step, names)
    acc = f"v_{node.name}" if not step.needs_kernel else "acc"
    if anchor.family == "conv":
        x, w, b = (_py(a, names) for a in node.args[:3])
        stride, padding, dilation, transposed, output_padding, groups = node.args[3:9]
        if anchor.layout == "nhwc":
            x_meta = graph[node.args[0]].meta
            x = f"ext.to_channels_last({x}{'' if x_meta.is_contiguous else '.contiguous()'})"
            fmt = channels_last_format(node.meta)
            w = f"{w}.contiguous(memory_format={fmt})"
            then = ("the reduction kernel reads its channels-last output" if step.keeps_layout
                    else "the epilogue writes NCHW back")
            lines.append(f"    # channels-last convolution (measured faster than NCHW here); {then}")
        if anchor.fused_relu:
            call = f"torch.cudnn_convolution_relu({x}, {w}, {b}, {list(stride)}, {list(padding)}, {list(dilation)}, {groups})"
            lines.append("    # cuDNN fused convolution + bias + ReLU")
        else:
            call = (f"torch.convolution({x}, {w}, {b}, {list(stride)}, {list(padding)}, {list(dilation)}, {transposed}, "
                    f"{list(output_padding)}, {groups})")
    elif anchor.tf32:
        lines.append("    # cuBLAS with TF32 tensor cores: the tf32 precision policy allows it")
        call = f"_with_tf32(lambda: {_call(node, names)})"
    else:
        call = _call(node, names)
    if anchor.fp32:
        lines.append("    # cuDNN's TF32 off for this call: eager's NCHW convolution computes in full fp32 on this GPU")
        call = f"_without_tf32(lambda: {call})"
    if step.keeps_layout:  # cuDNN returns channels-last for channels-last operands; the reader's kernel needs it
        call = f"{call}.contiguous(memory_format={channels_last_format(node.meta)})"
    lines.append(f"    {acc} = {call}")
    if step.needs_kernel:
        operands = "".join(f", {_py(o.ref, names)}" for o in step.epilogue.operands)
        where = "in place" if step.inplace else "into a new NCHW tensor"
        what = "; ".join(str(s) for s in step.epilogue.statements) or "layout change only"
        lines.append(f"    # epilogue kernel {step.kernel} ({where}): {what}")
        lines.append(f"    v_{step.out} = ext.{step.kernel}({acc}{operands})")
    elif acc != f"v_{step.out}":
        lines.append(f"    v_{step.out} = {acc}")
    names[step.out] = f"v_{step.out}"
    return lines


def _generated_anchor_lines(graph, step: FusedStep, names: dict[str, str]) -> list[str]:
    """One call of kernelfuse's own anchor kernel: the convolution and its epilogue, the output written once."""
    node = step.anchor.node
    x, w, b = (_py(a, names) for a in node.args[:3])
    if not graph[node.args[0]].meta.is_contiguous:
        x = f"{x}.contiguous()"
    operands = "".join(f", {_py(o.ref, names)}" for o in step.epilogue.operands)
    what = "; ".join(str(s) for s in step.epilogue.statements) or "no epilogue"
    names[step.out] = f"v_{step.out}"
    precision = "3xTF32: fp32 accuracy, as eager's call" if step.anchor.fp32 else "TF32, as eager's cuDNN call"
    return [f"    # implicit-GEMM convolution ({precision}), epilogue inside: {what}",
            f"    v_{step.out} = ext.{step.kernel}({x}, {w}.contiguous(), {b}{operands})"]


def _generated_lines(graph, step: GenStep, names: dict[str, str]) -> list[str]:
    """One call of a generated kernel; the comment names the ops it computes and its algorithm."""
    args = ", ".join(_py(ref, names) for _, ref in tensor_args(step))
    names[step.out] = f"v_{step.out}"
    return [f"    # {step.kernel}: {step.chain(graph)}  ({step.family} kernel)",
            f"    v_{step.out} = ext.{step.kernel}({args})"]


def _call(node: Node, names: dict[str, str]) -> str:
    plain = [a for a in node.args if not (isinstance(a, tuple) and len(a) == 3 and a[0] == "kw")]
    kwargs = [a for a in node.args if isinstance(a, tuple) and len(a) == 3 and a[0] == "kw"]
    if node.op in PY_SPELLING and not kwargs and len(plain) == PY_SPELLING[node.op].count("{"):
        return PY_SPELLING[node.op].format(*(_py(a, names) for a in plain))
    args = [_py(a, names) for a in plain] + [f"{k}={_py(v, names)}" for _, k, v in kwargs]
    packet, overload = node.op.split(".")
    return f"torch.ops.aten.{packet}.{overload}({', '.join(args)})"


def _state_expr(state: str, path: str, kind: str) -> str:
    """`self.gemm.weight`, or `self.get_parameter("0.weight")` where a part is no identifier (nn.Sequential)."""
    if all(part.isidentifier() for part in path.split(".")):
        return f"{state}.{path}"
    getter = "get_parameter" if kind == "param" else "get_buffer"
    return f"{state}.{getter}({path!r})"


def _flat(args: tuple) -> list[object]:
    out: list[object] = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, tuple) else [a])
    return out


def _py(a: object, names: dict[str, str]) -> str:
    if isinstance(a, Ref):
        return names[a.name]
    if isinstance(a, tuple):
        return "[" + ", ".join(_py(x, names) for x in a) + "]"
    if isinstance(a, torch.device):
        return "_device"  # captured on CPU fake tensors: the run-time device is the inputs' (set in forward)
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return f"float('{a}')"
    return repr(a)
