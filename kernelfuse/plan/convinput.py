"""Kernels that feed a channels-last convolution write channels-last.

Where the per-convolution layout choice (kernelfuse.plan.fuse, `Anchor.layout`) runs a cuDNN convolution
channels-last, its NCHW input was converted in a pass of its own (`ext.to_channels_last`: a read and a write of
the whole activation; 0.072 ms of level-3 8's 0.82 ms of kernels on an H200). Where that input is the output of a
norm or pointwise kernel of ours and the convolution is its one reader, the kernel writes it channels-last instead
(the norm's normalise pass transposes through shared memory, kernelfuse.codegen.split_normalise), and the
convolution reads it as it is. The graph's node then holds the channels-last strides, as the emitted file lays
the tensor out.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernelfuse.capture import Graph, Ref
from kernelfuse.plan.catselect import selects
from kernelfuse.plan.ir import FusedStep, GenStep, Step
from kernelfuse.plan.layout import channels_last_strides


def channels_last_into_convs(graph: Graph, by_out: dict[str, Step]) -> Graph:
    """`graph` with each such kernel's output channels-last (its step in `by_out` replaced to write so)."""
    changed = {}
    for step in by_out.values():
        if not isinstance(step, FusedStep) or step.anchor.family != "conv" or step.anchor.layout != "nhwc" \
                or step.anchor.epilogue_inside:
            continue
        x = step.anchor.node.args[0]
        gen = by_out.get(x.name) if isinstance(x, Ref) else None
        if not isinstance(gen, GenStep) or not _writes_channels_last(graph, gen):
            continue
        meta = replace(gen.out_meta, stride=channels_last_strides(gen.out_meta.shape))
        by_out[gen.out] = replace(gen, out_meta=meta)
        changed[gen.out] = meta
    if not changed:
        return graph
    nodes = tuple(replace(n, meta=changed[n.name]) if n.name in changed else n for n in graph.nodes)
    return graph.rebuilt(nodes)


def _writes_channels_last(graph: Graph, gen: GenStep) -> bool:
    """Can the kernel write its output channels-last: a contiguous 4-d/5-d float output over its own iteration
    space or a regrouping of it (a pointwise or norm kernel, no broadcast), read by the convolution alone? Not one
    that selects from a concatenation: kept NCHW as first planned (a select over the kernel's own space could
    iterate a channels-last output, as Llama's transposed rotary does; not tried or measured here)."""
    meta = gen.out_meta
    if gen.mapped is not None or len(meta.shape) not in (4, 5) or selects(gen.prologue) \
            or not meta.is_contiguous or meta.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
            or meta.shape[1] == 1 or len(graph.users(gen.out)) != 1 or graph.is_output(gen.out):
        return False
    # GenStep.permuted_out decides which kernels write a permuted output (pointwise and norm kernels) and where
    if replace(gen, out_meta=replace(meta, stride=channels_last_strides(meta.shape))).permuted_out is None:
        return False
    space, shape = tuple(gen.prologue.space), tuple(gen.epilogue.space)
    return all(_views_as(shape, o.strides, space) for o in gen.epilogue.operands)


def _views_as(shape: tuple[int, ...], strides: tuple[int, ...], space: tuple[int, ...]) -> bool:
    """Can an epilogue operand (`strides` over `shape`) be read through the kernel's regrouped space, as a permuted
    output's epilogue reads it (kernelfuse.codegen.iteration.epilogue_lines)? A norm over (N, G, C/G * D * H * W)
    with a per-W operand cannot (found by the fuzzer: seed 103000, model 1708)."""
    if shape == space:
        return True
    try:
        torch.empty_strided(shape, strides, device="meta").view(space)
    except RuntimeError:
        return False
    return True
