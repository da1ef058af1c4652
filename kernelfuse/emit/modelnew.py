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

from kernelfuse.codegen import CudaSources
from kernelfuse.emit.calltext import CallText, call_text, output_classes
from kernelfuse.emit.forward import forward_source
from kernelfuse.emit.hoist import shared_constants
from kernelfuse.emit.runtime import CONSTANT_RUNTIME, runtime_text
from kernelfuse.errors import Fallback, ProblemError, Unsupported
from kernelfuse.load import Problem, class_source
from kernelfuse.load.problem import PROBLEM_MODULE_PREFIX
from kernelfuse.plan.ir import Plan

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
