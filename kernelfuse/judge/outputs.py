"""Outputs must be plain tensors that the candidate owns: no subclasses, wrappers, lazy objects or borrowed storage.

A tensor subclass or an object with `__torch_function__` / `__torch_dispatch__` can compute (or fake) its values
when the judge reads it, after the timed region; a lazy object that only behaves like a tensor does the same. An
output that shares storage with an input or a parameter costs nothing to "produce". Each is rejected with the
reason, unless the reference's own output does the same (an in-place model returns its input).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import zip_longest
from typing import Any

import torch

from kernelfuse.verify import flatten_outputs

PLAIN_CONTAINERS = (tuple, list, dict)


def impure_output(out: Any, ref: Any) -> str | None:
    """Why `out` is not a plain output like `ref` (exact tensor type, plain containers, same device), or None."""
    problem = _impure_container(out, ref)
    if problem:
        return problem
    for i, (o, r) in enumerate(zip(flatten_outputs(out), flatten_outputs(ref), strict=False)):
        if not isinstance(r, torch.Tensor):
            continue
        where = f"output {i}" if isinstance(ref, PLAIN_CONTAINERS) else "the output"
        if type(o) is not torch.Tensor:
            hooks = [h for h in ("__torch_function__", "__torch_dispatch__") if _overrides(type(o), h)]
            what = "a tensor subclass" if isinstance(o, torch.Tensor) else "not a tensor"
            extra = f" overriding {' and '.join(hooks)}" if hooks else ""
            return (f"{where} is {type(o).__module__}.{type(o).__qualname__}, {what}{extra}: outputs must be plain "
                    "torch.Tensor objects (a wrapper or lazy object can do its work when read, outside the timed "
                    "region)")
        if o.device != r.device or o.layout != r.layout:
            return f"{where} is on {o.device} ({o.layout}), the reference's on {r.device} ({r.layout})"
    return None


def _impure_container(out: Any, ref: Any) -> str | None:
    """A container subclass is accepted only where the reference returns that same class at that place (a
    namedtuple or transformers' ModelOutput of the model's own); `ref` is the reference's value there."""
    subclass = isinstance(out, PLAIN_CONTAINERS) and type(out) not in PLAIN_CONTAINERS
    if subclass and not _same_class(type(out), type(ref)):
        return (f"the output is a {type(out).__qualname__} (a subclass of {type(out).__mro__[1].__name__}): "
                "outputs must be plain tensors, tuples, lists or dicts, or the reference's own container class")
    if isinstance(out, PLAIN_CONTAINERS):
        refs = (list(ref.values()) if isinstance(ref, dict) else list(ref)) if isinstance(ref, PLAIN_CONTAINERS) else []
        items = out.values() if isinstance(out, dict) else out
        return next((p for p in (_impure_container(x, r) for x, r in zip_longest(items, refs)) if p), None)
    return None


def _same_class(a: type, b: type) -> bool:
    """`a` is `b`, or `b` defined again (the candidate's file repeats the problem's code, so its namedtuple is
    another class object): the same names along the MRO and the same attributes, methods of the same bytecode."""
    if a is b:
        return True
    if [c.__qualname__ for c in a.__mro__] != [c.__qualname__ for c in b.__mro__] or vars(a).keys() != vars(b).keys():
        return False
    for name, value in vars(a).items():
        code, other = getattr(value, "__code__", None), getattr(vars(b)[name], "__code__", None)
        if (code is None) != (other is None) or (code is not None and code.co_code != other.co_code):
            return False
    return True


def _overrides(cls: type, hook: str) -> bool:
    impl = getattr(cls, hook, None)
    base = getattr(torch.Tensor, hook, None)
    return impl is not None and getattr(impl, "__func__", impl) is not getattr(base, "__func__", base)


def _storages(values: Iterable[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in values
            if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel()}


def aliased_storage(out: Any, inputs: list[Any], model: torch.nn.Module) -> set[str]:
    """Which of "input" and "parameter" (parameters and buffers) share storage with a tensor leaf of `out`."""
    mine = _storages(flatten_outputs(out))
    found = set()
    if mine & _storages(inputs):
        found.add("input")
    if mine & _storages(list(model.parameters()) + list(model.buffers())):
        found.add("parameter")
    return found


def borrowed_output(cand_out: Any, cand_inputs: list[Any], candidate: torch.nn.Module, ref_out: Any,
                    ref_inputs: list[Any], reference: torch.nn.Module) -> str | None:
    """Why the candidate's output aliases an input or parameter where the reference's does not, or None."""
    extra = aliased_storage(cand_out, cand_inputs, candidate) - aliased_storage(ref_out, ref_inputs, reference)
    if not extra:
        return None
    what = " and ".join(f"an {e}" if e == "input" else f"a {e}" for e in sorted(extra))
    return (f"the output shares storage with {what} of the candidate, where the reference's output does not: its "
            "values were not produced by this call (or are overwritten by the next one)")
