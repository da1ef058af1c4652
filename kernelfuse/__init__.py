"""kernelfuse: a PyTorch model in, a verified faster ModelNew built from fused CUDA kernels out.

Pipeline (one subpackage per stage, data flows one way): load -> capture -> rewrite -> plan -> codegen -> emit
-> build -> verify -> bench, with `judge` wrapping verify and bench in an isolated child process.
"""

from __future__ import annotations

__version__ = "0.1.0"


def optimize(model, example_inputs, precision: str = "strict", *, max_shapes: int = 1):  # noqa: ANN001, ANN201
    """`kernelfuse.api.optimize`: a live module in, a module running fused kernels (or the original) out; with
    `max_shapes` > 1, one specialisation per input shape, built on its first call (kernelfuse.shapes)."""
    from kernelfuse.api import optimize as _optimize

    return _optimize(model, example_inputs, precision, max_shapes=max_shapes)
