"""Stage 2 — capture: the forward as a Graph of ATen ops with shapes, dtypes and strides (fake tensors)."""

from kernelfuse.capture.graph import (
    Arg,
    Graph,
    Node,
    Ref,
    TensorMeta,
    aten_overload,
    contiguous_strides,
    draws_random_numbers,
    schema_args,
)
from kernelfuse.capture.trace import build_model, capture, capture_module, module_state

__all__ = ["Arg", "Graph", "Node", "Ref", "TensorMeta", "aten_overload", "build_model", "capture", "capture_module",
           "contiguous_strides", "draws_random_numbers", "module_state",
           "schema_args"]
