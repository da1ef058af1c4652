"""Rules that shape library calls for fusion: work a library call does in a pass of its own moves to the kernel
that follows it, where it costs no memory traffic."""

from __future__ import annotations

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.ops.anchors import RESHAPES
from kernelfuse.ops.pointwise import POINTWISE_BY_ATEN
from kernelfuse.rewrite.engine import FLOATS, Builder, Replacement


def conv_bias_to_epilogue(graph: Graph, node: Node) -> Replacement | None:
    """convolution(x, w, b) = convolution(x, w, None) + b.view(C, 1, ...): the bias joins the fused epilogue.

    ATen's cuDNN convolution (2-d, 3-d, 1-d, transposed, grouped) writes the product and then adds the bias in a
    separate elementwise pass over the whole output (`output.add_(bias)`): one more read and write of the largest
    tensor of most convolution problems (1.7 ms of a 3.5 ms channels-last call on an H100, measured in
    benchmarks/results/compile_conv_probe_h100.md; torch.compile splits the bias off the same way). Bit-exact:
    the same fp32 product plus the same fp32 bias, one rounding, for every value including NaN and Inf.

    Conditions: a float convolution with a bias tensor; not a depthwise non-transposed convolution
    (groups == in_channels > 1), whose native CUDA kernel starts its sum from the bias (another order); not a 2-d
    convolution whose one reader is a ReLU: cuDNN's fused convolution + bias + ReLU takes the bias in its own
    epilogue (kernelfuse.plan.fuse).
    """
    if node.op != "convolution.default" or len(node.args) != 9 or node.meta is None or node.meta.dtype not in FLOATS:
        return None
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    if not isinstance(bias, Ref) or not isinstance(x, Ref) or graph[x].meta is None:
        return None
    if not cuda_adds_bias_after(transposed, groups, graph[x].meta.shape[1]):
        return None
    users = graph.users(node.name)
    if len(node.meta.shape) == 4 and not transposed and len(users) == 1 and users[0].op == "relu.default" \
            and not graph.is_output(node.name):
        return None
    b = Builder(graph, node)
    product = b.add("convolution.default", x, weight, None, stride, padding, dilation, transposed, output_padding,
                    groups)
    channels = node.meta.shape[1]
    column = b.add("view.default", bias, (channels,) + (1,) * (len(node.meta.shape) - 2))
    return b.done(b.add("add.Tensor", product, column), "the convolution's bias is added in the fused kernel "
                                                         "after it, not in a pass of ATen's own")


def cuda_adds_bias_after(transposed: bool, groups: int, in_channels: int) -> bool:
    """Does ATen's CUDA convolution add the bias after the product? Yes outside the native depthwise kernels
    (non-transposed, groups == in_channels > 1), which start each sum from the bias."""
    return transposed or groups == 1 or groups != in_channels


def linear_bias_to_kernel(graph: Graph, node: Node) -> Replacement | None:
    """view(addmm(b, x, w)) = view(mm(x, w)) + b, for a Linear on an N-d input read only by pointwise ops: the bias
    joins the generated kernel after it (a residual add, an activation, the prologue of a norm).

    ATen's addmm with a 1-d bias runs cuBLASLt's bias epilogue, whose heuristics chose 64x64 tiles where plain mm
    chose 128x128: on an H200 in fp32, mm took 0.83-0.99 of addmm's time for the eight GEMM shapes of the zoo's
    transformers (BERT's FFN down-projection 0.86, Whisper's 0.83; benchmarks/linear_probe.py), and torch.compile
    splits the bias off the same way. The same fp32 sum plus the same fp32 bias; the GEMM's kernel may differ, and
    so its order of summation (within the strict tolerance). The add comes after the view, so no anchor epilogue
    takes it alone (a pass of its own); only where the product is viewed to N-d (the shapes measured): a 2-d
    Linear's epilogue stays as the anchor plans it.
    """
    if node.op not in RESHAPES or node.meta is None or len(node.meta.shape) < 3 or graph.is_output(node.name):
        return None
    source = node.args[0]
    if not isinstance(source, Ref):
        return None
    mm = graph[source]
    if mm.op != "addmm.default" or len(mm.args) != 3 or mm.meta is None or mm.meta.dtype not in FLOATS \
            or graph.is_output(mm.name) or len(graph.users(mm.name)) != 1:
        return None
    bias, x, w = mm.args
    if not isinstance(bias, Ref) or graph[bias].meta is None or graph[bias].meta.shape != mm.meta.shape[-1:] \
            or node.meta.shape[-1] != mm.meta.shape[-1]:
        return None
    readers = graph.users(node.name)
    if not readers or any(u.op not in POINTWISE_BY_ATEN for u in readers):
        return None
    b = Builder(graph, node)
    product = b.add(node.op, b.add("mm.default", x, w), *node.args[1:])
    return b.done(b.add("add.Tensor", product, bias),
                  "the Linear's bias is added in the kernel after it; mm, not cuBLASLt's bias epilogue")
