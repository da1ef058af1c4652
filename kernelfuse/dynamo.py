"""`torch.compile(model, backend="kernelfuse")`: Dynamo captures the Python, kernelfuse fuses each graph it finds.

Registered through torch's `torch_dynamo_backends` entry point (pyproject.toml), so the name works once kernelfuse
is installed, without an import. Each FX graph Dynamo hands over goes through `kernelfuse.api.optimize`: captured,
planned, built, and checked against the graph itself on the example inputs; a graph that cannot be fused, or whose
fused module does not match, runs as Dynamo captured it (with a warning saying why). Options:
`torch.compile(model, backend="kernelfuse", options={"precision": "tf32"})`. Inside CUDA autocast to bf16 the
policy is bf16: the graph is captured as it runs under autocast, casts included.

A graph with symbolic sizes (Dynamo marks a dim dynamic once it has seen it change) gets one fused module per
concrete shape it is called with, built on that shape's first call, at most `options={"max_shapes": N}` of them
(default 4, kernelfuse.shapes); a later new shape runs the graph as captured, warned once and counted.
`kernelfuse.dynamo.stats()` reads the counts of every graph the backend fused.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch

from kernelfuse.api import optimize
from kernelfuse.shapes import ShapeSpecialised

MAX_SHAPES = 4  # specialisations of a graph with symbolic sizes, unless options["max_shapes"] says otherwise
_PRODUCTS: list[weakref.ref] = []  # what the backend returned that counts its calls (stats())


def kernelfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[object],
                       options: dict[str, object] | None = None) -> Callable[..., object]:
    """A Dynamo backend: the graph's forward with fused kernels where they verify, else the graph as captured."""
    precision = _precision(options)
    if precision is None:
        return gm.forward
    if any(isinstance(x, torch._subclasses.fake_tensor.FakeTensor) for x in example_inputs):
        warnings.warn("kernelfuse: the backend was given fake example inputs; running the graph as captured",
                      stacklevel=2)
        return gm.forward
    if any(isinstance(x, torch.SymInt) or not isinstance(x, torch.Tensor) for x in example_inputs):
        # symbolic sizes (a dynamic-shape graph): fused per concrete shape, on each shape's first call
        limit = int((options or {}).get("max_shapes", MAX_SHAPES))  # type: ignore[call-overload]

        def build(args: tuple, kwargs: dict) -> Callable[..., object]:
            return _fused(gm, list(args), precision, counted=False)  # counted by the wrapper

        return _counted(ShapeSpecialised(gm, build, limit))
    return _fused(gm, list(example_inputs), precision)


def stats() -> list[dict[str, object]]:
    """kernelfuse_stats() of every live graph module the backend fused (in the order they were compiled)."""
    alive = [r() for r in _PRODUCTS]
    return [p.kernelfuse_stats() for p in alive if p is not None]


def _counted(product: object) -> object:
    """`product`, listed by stats() while it lives (the dead are dropped here)."""
    _PRODUCTS[:] = [r for r in _PRODUCTS if r() is not None]
    _PRODUCTS.append(weakref.ref(product))
    return product


def _fused(gm: torch.fx.GraphModule, inputs: list[object], precision: str,
           counted: bool = True) -> Callable[..., object]:
    """The graph's forward with fused kernels for `inputs`' shapes, else the graph as captured (`counted`: listed
    by stats())."""
    fused = optimize(gm, inputs, precision)
    if fused is gm:
        return gm.forward
    if precision != "bf16":
        return _counted(fused) if counted else fused

    def without_autocast(*args: object) -> object:
        """The bf16 plan carries autocast's casts: run with the caller's autocast off (its fallback turns it on)."""
        with torch.autocast("cuda", enabled=False):
            return fused(*args)

    without_autocast.kernelfuse_stats = fused.kernelfuse_stats  # type: ignore[attr-defined]
    without_autocast.inner = fused.inner  # type: ignore[attr-defined]
    return _counted(without_autocast) if counted else without_autocast


def _precision(options: dict[str, object] | None) -> str | None:
    """The policy to fuse under: the option's, else "bf16" inside CUDA autocast to bf16 (Dynamo hands over the
    graph without autocast's casts, and it runs under the caller's autocast), else "strict". None (with a
    warning): an autocast kernelfuse has no policy for, or one that contradicts the option."""
    asked = (options or {}).get("precision")
    if not torch.is_autocast_enabled("cuda"):
        return str(asked or "strict")
    dtype = torch.get_autocast_dtype("cuda")
    if dtype != torch.bfloat16 or asked not in (None, "bf16"):
        why = f"CUDA autocast to {dtype} has no kernelfuse policy (bf16 has)" if dtype != torch.bfloat16 else \
            f"precision {asked!r} was asked for inside CUDA autocast to bf16"
        warnings.warn(f"kernelfuse: {why}; running the graph as captured", stacklevel=3)
        return None
    return "bf16"
