"""Emit in process: wrap a live nn.Module with the plan's fused forward (the Python API's counterpart of a file).

The wrapper runs exactly the code an emitted file would: the same loader text and the same generated forward,
executed in a fresh namespace, with the wrapped module's state read through `self.inner`.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import textwrap

import torch

from kernelfuse.codegen import CudaSources
from kernelfuse.codegen.binding import runtime_source
from kernelfuse.emit.modelnew import LOADER, forward_source, runtime_text
from kernelfuse.plan.ir import Plan

WRAPPER = '''
class FusedModule(torch.nn.Module):
    """{doc}"""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def _reference_forward(self, *args):
        return self.inner(*args)

{forward}
'''


def build_module(model: torch.nn.Module, plan: Plan, sources: CudaSources | None,
                 arg_names: list[str]) -> torch.nn.Module:
    """A module whose forward runs `plan` (its kernels built now), falling back to `model` like a ModelNew."""
    specs = [(tuple(n.meta.shape), n.meta.dtype) for n in plan.graph.inputs]
    namespace = _namespace(INPUT_SPECS=specs, CAPTURED_TRAINING=plan.graph.training)
    if sources is not None:
        namespace.update(NAME=type(model).__name__.lower(), CUDA_SRC=sources.cuda)
    exec(compile(runtime_text(plan, sources), "<kernelfuse runtime>", "exec"), namespace)  # noqa: S102 - our own generated code
    forward = forward_source(plan, arg_names, sources is not None, True, state="self.inner")
    doc = plan.summary().replace('"""', "'''").replace("\n", "\n    ")
    code = WRAPPER.format(doc=doc, forward=textwrap.indent(forward, "    "))
    exec(compile(code, f"<kernelfuse {type(model).__name__}>", "exec"), namespace)  # noqa: S102
    if sources is not None:
        namespace["_extension"]()  # type: ignore[operator]
    return namespace["FusedModule"](model)  # type: ignore[operator]


def load_kernels(sources: CudaSources, name: str) -> object:
    """`sources`' kernels built now (or loaded from torch's cache) behind the emitted `_Kernels` methods, for
    measuring kernels outside a model (benchmarks)."""
    namespace = _namespace(NAME=name, CUDA_SRC=sources.cuda)
    exec(compile(LOADER + runtime_source() + sources.binding, "<kernelfuse kernels>", "exec"), namespace)  # noqa: S102
    return namespace["_extension"]()  # type: ignore[operator]


def _namespace(**constants: object) -> dict[str, object]:
    """A fresh namespace with what an emitted file imports, plus its module-level constants."""
    return {"torch": torch, "ctypes": ctypes, "hashlib": hashlib, "inspect": inspect, **constants}


def forward_arg_names(model: torch.nn.Module) -> list[str]:
    """Positional argument names of `model.forward` (plain positional tensors only)."""
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty for p in params):
        raise ValueError(f"{type(model).__name__}.forward must take plain positional tensors to be compiled")
    return [p.name for p in params]
