"""How forward is called: which arguments are the graph's tensors, which are values the graph was specialised to,
and how the graph's flat outputs rebuild what forward returns.

The graph reads a flat list of tensors. A forward argument is a tensor, a Python value (a number, a string, None:
traced with its value, so the fused forward serves only calls with that same value), or a tuple, list or dict of
those. Each argument is recorded as a *pattern*: the value as captured with every tensor replaced by `TENSOR`, so
the fused forward can check a call against it and the CPU check can rebuild the call from flat tensors. The
returned value is recorded as an `Output` tree (tuples, lists, dicts, namedtuples, dict subclasses built from
keywords such as transformers' ModelOutput, tensors and constants). Anything else is `Unsupported`, found here,
before any planning, so the original module ships with the reason.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kernelfuse.errors import Fallback, ProblemError, Unsupported

# Python values a graph may be specialised to: each is written as a literal and compared with `==` (and its type)
LITERALS = (bool, int, float, str, type(None))
KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "varargs",
    inspect.Parameter.KEYWORD_ONLY: "kwonly",
    inspect.Parameter.VAR_KEYWORD: "varkw",
}


class _Tensor:
    """Stands for a tensor in a pattern; its repr is the name the emitted file gives the same marker."""

    def __repr__(self) -> str:
        return "_TENSOR"

    def __reduce__(self) -> str:
        return "TENSOR"  # pickled and deep-copied as the one marker


TENSOR = _Tensor()


@dataclass(frozen=True)
class Param:
    """One parameter of forward and the value it was captured with (`pattern`)."""

    name: str
    kind: str  # "positional" | "varargs" (*args) | "kwonly" | "varkw" (**kwargs)
    pattern: Any
    default_none: bool = False  # declared `=None`
    has_default: bool = False  # declared with any default

    @property
    def is_tensor(self) -> bool:
        return self.pattern is TENSOR


@dataclass(frozen=True)
class Output:
    """The shape of what forward returns: a tensor slot, a constant, or a container of outputs."""

    kind: str  # "tensor" | "constant" | "tuple" | "list" | "dict" | "namedtuple" | "mapping" (a dict subclass)
    value: Any = None  # a constant's value
    cls: type | None = None  # the namedtuple or dict subclass
    keys: tuple = ()  # dict and mapping keys
    items: tuple[Output, ...] = ()

    def tensors(self, value: Any) -> list[torch.Tensor]:
        """The tensors of a value with this structure, in graph output order."""
        if self.kind == "tensor":
            return [value]
        if self.kind == "constant":
            return []
        values = [value[k] for k in self.keys] if self.keys else list(value)
        return [t for item, v in zip(self.items, values, strict=True) for t in item.tensors(v)]


@dataclass(frozen=True)
class CallSpec:
    """A forward call as captured: its parameters' patterns (tensors in graph input order) and its output."""

    params: tuple[Param, ...]
    output: Output

    @property
    def plain(self) -> bool:
        """Positional tensors without defaults, then `=None` parameters left None: the emitted forward's simple
        form (a tensor parameter with a default, which may be None, is checked to be a tensor in the general one)."""
        n = sum(p.is_tensor for p in self.params)
        return all(p.kind == "positional" for p in self.params) and \
            all(p.is_tensor and not p.has_default for p in self.params[:n]) and \
            all(p.pattern is None and p.default_none for p in self.params[n:])

    def tensor_paths(self) -> list[str]:
        """A Python expression per graph input, over the parameter names: `x`, `pair[0]`, `cfg['mask']`."""
        return [path for p in self.params for path in _paths(p.pattern, p.name)]

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
        """The call's (args, kwargs) with the graph's input tensors put back in their places."""
        it = iter(tensors)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in self.params:
            value = _fill(p.pattern, it)
            if p.kind == "positional":
                args.append(value)
            elif p.kind == "varargs":
                args.extend(value)
            elif p.kind == "kwonly":
                kwargs[p.name] = value
            else:
                kwargs.update(value)
        return args, kwargs

    def run(self, model: torch.nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`model` called as captured on `tensors`; its output's tensors, in graph output order."""
        args, kwargs = self.arguments(tensors)
        return self.output.tensors(model(*args, **kwargs))


def plain_call(inputs: int, outputs: int) -> CallSpec:
    """The call of a graph built without a capture: positional tensors in, a tensor (one output) or a tuple back."""
    out = Output("tensor") if outputs == 1 else Output("tuple", items=(Output("tensor"),) * outputs)
    return CallSpec(tuple(Param(f"x{i}", "positional", TENSOR) for i in range(inputs)), out)


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    """The signature `model(...)` is called with. Dynamo hands over lazy graph modules whose forward is a
    `(*args, **kwargs)` stub until the first call writes the real one: it is written now, so capture binds the
    inputs to the parameters the fused forward is written with."""
    realise = getattr(model, "real_recompile", None)  # a lazy graph module writes its forward on the first call
    if isinstance(model, torch.fx.GraphModule) and callable(realise):
        realise()
    return inspect.signature(model.forward)


def bind(model: torch.nn.Module, inputs: list[Any], what: str) -> tuple[tuple[Param, ...], list[Any]]:
    """forward's parameters bound to `inputs` (positional, as get_inputs() gives them; defaults filled in) as
    patterns, and the tensors among them in order. An input list forward cannot take is the caller's error;
    a value kernelfuse cannot specialise to is Unsupported."""
    try:
        sig = forward_signature(model)
        bound = sig.bind(*inputs)
    except (TypeError, ValueError) as err:
        raise ProblemError(f"{what}: forward{_signature_text(model)} cannot take the {len(inputs)} inputs "
                           f"given: {err}") from None
    bound.apply_defaults()
    params, tensors = [], []
    for p in sig.parameters.values():
        value = bound.arguments[p.name]
        params.append(Param(p.name, KINDS[p.kind], _pattern(value, p.name, tensors), p.default is None,
                            p.default is not p.empty))
    return tuple(params), tensors


def describe_output(value: Any, path: str = "output") -> Output:
    """The structure of what forward returned (traced values: tensors are proxies' results, still tensors)."""
    if isinstance(value, torch.Tensor):
        return Output("tensor")
    if type(value) in LITERALS:
        return Output("constant", value=value)
    if type(value) in (tuple, list):
        return Output(type(value).__name__, items=tuple(describe_output(v, f"{path}[{i}]")
                                                        for i, v in enumerate(value)))
    if isinstance(value, (tuple, dict)) and not type(value).__qualname__.isidentifier():
        raise Unsupported(Fallback("capture", path, f"forward returns a {type(value).__qualname__}, a class the "
                                   "emitted file cannot name (defined inside a function)"))
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return Output("namedtuple", cls=type(value), items=tuple(describe_output(v, f"{path}.{f}")
                                                                for f, v in zip(value._fields, value, strict=True)))
    if isinstance(value, dict) and (type(value) is dict or _keyword_mapping(value)):
        keys = tuple(value.keys())
        kind = "dict" if type(value) is dict else "mapping"
        return Output(kind, cls=None if kind == "dict" else type(value), keys=keys,
                      items=tuple(describe_output(value[k], f"{path}[{k!r}]") for k in keys))
    raise Unsupported(Fallback("capture", path, f"forward returns a {type(value).__name__}: the fused forward "
                               "rebuilds tensors, numbers, strings, None and tuples, lists, dicts, namedtuples "
                               "and keyword-built dict subclasses (ModelOutput) of them"))


def literal(value: Any) -> str:
    """Python source for a pattern or constant (`float('nan')` where repr would not read back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    if type(value) is tuple:
        return "(" + ", ".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if type(value) is list:
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _keyword_mapping(value: dict) -> bool:
    """A dict subclass whose constructor takes its items as keywords (OrderedDict, transformers' ModelOutput)."""
    return all(isinstance(k, str) and k.isidentifier() for k in value) and type(value).__name__ != "defaultdict"


def _pattern(value: Any, path: str, tensors: list[Any]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TENSOR
    if type(value) in LITERALS:
        return value
    if type(value) in (tuple, list):
        return type(value)(_pattern(v, f"{path}[{i}]", tensors) for i, v in enumerate(value))
    if type(value) is dict and all(type(k) in (str, int) for k in value):
        return {k: _pattern(v, f"{path}[{k!r}]", tensors) for k, v in value.items()}
    raise Unsupported(Fallback("capture", path, f"forward argument {path} is a {type(value).__name__}: the graph "
                               "takes tensors and specialises to numbers, strings, None and tuples, lists and dicts "
                               "of them"))


def _paths(pattern: Any, path: str) -> Iterator[str]:
    if pattern is TENSOR:
        yield path
    elif type(pattern) in (tuple, list):
        for i, v in enumerate(pattern):
            yield from _paths(v, f"{path}[{i}]")
    elif type(pattern) is dict:
        for k, v in pattern.items():
            yield from _paths(v, f"{path}[{k!r}]")


def _fill(pattern: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if pattern is TENSOR:
        return next(tensors)
    if type(pattern) in (tuple, list):
        return type(pattern)(_fill(v, tensors) for v in pattern)
    if type(pattern) is dict:
        return {k: _fill(v, tensors) for k, v in pattern.items()}
    return pattern


def _signature_text(model: torch.nn.Module) -> str:
    try:
        return str(forward_signature(model))
    except (TypeError, ValueError):
        return "(...)"
