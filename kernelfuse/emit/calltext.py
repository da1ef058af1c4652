"""The emitted forward's signature, its guard on the call, and the structure it returns, from the captured CallSpec.

Plain forwards (positional tensors, then `=None` parameters left None) keep the short form: `forward(self, x,
mask=None)` and `if not _use_kernels(self, (x,) if mask is None else None)`. Any other forward keeps the original's
parameter list (annotations, defaults, keyword-only, *args, **kwargs) and tests each argument against the traced
one: a Python value the graph was traced with (a float, an int, a flag, None) is specialised (`type(s) is float
and s == 3.5`), so another value or type runs the original ops; a tuple, list or dict must match CALL_PATTERNS, the
container as traced with each tensor replaced by `_TENSOR` (`_fits`). Tensors inside containers are read where
they sit (`pair[0]`). A call that is not the traced one hands `_use_kernels` None for its inputs (counted, with
its reason), and its tensors are not read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from kernelfuse.capture.signature import CallSpec, Output, Param, literal

# The run-time support of a specialised call (module level of the emitted file, or of the in-process namespace).
CALL_RUNTIME = '''
class _Tensor:
    """Stands for a tensor in CALL_PATTERNS: any tensor fits there (_fallback_reason checks its shape and dtype)."""


_TENSOR = _Tensor()


def _fits(value, pattern):
    """Is a forward argument the one the kernels were traced with: the same container structure, a tensor where
    the capture had one, and every other value equal and of the same type (the graph was specialised to it)?"""
    if pattern is _TENSOR:
        return isinstance(value, torch.Tensor)
    if type(value) is not type(pattern):
        return False
    if isinstance(pattern, (tuple, list)):
        return len(value) == len(pattern) and all(_fits(v, p) for v, p in zip(value, pattern))
    if isinstance(pattern, dict):
        return list(value) == list(pattern) and all(_fits(value[k], p) for k, p in pattern.items())
    return value == pattern
'''


@dataclass(frozen=True)
class CallText:
    """The pieces of the emitted forward that depend on how it is called."""

    params: str  # parameter list after `self`
    tensors: tuple[str, ...]  # an expression per graph input, over the parameters (`x`, `pair[0]`)
    reference: str  # the arguments that pass the call on to _reference_forward unchanged
    test: str  # the condition that the call is the captured one ("" where any call fits)
    comments: tuple[str, ...] = ()  # what the fused path is specialised to

    @property
    def fits(self) -> str:
        """The prefix `<test> and ` ("" where any call fits) of a condition that holds on the captured call only."""
        return f"{self.test} and " if self.test else ""

    @property
    def checked(self) -> str:
        """What forward hands `_use_kernels`: the graph inputs where the call is the captured one, else None (the
        inputs are not read: `extra[0]` may not exist)."""
        return f"{self.inputs} if {self.test} else None" if self.test else self.inputs

    @property
    def inputs(self) -> str:
        """The graph inputs as a tuple expression."""
        return "(" + ", ".join(self.tensors) + ("," if len(self.tensors) == 1 else "") + ")"

    def identifiers(self) -> list[str]:
        """A parameter name per graph input (the graphed variant's `_fused_forward` takes them one by one)."""
        out: list[str] = []
        for path in self.tensors:
            name = re.sub(r"\W+", "_", path).strip("_") or "t"
            while name in out:
                name += "_"
            out.append(name)
        return out


def call_text(call: CallSpec, header: str) -> CallText:
    """The call's text; `header`: the original forward's parameter list after `self` (the plain form writes its
    own)."""
    if call.plain:
        names = [p.name for p in call.params]
        optional = [p.name for p in call.params if not p.is_tensor]
        params = ", ".join(n if n not in optional else f"{n}=None" for n in names)
        test = " and ".join(f"{o} is None" for o in optional)
        return CallText(params, tuple(n for n in names if n not in optional), ", ".join(names), test)
    conditions = [c for c in map(_condition, call.params) if c]
    test = " and ".join(conditions)
    comments = tuple(f"# {p.name}: {_describe(p)}" for p in call.params if not p.is_tensor)
    return CallText(header, tuple(call.tensor_paths()), ", ".join(_passed(p) for p in call.params), test, comments)


def call_runtime(call: CallSpec) -> str:
    """Module-level support for the containers a call was traced with ("" where it had none)."""
    patterns = {p.name: p.pattern for p in call.params if _container(p)}
    if not patterns:
        return ""
    note = "# container arguments as traced; _TENSOR: any tensor (see _fits)"
    return f"{CALL_RUNTIME}\n\n{note}\nCALL_PATTERNS = {literal(patterns)}\n"


def _condition(p: Param) -> str | None:
    """The Python test that an argument is the traced one (None: any value serves, a tensor checked later).
    Scalars are tested inline (a fraction of a microsecond), containers by `_fits`."""
    if p.is_tensor:
        return f"isinstance({p.name}, torch.Tensor)" if p.has_default else None
    if p.pattern is None or type(p.pattern) is bool:
        return f"{p.name} is {p.pattern!r}"
    if not _container(p):
        return f"type({p.name}) is {type(p.pattern).__name__} and {p.name} == {literal(p.pattern)}"
    return f"_fits({p.name}, CALL_PATTERNS[{p.name!r}])"


def _container(p: Param) -> bool:
    return type(p.pattern) in (tuple, list, dict)


def output_text(out: Output, names: Iterator[str], top: bool = True) -> str:
    """The expression rebuilding forward's returned structure from the graph's output values (`names`, in order);
    a namedtuple's or dict subclass's class by its name (defined in the emitted file, or imported at its top)."""
    def sub(o: Output) -> str:
        return output_text(o, names, top=False)

    if out.kind == "tensor":
        return next(names)
    if out.kind == "constant":
        return literal(out.value)
    if out.kind == "tuple":
        items = [sub(o) for o in out.items]
        if top and len(items) > 1:
            return ", ".join(items)
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if out.kind == "list":
        return "[" + ", ".join(sub(o) for o in out.items) + "]"
    if out.kind == "dict":
        return "{" + ", ".join(f"{k!r}: {sub(o)}" for k, o in zip(out.keys, out.items, strict=True)) + "}"
    assert out.cls is not None
    if out.kind == "namedtuple":
        return f"{out.cls.__qualname__}(" + ", ".join(sub(o) for o in out.items) + ")"
    keywords = ", ".join(f"{k}={sub(o)}" for k, o in zip(out.keys, out.items, strict=True))
    return f"{out.cls.__qualname__}({keywords})"


def output_classes(out: Output) -> list[type]:
    """The namedtuple and dict-subclass classes the returned structure is built from, each once."""
    found = [out.cls] if out.cls is not None else []
    for item in out.items:
        found += [c for c in output_classes(item) if c not in found]
    return found


def _describe(p: Param) -> str:
    if p.pattern is None:
        return "None as traced (given, the original ops run)"
    kind = type(p.pattern).__name__
    if kind in ("tuple", "list", "dict"):
        return f"a {kind} as traced, tensors where _TENSOR stands (another structure or value: the original ops)"
    return f"specialised to {literal(p.pattern)} as traced (another value: the original ops)"


def _passed(p: Param) -> str:
    return {"positional": p.name, "varargs": f"*{p.name}", "kwonly": f"{p.name}={p.name}",
            "varkw": f"**{p.name}"}[p.kind]
