"""Static checks of a candidate before anything runs: it parses, defines ModelNew, fits Model's constructor.

These need neither a GPU nor a child process, so a CI machine can still say what is wrong with a candidate. Errors
stop the evaluation (nothing could run); warnings are reported alongside the verdict; signals name the ways a
candidate can pass while running no kernel of its own (kernelfuse.judge.bypass), which the GPU's kernel accounting
confirms or clears and which `--require-custom-kernel` acts on where no GPU ran.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from dataclasses import dataclass

from kernelfuse.judge.bypass import Signal, bypass_signals
from kernelfuse.load import Problem
from kernelfuse.load.parsing import parse_source

ALLOWED_TOP_LEVEL = {"torch", "__future__"}
OLD_STANDARD = re.compile(r"-std=(?:c|gnu)\+\+(?:98|03|0x|11|1y|14)\b")


@dataclass(frozen=True)
class StaticReport:
    """What the source says before it runs: fatal errors, warnings, and ModelNew's constructor parameters."""

    errors: tuple[str, ...]
    warnings: tuple[str, ...]
    init_params: tuple[str, ...] | None
    signals: tuple[Signal, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


def static_check(source: str, problem: Problem, line_offset: int = 0) -> StaticReport:
    """Parse `source` and check it against `problem` (line numbers are shifted by `line_offset` in messages)."""
    try:
        tree = parse_source(source)
    except SyntaxError as err:
        line = (err.lineno or 0) + line_offset
        text = (err.text or "").strip()
        return StaticReport((f"syntax error at line {line}: {err.msg}" + (f": {text}" if text else ""),), (), None)
    errors: list[str] = []
    warnings: list[str] = []
    model_new = _find_model_new(tree)
    if model_new is None:
        errors.append("no top-level ModelNew defined (a candidate must define class ModelNew(nn.Module))")
    init_params = None
    if isinstance(model_new, ast.ClassDef):
        init_params = _init_params(model_new)
        warnings += _signature_warnings(init_params, problem)
        if not any(isinstance(n, ast.FunctionDef) and n.name == "forward" for n in model_new.body):
            warnings.append("ModelNew defines no forward() of its own (it must inherit one)")
    warnings += _import_warnings(tree)
    warnings += _flag_warnings(tree, line_offset)
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    ignored = sorted(defined & {"get_inputs", "get_init_inputs"})
    if ignored:
        warnings.append(f"the candidate's own {' and '.join(ignored)} are ignored: the problem's are used")
    return StaticReport(tuple(errors), tuple(warnings), init_params, bypass_signals(tree, line_offset))


def _find_model_new(tree: ast.Module) -> ast.AST | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ModelNew" for t in node.targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name) == "ModelNew" for a in node.names
        ):
            return node
    return None


def _init_params(cls: ast.ClassDef) -> tuple[str, ...] | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args][1:]
            if args.vararg:
                names.append("*" + args.vararg.arg)
            names += [a.arg for a in args.kwonlyargs]
            if args.kwarg:
                names.append("**" + args.kwarg.arg)
            return tuple(names)
    return None


def _signature_warnings(params: tuple[str, ...] | None, problem: Problem) -> list[str]:
    if params is None:
        return []
    try:
        ref = [p for p in inspect.signature(problem.model_cls.__init__).parameters][1:]
    except (TypeError, ValueError):
        return []
    ref_display = tuple(ref)
    if tuple(params) == ref_display:
        return []
    positional = [p for p in params if not p.startswith("*")]
    if any(p.startswith("*") for p in params) or len(positional) == len(ref):
        return [f"ModelNew.__init__({', '.join(params)}) differs in names from Model.__init__({', '.join(ref)}); "
                "get_init_inputs() is passed positionally"]
    return [f"ModelNew.__init__({', '.join(params)}) does not match Model.__init__({', '.join(ref)}): "
            "it is called with get_init_inputs() positionally and will likely fail"]


def _import_warnings(tree: ast.Module) -> list[str]:
    stdlib = set(getattr(sys, "stdlib_module_names", ())) | ALLOWED_TOP_LEVEL
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    outside = sorted(n for n in names if n not in stdlib)
    if outside:
        return [f"imports {', '.join(outside)}: a candidate should need only torch and the standard library"]
    return []


def _flag_warnings(tree: ast.Module, line_offset: int) -> list[str]:
    """Compiler flags that are known to break a torch extension build (seed 003's -std=c++14)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = OLD_STANDARD.search(node.value)
            if m:
                out.append(f"line {node.lineno + line_offset}: {m.group(0)} requested, but torch's headers need "
                           "C++17 or later: the extension build will fail")
    return out
