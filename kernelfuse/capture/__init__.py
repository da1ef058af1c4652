"""Stage 2 — capture: the forward as a Graph of ATen ops with shapes, dtypes and strides (fake tensors)."""

from kernelfuse.capture.graph import Arg, Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.capture.trace import build_model, capture, capture_module, module_state

__all__ = ["Arg", "Graph", "Node", "Ref", "TensorMeta", "build_model", "capture", "capture_module",
           "contiguous_strides", "module_state"]
