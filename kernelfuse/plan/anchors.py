"""Anchor selection: which library call takes an epilogue (`anchor_supported`), in which layout
(`channels_last_ok`, `is_conv2d`), and the fused step it heads: cuDNN's conv+bias+ReLU (`_relu_behind`,
`channels_last_conv_relu`) and the pointwise ops behind it that join its epilogue (`fuse_behind`, `_grow`).
Kept apart from kernelfuse.plan.fuse, which calls these for each anchor as it makes a plan, so each module stays
small; PlanOptions is imported for annotations only, so imports run one way (fuse -> anchors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelfuse.capture import Graph, Node, TensorMeta
from kernelfuse.ops import ANCHOR_OPS, POINTWISE_BY_ATEN
from kernelfuse.plan.conv import depthwise, igemm_refusal
from kernelfuse.plan.gemm import gemm_refusal
from kernelfuse.plan.ir import Anchor, Epilogue, FusedStep
from kernelfuse.plan.program import build_program
from kernelfuse.plan.schedule import FLOAT_DTYPES

if TYPE_CHECKING:  # annotations only: kernelfuse.plan.fuse imports this module
    from kernelfuse.plan.fuse import PlanOptions


def anchor_supported(graph: Graph, node: Node) -> tuple[bool, str]:
    """(ok, reason): can this library call take an epilogue? Checked on the real shapes and dtypes."""
    if node.meta.dtype not in FLOAT_DTYPES:
        return False, f"dtype {node.meta.dtype} not fused"
    if not node.meta.is_contiguous:
        return False, "non-contiguous library output"
    if ANCHOR_OPS[node.op] == "conv" and graph[node.args[1]].meta is None:
        return False, "convolution weight is not a tensor"
    return True, ""


def channels_last_ok(graph: Graph, node: Node) -> bool:
    """A 2-d or 3-d convolution, transposed or not: cuDNN runs it channels-last (NHWC / NDHWC), often faster in
    fp32 on Hopper. 1-d convolutions have no channels-last layout in torch: they stay NCHW."""
    if ANCHOR_OPS.get(node.op) != "conv":
        return False
    weight = graph[node.args[1]].meta
    return weight is not None and len(weight.shape) in (4, 5)


def is_conv2d(graph: Graph, node: Node) -> bool:
    """A 2-d, non-transposed convolution: the one cuDNN fuses with bias+ReLU (cudnn_convolution_relu)."""
    return channels_last_ok(graph, node) and len(graph[node.args[1]].meta.shape) == 4 and not node.args[6]


def _relu_behind(graph: Graph, anchor_node: Node, options: PlanOptions, taken: set[str]) -> bool:
    """Can cuDNN's conv+bias+ReLU call replace this convolution and its one reader, a ReLU?"""
    users = graph.users(anchor_node.name)
    return is_conv2d(graph, anchor_node) and options.cudnn_fused_relu and len(users) == 1 \
        and users[0].op == "relu.default" and not graph.is_output(anchor_node.name) and users[0].name not in taken


def channels_last_conv_relu(graph: Graph, anchor_node: Node, options: PlanOptions, kernel: str,
                             taken: set[str]) -> FusedStep | None:
    """In the channels-last graph, a convolution followed by a ReLU is cuDNN's conv+bias+ReLU call on the
    channels-last operands, its output left channels-last: no epilogue kernel (those index contiguous outputs),
    no pass of our own. Other library anchors with channels-last outputs stay torch calls."""
    if not options.channels_last_graph or anchor_node.meta.dtype not in FLOAT_DTYPES \
            or graph[anchor_node.args[1]].meta is None or not _relu_behind(graph, anchor_node, options, taken):
        return None
    relu = graph.users(anchor_node.name)[0]
    anchor = Anchor(anchor_node, "conv", True, "nchw", fp32=anchor_node.name in options.fp32_convs)
    return FusedStep(kernel, anchor, _epilogue(graph, [], relu.name, relu.meta), (anchor_node.name, relu.name),
                     relu.name)


def fuse_behind(graph: Graph, anchor_node: Node, options: PlanOptions, kernel: str,
                 taken: set[str]) -> FusedStep | None:
    family = ANCHOR_OPS[anchor_node.op]
    if not anchor_node.meta.is_dense_contiguous:  # a channels-last output (the channels-last graph's): the
        return None  # epilogue kernels index a contiguous one
    users = graph.users(anchor_node.name)
    fused_relu = _relu_behind(graph, anchor_node, options, taken)
    inside = {anchor_node.name}
    acc_name = anchor_node.name
    if fused_relu:
        inside.add(users[0].name)
        acc_name = users[0].name
    members = _grow(graph, anchor_node, inside, taken)
    layout = dict(options.conv_layouts).get(anchor_node.name, options.conv_layout) \
        if channels_last_ok(graph, anchor_node) else "nchw"
    own_gemm = family == "matmul" and options.gemm_impl == "generated" and not gemm_refusal(graph, anchor_node)
    if family == "matmul" and not members and not own_gemm:  # cuBLAS's call alone: nothing to fuse
        return None
    out_node = graph[members[-1].name] if members else graph[acc_name]
    epilogue = _epilogue(graph, members, acc_name, out_node.meta)
    impl = "library"
    if family == "conv" and options.conv_impl != "library" and not igemm_refusal(graph, anchor_node):
        impl = "direct" if depthwise(graph, anchor_node) else "generated" if options.conv_impl == "generated" \
            else "library"
    if own_gemm:
        impl = "generated"
    if impl != "library":
        layout = "nchw"  # our kernels read the input as it is (NCHW) and, here, store NCHW
    anchor = Anchor(anchor_node, family, fused_relu, layout,
                    tf32=options.matmul_tf32 and family == "matmul" and not own_gemm,
                    fp32=own_gemm or (layout == "nhwc" or impl != "library" or options.channels_last_graph)
                    and anchor_node.name in options.fp32_convs,
                    impl=impl)
    replaces = (anchor_node.name,) + ((acc_name,) if fused_relu else ()) + tuple(m.name for m in members)
    return FusedStep(kernel, anchor, epilogue, replaces, out_node.name)


def _grow(graph: Graph, anchor_node: Node, inside: set[str], taken: set[str]) -> list[Node]:
    """The pointwise nodes after the anchor that join its epilogue; none already in another kernel (`taken`: two
    anchors reading one node, as a gated MLP's `silu(x @ W1) * (x @ W2)`, would both take it)."""
    out_meta = anchor_node.meta
    members: list[Node] = []
    start = graph.position(anchor_node.name)
    for node in graph.nodes[start + 1:]:
        if node.name in inside or node.name in taken or node.op not in POINTWISE_BY_ATEN or node.meta is None:
            continue
        refs = node.refs
        if not any(r.name in inside for r in refs):
            continue
        if node.meta.shape != out_meta.shape or node.meta.dtype != out_meta.dtype:
            continue
        if not all(r.name in inside or _operand_ok(graph[r], out_meta) for r in refs):
            continue
        members.append(node)
        inside.add(node.name)
    # Shrink until only the last member's value is needed outside the epilogue.
    while members:
        escaping = [
            name for name in [anchor_node.name, *(n for n in inside if n != anchor_node.name)]
            if name != members[-1].name
            and (graph.is_output(name) or any(u.name not in inside for u in graph.users(name)))
        ]
        if not escaping:
            break
        inside.discard(members.pop().name)
    return members


def _operand_ok(node: Node, out: TensorMeta) -> bool:
    meta = node.meta
    if meta is None or meta.dtype != out.dtype or len(meta.shape) > len(out.shape):
        return False
    if not meta.is_dense_contiguous:  # the wrappers take contiguous operands only (a transposed weight, an expand)
        return False
    offset = len(out.shape) - len(meta.shape)
    return all(d in (1, out.shape[i + offset]) for i, d in enumerate(meta.shape))


def _epilogue(graph: Graph, members: list[Node], acc_name: str, out: TensorMeta) -> Epilogue:
    """The anchor's epilogue: the scheduler's pointwise program over the anchor's output."""
    _, program = build_program(graph, members, out, out.shape, acc=acc_name)
    return Epilogue(program.statements, program.operands, out)
