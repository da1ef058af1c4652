"""Each convolution's memory layout chosen by measurement: cuDNN's NCHW call against its channels-last one.

Which layout is faster depends on the convolution (2-d or 3-d, transposed, channel counts, kernel size) and on the
GPU; torch.compile switches convolutions to channels-last wholesale. Here each one is timed both ways on random
data of its captured shapes, the channels-last side paying for its operand conversions as the emitted forward
does, and channels-last is kept only when it is clearly faster. This runs in the optimizer's GPU process, one
timing at a time, before the plan is made; the judge then verifies and times the whole plan as usual.

A 1-d convolution has no channels-last layout in torch: it is timed NCHW only (its choice stays NCHW), for what the
timing also measures: whether eager's cuDNN call computes in TF32. Unmeasured, the owned-anchor plan keeps it fp32
(3xTF32, kernelfuse.plan.fuse.owned_anchor_variants); measured TF32, it may take the dense kernel's TMA im2col form
(kernelfuse.codegen.conv_tma: 1-d as 2-d of H = 1), as the 2-d ones do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.emit.flags import _without_tf32
from kernelfuse.plan.fuse import channels_last_ok

MARGIN = 0.05  # channels-last must be this much faster: a tie keeps NCHW (one less layout change)
MAX_BYTES = 8 << 30  # operands and both outputs; larger convolutions are not measured (both plans are judged)


@dataclass(frozen=True)
class LayoutTiming:
    node: str
    nchw_ms: float
    nhwc_ms: float  # inf: a 1-d convolution, NCHW only
    fp32: bool = False  # eager's NCHW call computes in full fp32 here: the channels-last one must too (no TF32)

    @property
    def choice(self) -> str:
        return "nhwc" if self.nhwc_ms < (1.0 - MARGIN) * self.nchw_ms else "nchw"

    def describe(self) -> str:
        if self.nhwc_ms == float("inf"):
            return f"{self.node}: NCHW {self.nchw_ms:.3f} ms (1-d: no channels-last), " \
                   f"{'full fp32' if self.fp32 else 'TF32'} as eager's call -> nchw"
        fp32 = " (cuDNN TF32 off, as eager's call)" if self.fp32 else ""
        return f"{self.node}: NCHW {self.nchw_ms:.3f} ms, channels-last{fp32} {self.nhwc_ms:.3f} ms -> {self.choice}"


def measure_conv_layouts(graph: Graph, strict: bool = True, reps: int = 10) -> list[LayoutTiming] | None:
    """Both layouts' times of every 2-d/3-d convolution in `graph` on the current CUDA device (the NCHW one alone
    of a 1-d convolution), or None when one cannot be measured (too large, an argument that is not a tensor): the
    caller then judges both plans.

    cuDNN may use TF32 for one layout's algorithm and not for the other's. Under a `strict` policy the channels-
    last call may be no less accurate than eager's: where eager's NCHW result equals the TF32-free one to fp32
    rounding, the channels-last call is timed (and will run) with cuDNN's TF32 switched off.
    """
    from kernelfuse.bench.timer import median_event_ms

    timings = []
    for node in graph.nodes:
        line = _conv1d(graph, node)
        if not channels_last_ok(graph, node) and not line:
            continue
        calls = _conv_calls(graph, node)
        if calls is None:
            return None
        nchw, nhwc = calls
        fp32 = strict and _computes_in_fp32(nchw)
        nhwc_timed = partial(_without_tf32, nhwc) if fp32 else nhwc
        timings.append(LayoutTiming(node.name, median_event_ms(nchw, reps),
                                    float("inf") if line else median_event_ms(nhwc_timed, reps), fp32))
        del calls, nchw, nhwc, nhwc_timed  # the operands live in the calls' closures: free them for the next one
        torch.cuda.empty_cache()
    return timings


def _conv1d(graph: Graph, node: Node) -> bool:
    """A 1-d convolution (its weight 3-d), transposed or not."""
    if node.op != "convolution.default" or not isinstance(node.args[1], Ref):
        return False
    weight = graph[node.args[1]].meta
    return weight is not None and len(weight.shape) == 3


def _computes_in_fp32(call: Callable[[], torch.Tensor]) -> bool:
    """Does the call, with the process's own flags, agree with its TF32-free self to fp32 rounding? TF32 keeps
    10 mantissa bits (errors near 1e-3 of the magnitude); fp32 sums in another order differ near 1e-6."""
    got = call()
    exact = _without_tf32(call)
    scale = float(exact.abs().max()) or 1.0
    return float((got - exact).abs().max()) <= 1e-5 * scale


def _conv_calls(graph: Graph, node: Node) -> tuple[Callable[[], object], Callable[[], object]] | None:
    x_ref, w_ref, b_ref = node.args[:3]
    if not isinstance(x_ref, Ref) or not isinstance(w_ref, Ref) or not (b_ref is None or isinstance(b_ref, Ref)):
        return None
    metas = [graph[r].meta for r in (x_ref, w_ref) + ((b_ref,) if b_ref is not None else ())]
    if any(m is None for m in metas) or metas[0].dtype != node.meta.dtype:
        return None
    nbytes = sum(m.numel * m.dtype.itemsize for m in metas) + 2 * node.meta.numel * node.meta.dtype.itemsize
    line = len(node.meta.shape) == 3  # 1-d: no channels-last call
    nbytes += 0 if line else 2 * metas[0].numel * metas[0].dtype.itemsize  # the channels-last input and its copy
    if nbytes > MAX_BYTES:
        return None
    x, w, *b = (torch.randn(m.shape, dtype=m.dtype, device="cuda") for m in metas)
    bias = b[0] if b else None
    args = node.args[3:9]

    def nchw() -> object:
        return torch.convolution(x, w, bias, *args)

    if line:
        return nchw, nchw
    fmt = torch.channels_last_3d if len(node.meta.shape) == 5 else torch.channels_last
    xc, wc = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)

    def nhwc() -> object:
        # the plan converts the input with its own tiled kernel (kf_nchw_to_nhwc), which moves the bytes at about
        # a plain copy's speed; torch's .contiguous(channels_last) took 2.3x as long (1.29 against 0.56 ms on
        # level-2 54, H200) and made the NCHW plan look faster than it was. The weight's copy is made once.
        x.clone()
        return torch.convolution(xc, wc, bias, *args)

    return nchw, nhwc
