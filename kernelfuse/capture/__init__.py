"""Stage 2 — capture: the forward as a Graph of ATen ops with shapes, dtypes and strides (fake tensors)."""

from kernelfuse.capture.graph import Arg, Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.capture.trace import capture, capture_module

__all__ = ["Arg", "Graph", "Node", "Ref", "TensorMeta", "capture", "capture_module", "contiguous_strides"]
