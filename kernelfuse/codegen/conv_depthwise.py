"""Depthwise convolutions (one input channel per group) as a direct kernel with the epilogue inside.

As an implicit GEMM a depthwise convolution has K = the kernel volume and one to a few output channels per group:
the tensor-core tile is mostly empty, and the work is memory-bound anyway (cuDNN's call ran at ~5x its memory
floor on the dev split). Here a thread computes R outputs down one column (R consecutive rows of the
second-to-last dimension, the lanes of a warp along the last one, so loads and stores coalesce) of one (image,
output channel) plane: it loads each input row of its window once and multiplies it into every output row it
reaches, the channel's taps held in registers, fp32 multiply-adds in the kernel's row-major tap order (exact fp32,
never TF32: at least as accurate as eager). The epilogue (`kN_apply`, as in the implicit GEMM) runs before the one
store, in NCHW or channels-last order. 1-, 2- and 3-d; strided, padded, dilated; any channel multiplier.
"""

from __future__ import annotations

import itertools
import math

from kernelfuse.codegen.conv_geometry import ConvShape

THREADS = 256
ROWS = 4  # outputs per thread, down the second-to-last dimension


def render_depthwise(k: str, s: ConvShape, ctype: str, index_t: str, has_bias: bool, out_layout: str,
                     operand_params: str, operand_args: str) -> tuple[str, tuple[int, int, int], int]:
    """(kernel source, grid, threads) of `k`_kernel with the same arguments as the implicit GEMM's, for a
    convolution the planner found depthwise (kernelfuse.plan.fuse.depthwise)."""
    if s.transposed or s.cig != 1:
        raise ValueError(f"kernelfuse: {k}: not a depthwise convolution (groups {s.groups}, {s.cin} channels in)")
    pad = 2 - len(s.kernel) if len(s.kernel) < 2 else 0  # a 1-d convolution: one output row per plane
    kernel, stride = (1,) * pad + s.kernel, (1,) * pad + s.stride
    padding, dilation = (0,) * pad + s.padding, (1,) * pad + s.dilation
    in_size, out_size = (1,) * pad + s.in_size, (1,) * pad + s.out_size
    outer_out, (oh, ow) = out_size[:-2], out_size[-2:]
    outer_in, (ih, iw) = in_size[:-2], in_size[-2:]
    rows = min(ROWS, oh)
    ohb = -(-oh // rows)
    per_plane = math.prod(outer_out) * ohb * ow
    tiles = -(-per_plane // THREADS)
    blocks = s.batch * s.cout * tiles
    if blocks >= 2**31 or per_plane >= 2**31:
        raise ValueError(f"kernelfuse: {k}: {blocks} blocks exceed the grid")
    kh, kw = kernel[-2:]
    sh, sw = stride[-2:]
    ph, pw = padding[-2:]
    dh, dw = dilation[-2:]
    in_strides = [math.prod(in_size[d + 1:]) for d in range(len(in_size))]
    lines = [f"  const long long plane = blockIdx.x / {tiles};  // image * {s.cout} + output channel",
             f"  const int t = (int)(blockIdx.x % {tiles}) * {THREADS} + threadIdx.x;",
             f"  if (t >= {per_plane}) return;",
             f"  const int co = (int)(plane % {s.cout});",
             f"  const long long img = plane / {s.cout};",
             f"  const int ow = t % {ow}, rest = t / {ow}, oh0 = rest % {ohb} * {rows}, outer = rest / {ohb};",
             "  (void)outer;",
             f"  const {ctype}* xp = x + (img * {s.cin} + co / {s.cog}) * {math.prod(s.in_size)}LL;",
             f"  float wk[{s.kv}];"]
    lines += [f"  wk[{p}] = kf_load(w[co * {s.kv} + {p}]);" for p in range(s.kv)]
    lines += [f"  float acc[{rows}];"] + [f"  acc[{r}] = 0.0f;" for r in range(rows)]
    flat = "outer"
    outer_coord = []  # outer output coordinates, innermost last
    for d in range(len(outer_out) - 1, -1, -1):
        outer_coord.insert(0, f"({flat}{f' % {outer_out[d]}' if d > 0 else ''})")
        flat = f"({flat} / {outer_out[d]})"
    lines += [f"  const int iw{q} = ow * {sw} - {pw} + {q * dw};" for q in range(kw)]
    lines += [f"  const bool okw{q} = iw{q} >= 0 && iw{q} < {iw};" for q in range(kw)]
    window = (rows - 1) * sh + (kh - 1) * dh + 1
    users = {j: [(r, q) for r in range(rows) for q in range(kh) if r * sh + q * dh == j] for j in range(window)}
    for outer_taps in itertools.product(*(range(n) for n in kernel[:-2])):
        base_terms, checks = [], []
        for d, q in enumerate(outer_taps):
            pos = f"({outer_coord[d]} * {stride[d]} - {padding[d]} + {q * dilation[d]})"
            checks.append(f"{pos} >= 0 && {pos} < {outer_in[d]}")
            base_terms.append(f"{pos} * {in_strides[d]}")
        tap0 = sum(q * math.prod(kernel[d + 1:]) for d, q in enumerate(outer_taps))
        body = [f"    const long long base = {' + '.join(base_terms) or '0'};"]
        for j, reached in users.items():
            if not reached:
                continue
            body.append(f"    {{ const int ih = oh0 * {sh} - {ph} + {j}; const bool okh = ih >= 0 && ih < {ih};")
            for q in range(kw):
                body.append(f"      const float v{q} = okh && okw{q} ? kf_load(xp[base + (long long)ih * {iw} + "
                            f"iw{q}]) : 0.0f;")
            for r, qh in reached:
                for q in range(kw):
                    body.append(f"      acc[{r}] = fmaf(v{q}, wk[{tap0 + qh * kw + q}], acc[{r}]);")
            body.append("    }")
        lines += [f"  if ({' && '.join(checks) or 'true'}) {{", *body, "  }"]
    pixels = s.pixels
    bias = " + kf_load(bias[co])" if has_bias else ""
    for r in range(rows):
        pix = f"(outer * {oh} + oh0 + {r}) * {ow} + ow"
        store = "i" if out_layout == "nchw" else f"(({index_t})img * {pixels} + pix) * {s.cout} + co"
        lines += [f"  if (oh0 + {r} < {oh}) {{",
                  f"    const {index_t} pix = {pix};",
                  f"    const {index_t} i = (({index_t})img * {s.cout} + co) * {pixels} + pix;",
                  f"    out[{store}] = kf_store<{ctype}>({k}_apply(acc[{r}]{bias}, i{operand_args}));",
                  "  }"]
    head = (f"__global__ void __launch_bounds__({THREADS}) {k}_kernel(const {ctype}* __restrict__ x, "
            f"const {ctype}* __restrict__ w, const {ctype}* __restrict__ bias, {ctype}* __restrict__ out"
            f"{operand_params}) {{\n")
    return head + "\n".join(lines) + "\n}\n", (blocks, 1, 1), THREADS
