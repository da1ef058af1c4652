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
from kernelfuse.capture.signature import Output, literal
from kernelfuse.codegen import CudaSources
from kernelfuse.codegen.binding import runtime_source
from kernelfuse.codegen.common import channels_last_format
from kernelfuse.codegen.generated import tensor_args
from kernelfuse.emit.calltext import CallText, call_runtime, call_text, output_classes, output_text
from kernelfuse.emit.flags import _with_tf32, _without_tf32, source_of
from kernelfuse.emit.graphed import GRAPH_RUNTIME, graphed_forward_source
from kernelfuse.emit.hoist import cached_tuple, plan_hoist, shared_constants, step_out, weight_methods
from kernelfuse.errors import Fallback, ProblemError, Unsupported
from kernelfuse.load import Problem, class_source
from kernelfuse.load.problem import PROBLEM_MODULE_PREFIX
from kernelfuse.plan.ir import AttnStep, FusedStep, GenStep, Plan, Step, TorchStep

# Readable spellings for common ATen calls; anything else is written `torch.ops.aten.<op>(...)`. A tensor method
# is also half the host time of the `torch.ops` overload (0.7 against 1.4 µs for a view): it counts where a
# forward is launch-bound.
PY_SPELLING = {
    "getitem": "{0}[{1}]",
    "t.default": "{0}.t()",
    "mm.default": "torch.mm({0}, {1})",
    "addmm.default": "torch.addmm({0}, {1}, {2})",
    "view.default": "{0}.view({1})",
    "unsqueeze.default": "{0}.unsqueeze({1})",
    "squeeze.dim": "{0}.squeeze({1})",
    "transpose.int": "{0}.transpose({1}, {2})",
    "permute.default": "{0}.permute({1})",
    "expand.default": "{0}.expand({1})",
    "select.int": "{0}.select({1}, {2})",
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
                # only the KF_EXPORT launchers leave the library: torch loads it RTLD_GLOBAL, where two files' equal
                # template kernels would otherwise resolve to one library's copy (a launch then fails)
                extra_cuda_cflags=["-O3", "-Xcompiler", "-fvisibility=hidden"],
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

# The guard any fused forward needs, with or without custom kernels (library-only fusions such as
# torch.cudnn_convolution_relu also run only on CUDA tensors and have no backward), and the count of the calls it
# let through and declined: a user can read whether the kernels run (kernelfuse_stats), and is warned once per kind
# of reason when they do not. Declined for autograd is counted, not warned: training runs the original ops by design.
GUARD = '''
class KernelfuseFallbackWarning(UserWarning):
    """A call ran the original ops, not the fused kernels (once per module and kind of reason; filter it by class)."""


def _module_tree(module):
    """(whether a submodule's train/eval mode differs from CAPTURED_TRAINING, whether a parameter is off CUDA,
    whether a parameter requires grad), in one walk over the tree: modules() and parameters() build a prefixed
    name for every entry and cost several µs even on a module without children, on every call."""
    mode_differs = off_cuda = trainable = False
    seen, stack = set(), [module]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        mode_differs = mode_differs or m.training != CAPTURED_TRAINING
        for p in m._parameters.values():
            if p is not None:
                off_cuda = off_cuda or not p.is_cuda
                trainable = trainable or p.requires_grad
        stack.extend(m._modules.values())
    return mode_differs, off_cuda, trainable


def _fallback_reason(module, inputs):
    """None where the fused path serves the call, else why not, as (kind, words). The kernels serve inference (no
    autograd) on contiguous CUDA tensors of the captured shapes and dtypes, in the captured train/eval mode
    (INPUT_SPECS; CAPTURED_TRAINING, or CAPTURED_MODES per module where the modes were mixed). Kinds: "mode",
    "autograd", "shape", "dtype", "device", "layout" (and "call" from _use_kernels). The words are formatted only
    for a declined call."""
    mode_differs, off_cuda, trainable = _module_tree(module)
    if CAPTURED_MODES is None:
        if mode_differs:
            mode = "training" if CAPTURED_TRAINING else "eval"  # BatchNorm, Dropout...: planned for that mode
            return "mode", (f"training mode differs: the kernels were built for the model and its submodules in {mode} "
                            "mode")
    elif "".join("1" if m.training else "0" for m in module.modules()) != CAPTURED_MODES:
        return "mode", ("training mode differs: the kernels were built for each submodule in the mode it was traced in "
                        f"({CAPTURED_MODES.count('0')} of {len(CAPTURED_MODES)} modules in eval mode, the others in "
                        "training mode)")
    if torch.is_grad_enabled() and (trainable or any(t.requires_grad for t in inputs)):
        return "autograd", "grad mode with trainable parameters or inputs (the kernels have no backward)"
    for t, (name, shape, dtype) in zip(inputs, INPUT_SPECS):
        if t.shape != shape:
            return "shape", f"input {name} has shape {list(t.shape)}, the kernels were built for {list(shape)}"
        if t.dtype != dtype:
            return "dtype", f"input {name} is {t.dtype}, the kernels were built for {dtype}"
        if not t.is_cuda:
            return "device", f"input {name} is a {t.device.type.upper()} tensor, the kernels run on CUDA"
        if not t.is_contiguous():
            return "layout", f"input {name} is not contiguous, the kernels were built for a contiguous one"
    if off_cuda:
        return "device", "a parameter is not on a CUDA device, the kernels run on CUDA"
    return None


def _use_kernels(module, inputs):
    """Whether the fused path serves this call (`inputs`: its tensors; None: its other arguments are not the traced
    ones, see forward's comments), counted in the module's kernelfuse_stats(). The first fallback of each kind warns
    (KernelfuseFallbackWarning), except autograd's: training runs the original ops by design, so it is counted only."""
    calls = module.__dict__.get("_kernelfuse_calls") or _calls(module)
    if inputs is None:  # forward's test of its other arguments failed: no input to read
        why = "call", "the call's structure differs from the traced one (see the comments in forward)"
    else:
        why = _fallback_reason(module, inputs)
    if why is None:
        calls["fused_calls"] += 1
        return True
    kind, words = why
    reasons = calls["fallback_reasons"]
    if kind not in reasons and kind != "autograd":
        import warnings

        warnings.warn(f"kernelfuse: {type(module).__name__} ran the original ops, not its fused kernels: {words} "
                      "(warned once per kind of reason; kernelfuse_stats() counts every call)",
                      KernelfuseFallbackWarning, stacklevel=2)
    reasons[kind] = reasons.get(kind, 0) + 1
    calls["fallback_calls"] += 1
    calls["first_fallback"] = calls["first_fallback"] or words
    calls["last_fallback"] = words
    return False


def _calls(module):
    """The module's call counts, kept in its __dict__ (no parameter, buffer or state_dict entry)."""
    calls = module.__dict__.get("_kernelfuse_calls")
    if calls is None:
        calls = module.__dict__["_kernelfuse_calls"] = {"fused_calls": 0, "fallback_calls": 0, "fallback_reasons": {},
                                                        "first_fallback": None, "last_fallback": None}
    return calls
'''

# The fused module's public method reading those counts (a method of ModelNew and of the in-process FusedModule).
STATS_METHOD = '''
def kernelfuse_stats(self):
    """How this module's calls ran: {"fused_calls": n, "fallback_calls": n, "fallback_reasons": {kind: n},
    "first_fallback": words or None, "last_fallback": words or None}; the kinds are _fallback_reason's."""
    calls = _calls(self)
    return {**calls, "fallback_reasons": dict(calls["fallback_reasons"])}
'''

# Tensors forward makes from literals, made once per device: a copy from the host in every call would wait for
# the GPU (a blocking copy) and could not be captured into a CUDA graph.
CONSTANT_RUNTIME = '''
_CONSTANTS = {}


def _constant(name, values, dtype, shape, device):
    """A tensor forward makes from literals, made on `device` once and shared by every call (no op writes it and
    no output returns it: the emitter checks)."""
    key = (name, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device).reshape(shape)
    return _CONSTANTS[key]
'''


def runtime_text(plan: Plan, sources: CudaSources | None) -> str:
    """The module-level support code a fused forward calls: loader, guard, TF32 helper (as needed)."""
    parts = [LOADER, runtime_source(), sources.binding] if sources is not None else []
    parts.append(GUARD)
    if not plan.graph.call_spec.plain:
        parts.append(call_runtime(plan.graph.call_spec))
    if shared_constants(plan.graph):
        parts.append(CONSTANT_RUNTIME)
    if any(s.anchor.tf32 for s in plan.fused):
        parts.append(source_of(_with_tf32))  # a matmul under the tf32 policy
    if any(s.anchor.fp32 for s in plan.fused):
        parts.append(source_of(_without_tf32))  # a channels-last conv in full fp32
    if plan.graphed:
        parts.append(GRAPH_RUNTIME)
    return "\n\n".join(p.strip("\n") + "\n" for p in parts)


# Names the emitted forward binds or reads besides its parameters (and `v_<node>` values): a parameter of one of
# these names would be shadowed or would shadow them
RESERVED = frozenset({"self", "ext", "acc", "_device", "graph", "out", "torch", "type", "isinstance", "_extension",
                      "_use_kernels", "_fits", "CALL_PATTERNS", "_constant", "_graphed", "_with_tf32", "_without_tf32"})


def check_emittable(problem: Problem) -> None:
    """Before any work, what would stop a fused file being written: no top-level `class Model` to copy is the
    problem file's error (ProblemError); a forward Model inherits instead of defining, or a parameter named like
    a value the fused forward uses, is Unsupported (the original module ships, saying why)."""
    cls = class_source(problem)
    forward = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        raise Unsupported(Fallback("load", f"{cls.name}.forward", "forward is not defined in the class body (inherited "
                                   "or assigned): the fused file replaces the forward the class defines"))
    a = forward.args
    clash = reserved_parameter([x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                                if x is not None][1:])
    if clash:
        raise Unsupported(Fallback("load", f"{cls.name}.forward", clash))


def reserved_parameter(names: list[str]) -> str | None:
    """Why a forward with these parameter names cannot be emitted (one shadows a value of the fused forward)."""
    clash = [n for n in names if n in RESERVED or n.startswith("v_")]
    return f"parameter {clash[0]!r} is a name the fused forward uses for its own values" if clash else None


def emit_modelnew(problem: Problem, plan: Plan, sources: CudaSources | None, report: str) -> str:
    """The text of the ModelNew file for `plan` (`sources` None: the plan needs no custom kernel)."""
    cls = class_source(problem)
    forward = _find_method(cls, "forward", problem)
    call = call_text(plan.graph.call_spec, _header(forward))
    prelude = _problem_without_model(problem, cls)
    header = _docstring(problem, plan, report)
    guarded = sources is not None or bool(plan.fused) or bool(call.test) or plan.graphed
    body = _model_new_class(problem, cls, forward, plan, call, sources is not None, guarded)
    imports = "import ctypes\nimport hashlib\nimport inspect\n" if sources is not None else "import hashlib\nimport inspect\n"
    imports += "".join(f"from {c.__module__} import {c.__qualname__}\n" for c in output_classes(plan.graph.call_spec.output)
                       if not c.__module__.startswith(PROBLEM_MODULE_PREFIX))  # a ModelOutput, say
    parts = [header, imports, prelude.rstrip() + "\n", body]
    if guarded:
        parts.append(runtime_text(plan, sources))
        specs = ", ".join(f"({name!r}, {shape}, {dtype})" for name, shape, dtype in input_specs(plan, call))
        served = "".join(f"# {line}\n" for line in served_calls(plan, call))
        parts.append(f"{served}INPUT_SPECS = [{specs}]  # (input, shape, dtype)\n"
                     f"CAPTURED_TRAINING = {plan.graph.training}\n"
                     f"CAPTURED_MODES = {modes_literal(captured_modes(plan))}{MODES_COMMENT}\n")
    elif shared_constants(plan.graph):  # the captured ops alone (no kernel, no guard) still make their constants once
        parts.append(CONSTANT_RUNTIME)
    if sources is not None:
        parts.append(f"NAME = {problem.name!r}\n")
        parts.append(f'CUDA_SRC = r"""\n{sources.cuda}"""\n')
    return _tidy("\n\n".join(p.strip("\n") + "\n" for p in parts))


MODES_COMMENT = "  # per module of modules() where the modes were mixed: 1 training, 0 eval"


def captured_modes(plan: Plan, wrapper: bool | None = None) -> str | None:
    """CAPTURED_MODES: each module's traced mode where they were mixed (a model holding an eval-mode submodule),
    else None (all in CAPTURED_TRAINING). `wrapper`: the mode of a module wrapping the traced one, first in its
    modules()."""
    graph = plan.graph
    if not graph.mixed_modes:
        return None
    return ("" if wrapper is None else "1" if wrapper else "0") + graph.modes


def modes_literal(modes: str | None) -> str:
    """CAPTURED_MODES as a short Python expression: runs of one mode as "0" * n."""
    if modes is None:
        return "None"
    runs = [(c, len(m.group())) for m in re.finditer(r"0+|1+", modes) for c in [m.group()[0]]]
    return " + ".join(f'"{c}" * {n}' if n > 1 else f'"{c}"' for c, n in runs)


def input_specs(plan: Plan, call: CallText) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """INPUT_SPECS: each graph input's expression in forward (`x`, `extra[0]`), captured shape and dtype."""
    return [(call.tensors[int(n.target)], tuple(n.meta.shape), n.meta.dtype)  # type: ignore[arg-type]
            for n in plan.graph.inputs]


def served_calls(plan: Plan, call: CallText) -> list[str]:
    """In plain words, the calls the fused kernels serve (the guard's conditions) and what happens to the others."""
    mode = ("training mode (as constructed; after model.eval() the original ops run)" if plan.graph.training else
            "eval mode (model.eval(); in training mode the original ops run)")
    if plan.graph.mixed_modes:
        evals = plan.graph.modes.count("0")
        mode = (f"the mode it was traced in ({evals} of {len(plan.graph.modes)} modules in eval mode, the others in "
                "training mode; after model.train() or model.eval() the original ops run)")
    items = [f"input {name}: shape {list(shape)}, {dtype}, contiguous, on a CUDA device"
             for name, shape, dtype in input_specs(plan, call)]
    if call.test:
        items.append("the other arguments as traced (see the comments in forward)")
    items += [f"the model's parameters on a CUDA device, the model and every submodule in {mode}",
              "no autograd: under torch.no_grad() or torch.inference_mode(), or nothing requiring grad"]
    lines = ["The fused kernels run for calls like the traced one:"]
    for item in items:
        lines += textwrap.wrap(item, 108, initial_indent="  - ", subsequent_indent="    ")
    return lines + textwrap.wrap(
        "Any other call runs the original ops (_reference_forward): model.kernelfuse_stats() counts the calls each "
        "way, and a KernelfuseFallbackWarning says why, once per kind of reason; not for autograd (training runs the "
        "original ops by design: counted, not warned).", 112)


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


def _header(forward: ast.FunctionDef) -> str:
    """forward's parameter list after `self`, as its source writes it (annotations and defaults included: the
    emitted forward is defined in the same class body, so its defaults are the original's)."""
    args = ast.arguments(posonlyargs=forward.args.posonlyargs[1:], args=forward.args.args[1:] if not
                         forward.args.posonlyargs else forward.args.args, vararg=forward.args.vararg,
                         kwonlyargs=forward.args.kwonlyargs, kw_defaults=forward.args.kw_defaults,
                         kwarg=forward.args.kwarg, defaults=forward.args.defaults)
    return ast.unparse(args)


def _model_new_class(problem: Problem, cls: ast.ClassDef, forward: ast.FunctionDef, plan: Plan,
                     call: CallText, has_kernels: bool, guarded: bool) -> str:
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
    new_forward = forward_source(plan, call, has_kernels, guarded)
    return text + "\n\n" + textwrap.indent(new_forward, indent)


def forward_source(plan: Plan, call: CallText, has_kernels: bool, guarded: bool, state: str = "self") -> str:
    """The text of the fused `forward` method, and of the weight cache methods it calls (kernelfuse.emit.hoist)
    where the plan computes values from the weights alone; module state is read as `{state}.<attribute path>`.
    `call`: the forward's parameters, where its tensors are, and what its graph was specialised to."""
    graph = plan.graph
    hoist = plan_hoist(plan)
    state_names = {n.name: _state_expr(state, str(n.target), n.op) for n in graph.state}
    names = dict(state_names)
    tensors = call.identifiers() if plan.graphed else list(call.tensors)
    for node in graph.inputs:
        names[node.name] = tensors[int(node.target)]  # type: ignore[arg-type]
    output = graph.call_spec.output
    flat_out = plan.graphed and not _plain_output(output)  # the graph returns its tensors; forward rebuilds
    if plan.graphed:  # forward replays the graph; the plan's kernels run from _fused_forward, guard checked before
        out = [f"def _fused_forward(self, {', '.join(tensors)}):" if tensors else "def _fused_forward(self):",
               '    """The plan\'s kernels one by one: what the CUDA graph captures."""']
    else:
        out = [f"def forward(self, {call.params}):" if call.params else "def forward(self):",
               '    """Fused kernels on the captured shapes; the original ops otherwise (see _use_kernels)."""']
    if guarded and not plan.graphed:
        out += [f"    {c}" for c in call.comments]
        out.append(f"    if not _use_kernels(self, {call.checked}):")
        out.append(f"        return self._reference_forward({call.reference})")
    if has_kernels:
        out.append("    ext = _extension()")
    if any(isinstance(a, torch.device) for n in graph.nodes for a in _flat(n.args)):
        first = tensors[0] if tensors else "next(self.parameters())"
        out.append(f"    _device = {first}.device")
    if hoist.cached:
        out.append(f"    {cached_tuple(hoist)} = self._weights()  # computed once per weight version")
        names.update({n: f"v_{n}" for n in hoist.cached})
    for step in plan.steps:
        if step_out(step) not in hoist.skipped:
            out += _step_lines(graph, step, names)
    results = [names[r.name] for r in graph.outputs]
    if flat_out:
        out.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    else:
        out.append(f"    return {output_text(output, iter(results))}")
    text = "\n".join(out) + "\n"
    if plan.graphed:
        rebuild = output_text(output, (f"out[{i}]" for i in range(len(results)))) if flat_out else None
        text = graphed_forward_source(call, "_fused_forward", rebuild) + "\n" + text
    if hoist.cached:
        text += "\n" + weight_methods(hoist, state_names, lambda s, n: _step_lines(graph, s, n), has_kernels)
    if guarded:
        text += STATS_METHOD
    return text


def _plain_output(output: Output) -> bool:
    """A tensor, or a tuple of tensors: what the graph replay returns as it is."""
    return output.kind == "tensor" or (output.kind == "tuple" and all(o.kind == "tensor" for o in output.items))


def _step_lines(graph, step: Step, names: dict[str, str]) -> list[str]:
    """One plan step as lines of a method body; `names` gains the variable holding its value."""
    if isinstance(step, TorchStep):
        names[step.node.name] = f"v_{step.node.name}"
        if step.node.op == "constant" and step.node.name in shared_constants(graph):
            return [f"    v_{step.node.name} = {_constant_call(step.node)}"]
        return [f"    v_{step.node.name} = {_call(step.node, names)}"]
    if isinstance(step, GenStep):
        return _generated_lines(graph, step, names)
    if isinstance(step, AttnStep):
        return _attention_lines(graph, step, names)
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


def _constant_call(node: Node) -> str:
    """A tensor forward makes from literals, made once per device (see _constant)."""
    return f"_constant({node.name!r}, {literal(node.args[0])}, {node.meta.dtype}, {list(node.meta.shape)}, _device)"


def _attention_lines(graph, step: AttnStep, names: dict[str, str]) -> list[str]:
    """One call of a flash-attention kernel (it reads q, k, v and the mask through their strides), or one torch
    SDPA call on the same tensors viewed as (batch, heads, rows, cols), its result laid out as the step's."""
    names[step.out] = f"v_{step.out}"
    if step.impl == "kernel":
        args = ", ".join(names[i.ref.name] for i in step.inputs)
        return [f"    # {step.kernel}: {step.chain(graph)}  (flash-attention kernel, {step.origin})",
                f"    v_{step.out} = ext.{step.kernel}({args})"]
    batch = step.dims[0]
    q, k, v = (names[i.ref.name] + (".transpose(-2, -1)" if i.swap else "") +
               (f".unflatten(0, ({batch}, -1))" if len(i.meta.shape) == 3 else "") for i in step.inputs[:3])
    kw = [f"scale={step.scale!r}"] + (["is_causal=True"] if step.causal else []) + \
        (["enable_gqa=True"] if step.dims[1] != step.dims[2] else [])
    lines = [f"    # {step.kernel}: {step.chain(graph)}  (torch SDPA call, {step.origin})"]
    if step.mask is not None:
        mask = names[step.mask.ref.name]
        kw.insert(0, f"attn_mask={'~' if step.mask_kind == 'drop' else ''}{mask}")
    lines.append(f"    v_{step.out} = torch.nn.functional.scaled_dot_product_attention({q}, {k}, {v}, {', '.join(kw)})")
    if step.mask is not None and step.empty_nan and step.mask_kind == "drop":  # softmax over no key: NaN, as eager
        lines.append(f"    v_{step.out} = v_{step.out}.masked_fill({mask}.all(-1, keepdim=True), float('nan'))")
    order = tuple(sorted(range(4), key=lambda d: -step.out_strides[d]))  # the output's memory order
    lines.append(f"    v_{step.out} = v_{step.out}.permute{order}.contiguous().view({list(step.out_meta.shape)})")
    return lines


def _call(node: Node, names: dict[str, str]) -> str:
    if node.op == "constant":  # written to or returned: made in every call (capture limits its size)
        return f"torch.tensor({_py(node.args[0], names)}, dtype={node.meta.dtype}, device=_device).reshape({list(node.meta.shape)})"
    plain, kwargs = node.positional, node.keywords
    if node.op in PY_SPELLING and not kwargs and len(plain) == PY_SPELLING[node.op].count("{"):
        return PY_SPELLING[node.op].format(*(_py(a, names) for a in plain))
    args = [_py(a, names) for a in plain] + [f"{k}={_py(v, names)}" for k, v in kwargs.items()]
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
