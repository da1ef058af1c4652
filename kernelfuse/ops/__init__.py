"""Op tables shared by the planner, the CUDA code generator and the CPU interpreter (one row per ATen op)."""

from kernelfuse.ops.anchors import ANCHOR_OPS, VIEW_OPS
from kernelfuse.ops.pointwise import (
    CUDA_PRELUDE,
    POINTWISE_BY_ATEN,
    POINTWISE_OPS,
    PointwiseOp,
    float_literal,
    prelude_for,
    render_cuda,
)

__all__ = [
    "ANCHOR_OPS",
    "CUDA_PRELUDE",
    "POINTWISE_BY_ATEN",
    "POINTWISE_OPS",
    "PointwiseOp",
    "VIEW_OPS",
    "float_literal",
    "prelude_for",
    "render_cuda",
]
