"""`torch.compile(model, backend="kernelfuse")`: Dynamo captures the Python, kernelfuse fuses each graph it finds.

Registered through torch's `torch_dynamo_backends` entry point (pyproject.toml), so the name works once kernelfuse
is installed, without an import. Each FX graph Dynamo hands over goes through `kernelfuse.api.optimize`: captured,
planned, built, and checked against the graph itself on the example inputs; a graph that cannot be fused, or whose
fused module does not match, runs as Dynamo captured it (with a warning saying why). Options:
`torch.compile(model, backend="kernelfuse", options={"precision": "tf32"})`. Inside CUDA autocast to bf16 the
policy is bf16: the graph is captured as it runs under autocast, casts included.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kernelfuse.api import optimize


def kernelfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[object],
                       options: dict[str, object] | None = None) -> Callable[..., object]:
    """A Dynamo backend: the graph's forward with fused kernels where they verify, else the graph as captured."""
    precision = _precision(options)
    if precision is None:
        return gm.forward
    if any(not isinstance(x, torch.Tensor) for x in example_inputs):  # symbolic sizes: a dynamic-shape graph
        warnings.warn("kernelfuse: the graph takes symbolic sizes (dynamic shapes); running it as captured. "
                      "Compile with dynamic=False to get fused kernels per shape", stacklevel=2)
        return gm.forward
    if any(isinstance(x, torch._subclasses.fake_tensor.FakeTensor) for x in example_inputs):
        warnings.warn("kernelfuse: the backend was given fake example inputs; running the graph as captured",
                      stacklevel=2)
        return gm.forward
    fused = optimize(gm, list(example_inputs), precision)
    if fused is gm:
        return gm.forward
    if precision != "bf16":
        return fused

    def without_autocast(*args: object) -> object:
        """The bf16 plan carries autocast's casts: run with the caller's autocast off (its fallback turns it on)."""
        with torch.autocast("cuda", enabled=False):
            return fused(*args)

    return without_autocast


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
