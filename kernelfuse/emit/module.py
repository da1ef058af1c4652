"""Emit in process: wrap a live nn.Module with the plan's fused forward (the Python API's counterpart of a file).

The wrapper runs exactly the code an emitted file would: the same loader text, guard and call counts, and the same
generated forward (with `kernelfuse_stats()`), executed in a fresh namespace, with the wrapped module's state read
through `self.inner`.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import textwrap

import torch

from kernelfuse.capture.signature import forward_signature
from kernelfuse.codegen import CudaSources
from kernelfuse.codegen.binding import runtime_source
from kernelfuse.emit.calltext import call_text, output_classes
from kernelfuse.emit.forward import forward_source
from kernelfuse.emit.modelnew import captured_modes, input_specs, served_calls
from kernelfuse.emit.runtime import LOADER, runtime_text
from kernelfuse.plan.ir import Plan

WRAPPER = '''
class FusedModule(torch.nn.Module):
    """{doc}"""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.training = inner.training  # the wrapper is in the mode of the model it wraps (the guard checks both)

    def _reference_forward(self, *args, **kwargs):
        if AUTOCAST is None:
            return self.inner(*args, **kwargs)
        with torch.autocast("cuda", dtype=AUTOCAST):  # the model as it was captured: under CUDA autocast
            return self.inner(*args, **kwargs)

{forward}
'''


def build_module(model: torch.nn.Module, plan: Plan, sources: CudaSources | None) -> torch.nn.Module:
    """A module whose forward runs `plan` (its kernels built now), falling back to `model` like a ModelNew; its
    forward takes the arguments `model.forward` takes, with the same defaults. A plan captured under CUDA
    autocast carries autocast's casts itself; its fallback runs `model` under the same autocast."""
    call = plan.graph.call_spec
    header, defaults = _header(model)
    text = call_text(call, header)
    namespace = _namespace(INPUT_SPECS=input_specs(plan, text), CAPTURED_TRAINING=plan.graph.training,
                           CAPTURED_MODES=captured_modes(plan, wrapper=model.training),
                           _DEFAULTS=defaults, AUTOCAST=plan.graph.autocast,
                           **{c.__qualname__: c for c in output_classes(call.output)})
    if sources is not None:
        namespace.update(NAME=type(model).__name__.lower(), CUDA_SRC=sources.cuda)
    exec(compile(runtime_text(plan, sources), "<kernelfuse runtime>", "exec"), namespace)  # noqa: S102 - our own generated code
    forward = forward_source(plan, text, sources is not None, True, state="self.inner")
    doc = "\n".join([plan.summary(), "", *served_calls(plan, text)]).replace('"""', "'''").replace("\n", "\n    ")
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


def _header(model: torch.nn.Module) -> tuple[str, dict[str, object]]:
    """`model.forward`'s parameter list as text, each default read from `_DEFAULTS` (the same objects), and those
    defaults by name."""
    parts: list[str] = []
    defaults: dict[str, object] = {}
    star = False  # a bare `*` or *args written: later parameters are keyword-only
    params = list(forward_signature(model).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            if p.default is not p.empty:
                defaults[p.name] = p.default
            parts.append(p.name if p.default is p.empty else f"{p.name}=_DEFAULTS[{p.name!r}]")
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return ", ".join(parts), defaults
