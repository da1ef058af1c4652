"""Pooling kernels (max/avg, 1-3-d) for generated kernels: one thread per output element walks its window.

Threads take output elements in the order of the source's memory: NCHW order for an NCHW source; channel fastest
for a channels-last source (a channels-last convolution's output), so that a warp reads neighbouring channels,
which lie next to each other, instead of reading one float from each of 32 sectors C floats apart. The NCHW
output is then written with a stride; an output is a window's size smaller than what is read.
"""

from __future__ import annotations

from kernelfuse.codegen.iteration import (
    BLOCK,
    epilogue_lines,
    index_type,
    launcher,
    pointer_params,
    shape_numel,
    space_of,
    value_lambda,
)
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep


def pool_kernel(step: GenStep, ctype: str) -> str:
    """One thread per output element: walk its window over the input (prologue recomputed per element read),
    skipping positions in the padding; max propagates NaN, avg divides as ATen does (padding counted or not)."""
    spec = step.spec
    win = spec.window  # type: ignore[attr-defined]
    k = step.kernel
    in_shape = step.prologue.space
    out_shape = step.epilogue.space  # the pooled value (a reshape in the epilogue keeps its flat index)
    nd = len(win.kernel)
    lead_in, lead_out = in_shape[:-nd], out_shape[:-nd]
    if lead_in != lead_out:
        raise ValueError(f"pool kernel {k}: the dims before the window differ between input {lead_in} and "
                         f"output {lead_out}")
    space = space_of(step)  # every input dim kept: value(r) takes a flat input index
    index_t = index_type(step)
    numel = shape_numel(out_shape)
    isz, osz = shape_numel(in_shape[-nd:]), shape_numel(out_shape[-nd:])
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    channels_last = reads_channels_last(step) and len(lead_in) == 2  # (N, C) before the pooled dims
    order = "channel fastest (channels-last source)" if channels_last else "output order"
    lines = [f"// pooling: kernel {list(win.kernel)}, stride {list(win.stride)}, padding {list(win.padding)}, "
             f"dilation {list(win.dilation)}; threads in {order}",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  for (INDEX t = (INDEX)blockIdx.x * {BLOCK} + threadIdx.x; t < (INDEX){numel}; "
             f"t += (INDEX)gridDim.x * {BLOCK}) {{"]
    lines += value_lambda(step, space, "k", None)
    if channels_last:  # t = ((n * positions) + q) * C + c; i is the NCHW output index of the same element
        channels = in_shape[1]
        lines.append(f"    const INDEX c = t % {channels}, nq = t / {channels};")
        lines.append(f"    const INDEX lead = (nq / {osz}) * {channels} + c;")
        lines.append(f"    INDEX rest = nq % {osz};")
        lines.append(f"    const INDEX i = lead * {osz} + rest;")
    else:
        lines.append("    const INDEX i = t;")
        lines.append(f"    const INDEX lead = i / {osz};")
        lines.append(f"    INDEX rest = i % {osz};")
    for d in reversed(range(nd)):
        lines.append(f"    const int q{d} = (int)(rest % {out_shape[-nd + d]}); rest /= {out_shape[-nd + d]};")
    for d in range(nd):
        lines.append(f"    const int s{d} = q{d} * {win.stride[d]} - {win.padding[d]};")
    lines.append("    float acc = -INFINITY;" if max_pool else "    float acc = 0.0f;")
    ind = "    "
    for d in range(nd):
        size = in_shape[-nd + d]
        lines.append(f"{ind}for (int w{d} = 0; w{d} < {win.kernel[d]}; ++w{d}) {{")
        ind += "  "
        lines.append(f"{ind}const int p{d} = s{d} + w{d} * {win.dilation[d]};")
        lines.append(f"{ind}if (p{d} < 0 || p{d} >= {size}) continue;")
    flat = "p0"
    for d in range(1, nd):
        flat = f"({flat}) * {in_shape[-nd + d]} + p{d}"
    load = f"value(lead * {isz} + {flat})"
    lines.append(f"{ind}acc = kf_max_op()(acc, {load});" if max_pool else f"{ind}acc += {load};")
    for _ in range(nd):
        ind = ind[:-2]
        lines.append(f"{ind}}}")
    if not max_pool:
        lines += _avg_divisor(win, in_shape[-nd:])
    lines.append("    const float y = acc;")
    lines += epilogue_lines(step, "i", "    ")
    lines.append(f"    out[i] = kf_store<{ctype}>(e_result);")
    lines += ["  }", "}", ""]
    return "\n".join(lines) + launcher(step, ctype, f"kf_blocks({numel}LL, {BLOCK})")


def reads_channels_last(step: GenStep) -> bool:
    """Is the source laid out channels-last: (N, C, spatial...) with the channel dim at unit stride and at least
    one spatial dim of more than one element (a 1x1 map is the same in either layout)?"""
    shape, strides = step.prologue.space, step.source.strides
    return len(shape) >= 3 and shape[1] > 1 and strides[1] == 1 and any(n > 1 for n in shape[2:])


def _avg_divisor(win, sizes: tuple[int, ...]) -> list[str]:
    """ATen's avg_pool divisor: the override, else the window clipped to input + padding (count_include_pad),
    else the number of positions inside the input."""
    if win.divisor is not None:
        return [f"    acc = acc / {float_literal(float(win.divisor))};"]
    pad_terms, in_terms = [], []
    for d, size in enumerate(sizes):
        end = f"min(s{d} + {win.kernel[d]}, {size + win.padding[d]})"
        pad_terms.append(f"({end} - s{d})")
        in_terms.append(f"(min({end}, {size}) - max(s{d}, 0))")
    count = " * ".join(pad_terms if win.count_include_pad else in_terms)
    return [f"    acc = acc / (float)({count});"]
