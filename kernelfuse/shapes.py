"""Shapes that vary: one fused module per input shape, built on the first call of that shape, up to a limit.

Kernels are specialised to the shapes they were captured with (sizes are compile-time constants, which is what
lets a kernel unroll and vectorise). A model served at a few batch sizes or sequence lengths therefore gets one
specialisation per shape, each a fused module of its own over the same wrapped model (the same parameters), and a
call is dispatched by its inputs' shapes, dtypes and devices. Past the limit a new shape runs the original ops:
warned once (`ShapeFallbackWarning`) and counted in `kernelfuse_stats()`, never silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

Key = tuple[object, ...]


class ShapeFallbackWarning(UserWarning):
    """A call of a new shape ran the original ops: every specialisation the limit allows is built."""


class ShapeSpecialised(torch.nn.Module):
    """`model` with one fused module per input shape (`build(args, kwargs)` makes one, or returns `model` where
    that shape cannot be fused), at most `limit` of them; `first`: one already built, with its key. `original`
    runs a call no kernel serves (default `model` itself; a bf16 module's runs it under autocast)."""

    def __init__(self, model: torch.nn.Module | Callable[..., object], build: Callable[..., object], limit: int,
                 first: tuple[Key, object] | None = None, original: Callable[..., object] | None = None) -> None:
        super().__init__()
        self.inner = model
        self.training = getattr(model, "training", False)
        self._build = build
        self._run_original = original or model
        self.limit = limit
        self._specialisations: dict[Key, object] = dict([first]) if first is not None else {}
        self._declined: dict[str, int] = {}  # calls this wrapper ran as the original ops, by kind
        self._beyond: str | None = None  # the first call past the limit, in words

    def forward(self, *args: object, **kwargs: object) -> object:
        key = shape_key(args, kwargs)
        fused = self._specialisations.get(key)
        if fused is None:
            why = _not_served(self.inner, args, kwargs)
            if why is not None:  # CPU tensors or autograd: a fused module's guard says why and counts
                if self._specialisations:
                    return next(iter(self._specialisations.values()))(*args, **kwargs)
                return self._original(why, args, kwargs)
            if len(self._specialisations) >= self.limit:
                if self._beyond is None:
                    self._beyond = (f"inputs {describe(key)} match none of the {self.limit} shapes the kernels were "
                                    f"built for ({'; '.join(describe(k) for k in self._specialisations)})")
                    warnings.warn(f"kernelfuse: {self._beyond}; running the original ops. Raise max_shapes to "
                                  "build more (warned once; kernelfuse_stats() counts every call)",
                                  ShapeFallbackWarning, stacklevel=2)
                return self._original("shape", args, kwargs)
            fused = self._specialisations[key] = self._build(args, kwargs)
        return fused(*args, **kwargs)

    def _original(self, kind: str, args: tuple, kwargs: dict) -> object:
        self._declined[kind] = self._declined.get(kind, 0) + 1
        return self._run_original(*args, **kwargs)

    def kernelfuse_stats(self) -> dict[str, object]:
        """The fused modules' counts summed (`fused_calls`, `fallback_calls`, `fallback_reasons`) with the calls this
        wrapper ran as the original ops (past the limit: kind "shape"), the first of those in words
        (`beyond_limit`), and per specialisation its inputs, whether kernels serve it
        and its own counts (`specialisations`)."""
        per = []
        fused_calls = fallback_calls = 0
        reasons: dict[str, int] = {}
        for key, module in self._specialisations.items():
            stats = _stats_of(module)
            per.append({"inputs": describe(key), "fused": stats is not None, **(stats or {})})
            if stats is not None:
                fused_calls += int(stats["fused_calls"])
                fallback_calls += int(stats["fallback_calls"])
                for kind, n in dict(stats["fallback_reasons"]).items():
                    reasons[kind] = reasons.get(kind, 0) + int(n)
        for kind, n in self._declined.items():
            reasons[kind] = reasons.get(kind, 0) + n
        return {"fused_calls": fused_calls, "fallback_calls": fallback_calls + sum(self._declined.values()),
                "fallback_reasons": reasons, "beyond_limit": self._beyond, "limit": self.limit,
                "specialisations": per}


def shape_key(args: tuple | list, kwargs: dict | None = None) -> Key:
    """What a call is specialised on: each tensor's shape, dtype, device type and contiguity, and every other
    argument's value (a number a graph was traced with is a constant of its kernels)."""
    leaves, _ = tree_flatten((tuple(args), dict(kwargs or {})))
    return tuple((tuple(x.shape), x.dtype, x.device.type, x.is_contiguous()) if isinstance(x, torch.Tensor)
                 else x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__ for x in leaves)


def describe(key: Key) -> str:
    """A key as words: the tensors' shapes, `[8, 64] float32`, and other values."""
    parts = []
    for x in key:
        if isinstance(x, tuple) and len(x) == 4 and isinstance(x[1], torch.dtype):
            parts.append(f"{list(x[0])} {str(x[1]).removeprefix('torch.')}" + ("" if x[2] == "cuda" else f" {x[2]}"))
        else:
            parts.append(repr(x))
    return "(" + ", ".join(parts) + ")"


def _not_served(model: object, args: tuple, kwargs: dict) -> str | None:
    """Why no kernel would serve this call at all (kind "device": not all CUDA tensors; "autograd": gradients to
    feed), else None: worth a specialisation."""
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or not all(t.is_cuda for t in tensors):
        return "device"
    if not torch.is_grad_enabled():
        return None
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    if any(t.requires_grad for t in tensors) or any(p.requires_grad for p in params):
        return "autograd"
    return None


def _stats_of(module: object) -> dict[str, object] | None:
    """A fused module's kernelfuse_stats(), None for a shape that runs the original ops (nothing fused)."""
    stats = getattr(module, "kernelfuse_stats", None)
    if stats is None:
        owner = getattr(module, "__self__", None)  # a bound forward (Dynamo's graphs)
        stats = getattr(owner, "kernelfuse_stats", None)
    return stats() if callable(stats) else None
