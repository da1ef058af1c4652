"""Static signals that a candidate may pass while running no kernel of its own, read from its source.

A judge that checks outputs and times forwards finds an honest PyTorch program correct: a ModelNew that subclasses
the reference, one whose kernel build or launch fails inside a try/except that then calls torch, one that hands the
forward to torch.compile, or a plain PyTorch rewrite. None of these is a custom kernel. The signals name each case
with its line; on a GPU the profiler's kernel accounting (kernelfuse.judge.accounting) says what actually ran, and
without one `--require-custom-kernel` fails a candidate on these signals alone.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass
from typing import Any

SUBCLASS, FALLBACK, COMPILER, NO_SOURCE = "subclasses_reference", "fallback_to_torch", "compiler", "no_kernel_source"
BUILD_CALLS = {"load_inline", "CDLL", "PyDLL", "LoadLibrary", "load_library", "RawKernel", "RawModule", "SourceModule"}
KERNEL_DECORATORS = {"triton.jit", "triton.autotune", "cute.kernel", "cute.jit", "cuda.jit", "numba.cuda.jit"}
TORCH_PREFIXES = ("torch.", "F.", "nn.", "super.", "super().")


@dataclass(frozen=True)
class Signal:
    """One static sign of a bypass: its code, the candidate line (0 for the whole file) and what it means."""

    code: str
    line: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bypass_signals(tree: ast.Module, line_offset: int = 0) -> tuple[Signal, ...]:
    """Every bypass signal in a parsed candidate (line numbers shifted by `line_offset`)."""
    signals = _subclass(tree, line_offset) + _compiler(tree, line_offset) + _fallbacks(tree, line_offset)
    if not _has_kernel_source(tree):
        signals.append(Signal(NO_SOURCE, 0, "no custom kernel source (no load_inline/cpp_extension build, no "
                              "ctypes-loaded library, no Triton or CuTe kernel, no __global__ code): a pure-PyTorch "
                              "rewrite"))
    return tuple(signals)


def dotted(node: ast.AST) -> str:
    """`torch.nn.functional.relu` for the expression naming it ("" for anything else; `super()` as "super")."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    if isinstance(node, ast.Call):
        return dotted(node.func)
    return ""


def _subclass(tree: ast.Module, offset: int) -> list[Signal]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            bases = [dotted(b) for b in node.bases]
            if any(b == "Model" or b.endswith(".Model") for b in bases):
                return [Signal(SUBCLASS, node.lineno + offset, "ModelNew subclasses the reference Model: what it "
                               "inherits runs the reference's own PyTorch code")]
        if isinstance(node, ast.Assign) and dotted(node.value) == "Model" and any(
                isinstance(t, ast.Name) and t.id == "ModelNew" for t in node.targets):
            return [Signal(SUBCLASS, node.lineno + offset, "ModelNew is the reference Model itself")]
    return []


def _compiler_names(tree: ast.Module) -> set[str]:
    """Local names bound to torch.compile or torch.jit (`from torch import compile`, `import torch.jit as jit`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.jit", "torch._dynamo"):
            names.update(a.asname or a.name for a in node.names
                         if node.module != "torch" or a.name in ("compile", "jit", "_dynamo"))
    return names


def _compiler(tree: ast.Module, offset: int) -> list[Signal]:
    local = _compiler_names(tree)
    out = []
    for node in ast.walk(tree):
        targets = [node.func] if isinstance(node, ast.Call) else list(getattr(node, "decorator_list", []))
        for target in targets:
            name = dotted(target)
            head = name.split(".")[0]
            if name == "torch.compile" or name.startswith(("torch.jit.", "torch._dynamo.")) or head in local:
                out.append(Signal(COMPILER, node.lineno + offset, f"calls {name}: its work runs in kernels the "
                                  "compiler generates, not the candidate's own"))
    return out[:1]


def _fallbacks(tree: ast.Module, offset: int) -> list[Signal]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        builds = any(_is_build_call(c) for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Call))
        for handler in node.handlers:
            if _reraises(handler):
                continue
            calls = [dotted(c.func) for stmt in handler.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            torch_calls = [c for c in calls if c.startswith(TORCH_PREFIXES) or c in ("super", "self.forward")
                           or (c.startswith("self.") and c.count(".") == 1)]
            if torch_calls:
                out.append(Signal(FALLBACK, handler.lineno + offset, f"a try/except falls back to PyTorch "
                                  f"({torch_calls[0]}) when the code it guards fails: the kernel may never run"))
            elif builds:
                out.append(Signal(FALLBACK, handler.lineno + offset, "a try/except swallows a failed kernel build: "
                                  "the candidate may then run without it"))
    return out


def _reraises(handler: ast.ExceptHandler) -> bool:
    """The handler raises again, or moves on to the loop's next attempt (trying library names one by one)."""
    return bool(handler.body) and isinstance(handler.body[-1], (ast.Raise, ast.Continue))


def _is_build_call(call: ast.Call) -> bool:
    name = dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    return last in BUILD_CALLS or name.endswith("cpp_extension.load")


def _is_kernel_decorator(deco: ast.AST) -> bool:
    name = dotted(deco)
    return name in KERNEL_DECORATORS or any(name.endswith("." + d) for d in KERNEL_DECORATORS)


def kernel_functions(tree: ast.Module) -> set[str]:
    """Names of the functions decorated as GPU kernels (Triton, CuTe, Numba): a DSL may decorate the name it gives
    the compiled kernel (CuTe's `kernel_cutlass_<name>_...`)."""
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(_is_kernel_decorator(d) for d in n.decorator_list)}


def _has_kernel_source(tree: ast.Module) -> bool:
    builders = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").endswith("cpp_extension") for a in n.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "__global__" in node.value:
            return True
        if isinstance(node, ast.Call) and (_is_build_call(node) or dotted(node.func) in builders):
            return True
        if any(_is_kernel_decorator(d) for d in getattr(node, "decorator_list", [])):
            return True
    return False
