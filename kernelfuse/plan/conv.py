"""Which convolutions kernelfuse's own kernels take, and the weight copy the dense implicit GEMM reads: the
planner's side of kernelfuse.codegen.conv_igemm, conv_tc and conv_depthwise."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.capture.graph import contiguous_strides
from kernelfuse.plan.layout import fresh_name

DENSE_CHANNELS = 32  # the dense kernel's K stage: this many input channels of one tap


def igemm_refusal(graph: Graph, node: Node) -> str:
    """Why this convolution cannot run as the generated implicit GEMM ('' when it can)."""
    x, w = graph[node.args[0]].meta, graph[node.args[1]].meta
    if x is None or w is None or len(w.shape) not in (3, 4, 5):
        return "not a 1-d, 2-d or 3-d convolution of tensors"
    if node.meta.numel == 0:
        return "empty output"
    if not (node.meta.dtype == x.dtype == w.dtype == torch.float32):
        return f"dtype {node.meta.dtype}: the generated convolution is fp32 only for now"
    int32 = 2**31 - 1  # the kernel's in-image and pixel indices are 32-bit
    if math.prod(x.shape[1:]) > int32 or node.meta.numel // max(node.meta.shape[1], 1) >= int32 or w.numel > int32:
        return "an input image, the output pixel count or the weight over 2^31 elements"
    return ""


MAX_DIRECT_TAPS = 64  # kernel volumes up to 8x8: the direct kernel holds a channel's taps in registers


def depthwise(graph: Graph, node: Node) -> bool:
    """A forward convolution whose every group reads one input channel (weight (C_out, 1, k...)), its kernel small
    enough for the direct kernel (kernelfuse.codegen.conv_depthwise)."""
    w = graph[node.args[1]].meta
    return not node.args[6] and w is not None and len(w.shape) >= 3 and w.shape[1] == 1 \
        and math.prod(w.shape[2:]) <= MAX_DIRECT_TAPS


def dense_refusal(graph: Graph, node: Node) -> str:
    """Why this convolution, which the implicit GEMM takes, cannot take its dense kernel (kernelfuse.codegen.conv_tc)
    ('' when it can). The caller decides the precision: the dense kernel is TF32 only."""
    w = graph[node.args[1]]
    transposed, groups = node.args[6], node.args[8]
    if w.op not in ("param", "buffer"):
        return "the weight is computed in the forward (the tap-major copy would be made in every call)"
    if transposed and groups != 1:
        return "a grouped transposed convolution"
    shape = w.meta.shape
    cig, cog = (shape[0], shape[1]) if transposed else (shape[1], shape[0] // groups)
    if cig % DENSE_CHANNELS or cog < DENSE_CHANNELS:
        return f"{cig} input and {cog} output channels a group (the dense kernel takes multiples of " \
               f"{DENSE_CHANNELS} input channels and at least {DENSE_CHANNELS} output channels)"
    if not w.meta.is_contiguous:
        return "the weight is not contiguous"
    return ""


def tap_major_strides(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    """Strides of a convolution weight of `shape` stored tap-major: [output channel][tap][input channel], the input
    channels contiguous (a forward weight is (C_out, C_in/g, k...), a transposed one (C_in, C_out, k...))."""
    cin = shape[0] if transposed else shape[1]
    spatial = tuple(math.prod(shape[3 + d:]) * cin for d in range(len(shape) - 2))
    kv = math.prod(shape[2:])
    return (1, kv * cin, *spatial) if transposed else (kv * cin, 1, *spatial)


def tap_major_weights(graph: Graph, exact: frozenset[str]) -> Graph:
    """`graph` with each convolution the dense kernel takes (not in `exact`, whose eager call computes in full fp32)
    reading its weight through a tap-major copy: permute, clone, permute back, the same values in the layout
    `tap_major_strides` names. The copy depends on the weight alone, so the emitted file makes it once per weight
    version (kernelfuse.emit.hoist). Unchanged where no convolution qualifies."""
    names = {n.name for n in graph.nodes}
    nodes: list[Node] = []
    views: dict[str, Ref] = {}
    for node in graph.nodes:
        if node.op != "convolution.default" or node.name in exact or igemm_refusal(graph, node) \
                or depthwise(graph, node) or dense_refusal(graph, node):
            nodes.append(node)
            continue
        weight, transposed = node.args[1], bool(node.args[6])
        if weight.name not in views:
            meta = graph[weight].meta
            rank = len(meta.shape) - 2
            order = (1, *range(2, rank + 2), 0) if transposed else (0, *range(2, rank + 2), 1)
            back = (rank + 1, 0, *range(1, rank + 1)) if transposed else (0, rank + 1, *range(1, rank + 1))
            shape = tuple(meta.shape[d] for d in order)
            moved, copy, view = (fresh_name(f"{weight.name}_{tag}", names) for tag in ("taps", "taps_copy", "tm"))
            nodes += [Node(moved, "permute.default", (weight, list(order)),
                           replace(meta, shape=shape, stride=tuple(meta.stride[d] for d in order))),
                      Node(copy, "clone.default", (Ref(moved), ("kw", "memory_format", torch.contiguous_format)),
                           replace(meta, shape=shape, stride=contiguous_strides(shape))),
                      Node(view, "permute.default", (Ref(copy), list(back)),
                           replace(meta, stride=tap_major_strides(meta.shape, transposed)))]
            views[weight.name] = Ref(view)
        args = list(node.args)
        args[1] = views[weight.name]
        nodes.append(replace(node, args=tuple(args)))
    if not views:
        return graph
    return graph.rebuilt(nodes)
