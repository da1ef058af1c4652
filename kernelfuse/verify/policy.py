"""Precision policies: how close a candidate must be to eager, and to a float64 reference.

A policy is explicit and printed in every report, so a 1e-2 pass is never mistaken for a 1e-4 pass (DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Policy:
    """Tolerances and the precision the float64 accuracy rule compares against.

    `baseline` names how eager is run to set the accuracy bar: "fp32" (eager as is), "tf32" (eager with TF32
    matrix products and convolutions allowed) or "bf16" (eager under bf16 autocast). A candidate may be as
    inaccurate as that baseline (with slack), never less accurate. `autocast`: the dtype of CUDA autocast the
    policy optimizes and measures under (bf16: the model is captured as it runs under autocast, and eager and
    torch.compile are timed under it), None for fp32 semantics.
    """

    name: str
    atol: float
    rtol: float
    baseline: str
    description: str
    autocast: torch.dtype | None = None


POLICIES: dict[str, Policy] = {
    "strict": Policy("strict", 1e-4, 1e-4, "fp32", "fp32 semantics of eager; atol = rtol = 1e-4"),
    "tf32": Policy("tf32", 1e-2, 1e-2, "tf32", "matrix products may use TF32; atol = rtol = 1e-2"),
    "bf16": Policy("bf16", 1e-2, 1e-2, "bf16", "the model as it runs under CUDA bf16 autocast (bf16 operands, fp32 "
                   "accumulation); atol = rtol = 1e-2 against eager under autocast", torch.bfloat16),
}


def get_policy(name: str) -> Policy:
    """The policy called `name`; ValueError names the choices."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown precision policy {name!r}; choose one of {', '.join(POLICIES)}") from None
