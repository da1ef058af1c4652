"""Stage 4 — plan: library anchors with fused epilogues, torch calls for the rest; a CPU interpreter checks it."""

from kernelfuse.plan.fuse import (
    PlanOptions,
    make_plan,
    optimizer_variants,
    owned_anchor_variants,
    plan_variants,
    torch_calls_plan,
)
from kernelfuse.plan.interpret import interpret
from kernelfuse.plan.ir import (
    Anchor,
    AttnStep,
    Epilogue,
    FusedStep,
    GenStep,
    Operand,
    Plan,
    Program,
    Statement,
    TorchStep,
)
from kernelfuse.plan.program import broadcast_strides

__all__ = [
    "Anchor",
    "AttnStep",
    "Epilogue",
    "FusedStep",
    "GenStep",
    "Operand",
    "Plan",
    "PlanOptions",
    "Program",
    "Statement",
    "TorchStep",
    "torch_calls_plan",
    "broadcast_strides",
    "interpret",
    "make_plan",
    "optimizer_variants",
    "owned_anchor_variants",
    "plan_variants",
]
