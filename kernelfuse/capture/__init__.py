"""Stage 2 — capture: the forward as a Graph of ATen ops with shapes, dtypes and strides (fake tensors)."""

from kernelfuse.capture.graph import Arg, Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.capture.trace import capture

__all__ = ["Arg", "Graph", "Node", "Ref", "TensorMeta", "capture", "contiguous_strides"]
