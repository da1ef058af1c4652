"""Pooling kernels (max/avg, 1-3-d) for generated kernels: one thread per output element walks its window.

Threads take output elements in the order of the source's memory: NCHW order for an NCHW source. A channels-last
source (a channels-last convolution's output) is pooled by tiles of 32 channels x 32 positions through shared
memory: a warp reads neighbouring channels, which lie next to each other, and writes neighbouring positions of the
NCHW output.

For an NCHW source a thread computes up to ROW_OUTPUTS neighbouring outputs along the last pooled dim: each input
element of their joint span is loaded once and combined into every window that holds it (a 4x4 stride-1 window:
28 loads for 4 outputs instead of 64), in each window's own order, so the results are bitwise those of one
thread per output.

A pool whose window spans the last dim only (1-d pools, traced as 2-d ones with a 1-high window) stages each
block's input span in shared memory with coalesced loads, and threads then take consecutive outputs, so both the
loads and the stores are coalesced (dev level-1 44, a 1-d average pool: 2.6x its memory floor with 4 outputs
per thread, whose loads and stores are 4 floats apart across a warp).
"""

from __future__ import annotations

from kernelfuse.codegen.iteration import (
    BLOCK,
    epilogue_lines,
    index_type,
    launcher,
    out_ctype,
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
    numel = shape_numel(out_shape)
    osz = shape_numel(out_shape[-nd:])
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    channels_last = reads_channels_last(step) and len(lead_in) == 2  # (N, C) before the pooled dims
    if not channels_last and last_dim_only(win, in_shape, out_shape):
        return _tiled_row_pool_kernel(step, ctype)
    if step.pools_channels_last:
        return _channels_last_out_pool_kernel(step, ctype)
    if channels_last:
        return _channels_last_pool_kernel(step, ctype)
    per_thread = 1 if win.adaptive else row_outputs(win, out_shape[-1])
    if per_thread > 1:
        return _row_pool_kernel(step, ctype, per_thread)
    order = "output order"
    geometry = _geometry(win, out_shape)
    lines = _grid_stride_head(step, ctype, f"// pooling: {geometry}; threads in {order}", f"{numel}")
    lines += value_lambda(step, space, "k", None)
    lines.append("    const INDEX i = t;")
    lines.append(f"    const INDEX lead = i / {osz};")
    lines.append(f"    INDEX rest = i % {osz};")
    lines += _window_walk(win, in_shape, out_shape, max_pool, "    ")
    lines.append("    const float y = acc;")
    lines += epilogue_lines(step, "i", "    ")
    lines.append(f"    out[i] = kf_store<{out_ctype(step)}>(e_result);")
    lines += ["  }", "}", ""]
    return "\n".join(lines) + launcher(step, ctype, f"kf_blocks({numel}LL, {BLOCK})")


def _window_walk(win, in_shape: tuple[int, ...], out_shape: tuple[int, ...], max_pool: bool, ind0: str) -> list[str]:
    """C lines: the pooled value `acc` of the output at in-plane position `rest` of plane `lead` (both defined
    before; `rest` is consumed), walking its window over value(r), skipping positions in the padding."""
    nd = len(win.kernel)
    isz = shape_numel(in_shape[-nd:])
    lines: list[str] = []
    for d in reversed(range(nd)):
        lines.append(f"{ind0}const int q{d} = (int)(rest % {out_shape[-nd + d]}); rest /= {out_shape[-nd + d]};")
    if win.adaptive:  # [q * n / m, ceil((q + 1) * n / m)) as ATen's adaptive pools compute it
        for d in range(nd):
            n, m = in_shape[-nd + d], out_shape[-nd + d]
            lines.append(f"{ind0}const int s{d} = (int)((long long)q{d} * {n} / {m}), "
                         f"e{d} = (int)((((long long)q{d} + 1) * {n} + {m - 1}) / {m});")
    else:
        for d in range(nd):
            lines.append(f"{ind0}const int s{d} = q{d} * {win.stride[d]} - {win.padding[d]};")
    lines.append(f"{ind0}float acc = -INFINITY;" if max_pool else f"{ind0}float acc = 0.0f;")
    ind = ind0
    for d in range(nd):
        size = in_shape[-nd + d]
        if win.adaptive:
            lines.append(f"{ind}for (int p{d} = s{d}; p{d} < e{d}; ++p{d}) {{")
            ind += "  "
            continue
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
        lines += [ind0 + line[4:] for line in _avg_divisor(win, in_shape[-nd:])]
    return lines


def _channels_last_pool_kernel(step: GenStep, ctype: str) -> str:
    """A pool of a channels-last source into an NCHW output, through shared memory: a block pools a tile of 32
    channels x 32 output positions of one image with a warp's lanes on neighbouring channels (its reads are
    contiguous in the source), then writes the tile with the lanes on neighbouring positions (its writes are
    contiguous in the output). One thread per output and channel-fastest threads read as well but wrote 4 bytes
    per 32-byte sector: level-2 problem 46's pool, 1.04 ms against torch.compile's 0.80 for two passes (H200)."""
    spec = step.spec
    win = spec.window  # type: ignore[attr-defined]
    k = step.kernel
    in_shape, out_shape = step.prologue.space, step.epilogue.space
    nd = len(win.kernel)
    channels, images = in_shape[1], in_shape[0]
    osz = shape_numel(out_shape[-nd:])
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    geometry = _geometry(win, out_shape)
    lines = [f"// pooling: {geometry}; a channels-last source, staged through shared memory into NCHW",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_type(step)} INDEX;",
             "  __shared__ float tile[32][33];  // [position][channel]",
             "  const int lx = threadIdx.x & 31, ly = threadIdx.x >> 5;",
             "  const INDEX qb = (INDEX)blockIdx.x * 32, n = blockIdx.z;  // the tile's first output position",
             "  const int c0 = blockIdx.y * 32;"]
    lines += value_lambda(step, space_of(step), "k", None)
    lines += ["#pragma unroll",
              "  for (int j = 0; j < 4; ++j) {  // the lanes on 32 neighbouring channels of one output position",
              "    const INDEX q = qb + ly + 8 * j, c = c0 + lx;",
              f"    if (q >= {osz} || c >= {channels}) continue;",
              f"    const INDEX lead = n * {channels} + c;",
              "    INDEX rest = q;"]
    lines += _window_walk(win, in_shape, out_shape, max_pool, "    ")
    lines += ["    tile[ly + 8 * j][lx] = acc;", "  }", "  __syncthreads();",
              "#pragma unroll",
              "  for (int j = 0; j < 4; ++j) {  // the lanes on 32 neighbouring output positions of one channel",
              "    const INDEX q = qb + lx, c = c0 + ly + 8 * j;",
              f"    if (q >= {osz} || c >= {channels}) continue;",
              f"    const INDEX i = (n * {channels} + c) * {osz} + q;",
              "    const float y = tile[lx][ly + 8 * j];"]
    lines += epilogue_lines(step, "i", "    ")
    lines += [f"    out[i] = kf_store<{out_ctype(step)}>(e_result);", "  }", "}", ""]
    grid = f"dim3({-(-osz // 32)}, {-(-channels // 32)}, {images})"
    return "\n".join(lines) + launcher(step, ctype, grid)


def _channels_last_out_pool_kernel(step: GenStep, ctype: str) -> str:
    """A pool of a channels-last source into a channels-last output (the channels-last graph's): one thread per
    output in the output's memory order, channel fastest, so a warp's window loads read neighbouring channels and
    its stores write neighbouring ones, both contiguous."""
    win = step.spec.window  # type: ignore[attr-defined]
    in_shape, out_shape = step.prologue.space, step.epilogue.space
    nd = len(win.kernel)
    channels = in_shape[1]
    osz = shape_numel(out_shape[-nd:])
    numel = shape_numel(out_shape)
    max_pool = step.spec.kind == "max_pool"  # type: ignore[attr-defined]
    lines = _grid_stride_head(step, ctype, f"// pooling: {_geometry(win, out_shape)}; channels-last in and out, "
                              "threads in the output's memory order", f"{numel}")
    lines += value_lambda(step, space_of(step), "k", None)
    lines += [f"    const INDEX c = t % {channels}, nq = t / {channels};",
              f"    const INDEX q = nq % {osz}, lead = (nq / {osz}) * {channels} + c;",
              "    INDEX rest = q;"]
    lines += _window_walk(win, in_shape, out_shape, max_pool, "    ")
    lines += ["    const float y = acc;", f"    const INDEX i = lead * {osz} + q;  // the logical (NCHW) index"]
    lines += epilogue_lines(step, "i", "    ")
    lines += [f"    out[t] = kf_store<{out_ctype(step)}>(e_result);", "  }", "}", ""]
    return "\n".join(lines) + launcher(step, ctype, f"kf_blocks({numel}LL, {BLOCK})")


def _grid_stride_head(step: GenStep, ctype: str, comment: str, count: str) -> list[str]:
    """C lines: the comment, the kernel's signature and its grid-stride loop over `count` work items `t`."""
    return [comment, f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_kernel({pointer_params(step, ctype)}) {{",
            f"  typedef {index_type(step)} INDEX;",
            f"  for (INDEX t = (INDEX)blockIdx.x * {BLOCK} + threadIdx.x; t < (INDEX){count}; "
            f"t += (INDEX)gridDim.x * {BLOCK}) {{"]


def _geometry(win, out_shape: tuple[int, ...]) -> str:
    nd = len(win.kernel)
    if win.adaptive:
        return f"adaptive to {list(out_shape[-nd:])}"
    return f"kernel {list(win.kernel)}, stride {list(win.stride)}, padding {list(win.padding)}, dilation {list(win.dilation)}"


def reads_channels_last(step: GenStep) -> bool:
    """Is the source laid out channels-last: (N, C, spatial...) with the channel dim at unit stride and at least
    one spatial dim of more than one element (a 1x1 map is the same in either layout)?"""
    shape, strides = step.prologue.space, step.source.strides
    return len(shape) >= 3 and shape[1] > 1 and strides[1] == 1 and any(n > 1 for n in shape[2:])


def _avg_divisor(win, sizes: tuple[int, ...]) -> list[str]:
    """ATen's avg_pool divisor: the override, else the window clipped to input + padding (count_include_pad),
    else the number of positions inside the input."""
    if win.adaptive:  # ATen divides by each dim's window length in turn (sum / kH / kW)
        return [f"    acc = acc / (float)(e{d} - s{d});" for d in range(len(sizes))]
    if win.divisor is not None:
        return [f"    acc = acc / {float_literal(float(win.divisor))};"]
    pad_terms, in_terms = [], []
    for d, size in enumerate(sizes):
        end = f"min(s{d} + {win.kernel[d]}, {size + win.padding[d]})"
        pad_terms.append(f"({end} - s{d})")
        in_terms.append(f"(min({end}, {size}) - max(s{d}, 0))")
    count = " * ".join(pad_terms if win.count_include_pad else in_terms)
    return [f"    acc = acc / (float)({count});"]


ROW_OUTPUTS = 4  # neighbouring outputs a thread computes along the last pooled dim
MAX_SPAN = 32  # input elements of their joint span it loads per window row (registers)


def row_outputs(win, out_last: int) -> int:
    """Outputs per thread along the last pooled dim: ROW_OUTPUTS where neighbouring windows overlap densely
    (stride and dilation 1 along it), fewer where the span would exceed MAX_SPAN or the dim is shorter; else 1.
    A thread's loads are V elements apart from its neighbour's, so a warp's load touches about V cache lines
    instead of one or two: that pays only where each element then serves several windows. A dilated window
    (the lead's probe: a 1-d max pool, kernel 8, dilation 3) keeps one output per thread."""
    if win.stride[-1] != 1 or win.dilation[-1] != 1 or win.kernel[-1] < 2:
        return 1
    v = ROW_OUTPUTS
    while v > 1 and (v > out_last or _span(win, v) > MAX_SPAN):
        v //= 2
    return v


def _span(win, v: int) -> int:
    return (v - 1) * win.stride[-1] + (win.kernel[-1] - 1) * win.dilation[-1] + 1


def _row_pool_kernel(step: GenStep, ctype: str, v: int) -> str:
    """A thread per V neighbouring outputs along the last pooled dim: window loops over the other pooled dims as
    in the one-output kernel, then the span of the last dim loaded once, each element combined into every window
    holding it (in increasing window position, each output's own order)."""
    spec = step.spec
    win = spec.window  # type: ignore[attr-defined]
    in_shape, out_shape = step.prologue.space, step.epilogue.space
    nd = len(win.kernel)
    last = nd - 1
    out_last, size_last = out_shape[-1], in_shape[-1]
    groups = -(-out_last // v)
    rows = shape_numel(out_shape) // out_last
    isz, osz_rest = shape_numel(in_shape[-nd:]), shape_numel(out_shape[-nd:-1])
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    combine = "kf_max_op()(acc{o}, x)" if max_pool else "acc{o} + x"
    lines = _grid_stride_head(step, ctype, f"// pooling: kernel {list(win.kernel)}, stride {list(win.stride)}, "
                              f"padding {list(win.padding)}, dilation {list(win.dilation)}; a thread per {v} "
                              "neighbouring outputs along the last dim", f"{rows * groups}")
    lines += value_lambda(step, space_of(step), "k", None)
    lines += [f"    const INDEX row = t / {groups};",
              f"    const int first = (int)(t % {groups}) * {v};",
              f"    const INDEX lead = row / {osz_rest};",
              f"    INDEX rest = row % {osz_rest};"]
    for d in reversed(range(last)):
        lines.append(f"    const int q{d} = (int)(rest % {out_shape[-nd + d]}); rest /= {out_shape[-nd + d]};")
    for d in range(last):
        lines.append(f"    const int s{d} = q{d} * {win.stride[d]} - {win.padding[d]};")
    lines.append(f"    const int base = first * {win.stride[-1]} - {win.padding[-1]};")
    init = "-INFINITY" if max_pool else "0.0f"
    lines.append("    float " + ", ".join(f"acc{o} = {init}" for o in range(v)) + ";")
    ind = "    "
    for d in range(last):
        lines.append(f"{ind}for (int w{d} = 0; w{d} < {win.kernel[d]}; ++w{d}) {{")
        ind += "  "
        lines.append(f"{ind}const int p{d} = s{d} + w{d} * {win.dilation[d]};")
        lines.append(f"{ind}if (p{d} < 0 || p{d} >= {in_shape[-nd + d]}) continue;")
    flat = ""  # the input offset of the window row, before the last dim's position
    if last:
        rows_index = "p0"
        for d in range(1, last):
            rows_index = f"({rows_index}) * {in_shape[-nd + d]} + p{d}"
        flat = f"({rows_index}) * {size_last} + "
    for j in range(_span(win, v)):
        users = [o for o in range(v) for w in range(win.kernel[-1]) if o * win.stride[-1] + w * win.dilation[-1] == j]
        if not users:
            continue
        lines.append(f"{ind}if (base + {j} >= 0 && base + {j} < {size_last}) {{")
        lines.append(f"{ind}  const float x = value(lead * {isz} + {flat}base + {j});")
        lines += [f"{ind}  acc{o} = {combine.format(o=o)};" for o in users]
        lines.append(f"{ind}}}")
    for _ in range(last):
        ind = ind[:-2]
        lines.append(f"{ind}}}")
    for o in range(v):
        lines += [f"    if (first + {o} < {out_last}) {{", f"      float acc = acc{o};"]
        if not max_pool:  # the divisor of this output's window
            lines.append(f"      const int s{last} = (first + {o}) * {win.stride[-1]} - {win.padding[-1]};")
            lines += ["  " + ln for ln in _avg_divisor(win, in_shape[-nd:])]
        lines += [f"      const INDEX i = row * {out_last} + first + {o};", "      const float y = acc;"]
        lines += epilogue_lines(step, "i", "      ")
        lines += [f"      out[i] = kf_store<{out_ctype(step)}>(e_result);", "    }"]
    lines += ["  }", "}", ""]
    return "\n".join(lines) + launcher(step, ctype, f"kf_blocks({rows * groups}LL, {BLOCK})")


TILE_OUTPUTS = 4 * BLOCK  # outputs of one row a block computes per work item
MAX_TILE_SPAN = 12 * 1024  # floats of input span staged in shared memory (48 KB)


def last_dim_only(win, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """Does the window slide along the last dim alone (every other pooled dim a 1-wide, unpadded, unit-stride
    window), so that an output row reads exactly the input row of the same index, and does the input span of a
    tile of outputs fit in shared memory (a very wide or strided window keeps the per-thread kernel)?"""
    if win.adaptive or in_shape[:-1] != out_shape[:-1]:
        return False
    return all(win.kernel[d] == 1 and win.stride[d] == 1 and win.padding[d] == 0 for d in range(len(win.kernel) - 1)) \
        and _span(win, tile_outputs(win, out_shape[-1])) <= MAX_TILE_SPAN


def tile_outputs(win, out_last: int) -> int:
    """Outputs per work item: TILE_OUTPUTS, fewer for a short row (a multiple of a warp) or a span over
    MAX_TILE_SPAN."""
    t = min(TILE_OUTPUTS, -(-out_last // 32) * 32)
    while t > 32 and _span(win, t) > MAX_TILE_SPAN:
        t //= 2
    return t


def _tiled_row_pool_kernel(step: GenStep, ctype: str) -> str:
    """A block per (row, tile of T outputs) work item: the tile's input span, the prologue applied, staged in
    shared memory (positions in the padding hold the combine's identity: 0 for a sum that starts at +0, -inf for a
    max, so results are bitwise those of skipping them), then one thread per output walks its window there in
    window order and runs the epilogue."""
    spec = step.spec
    win = spec.window  # type: ignore[attr-defined]
    k = step.kernel
    in_shape, out_shape = step.prologue.space, step.epilogue.space
    nd = len(win.kernel)
    out_last, size_last = out_shape[-1], in_shape[-1]
    rows = shape_numel(out_shape) // out_last
    t = tile_outputs(win, out_last)
    tiles = -(-out_last // t)
    span = _span(win, t)
    stride, dil, kern = win.stride[-1], win.dilation[-1], win.kernel[-1]
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    identity = "-INFINITY" if max_pool else "0.0f"
    combine = "acc = kf_max_op()(acc, x);" if max_pool else "acc += x;"
    lines = [f"// pooling: kernel {list(win.kernel)}, stride {list(win.stride)}, padding {list(win.padding)}, "
             f"dilation {list(win.dilation)}; a block per {t} outputs of a row, its input span in shared memory",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_type(step)} INDEX;",
             f"  __shared__ float span[{span}];",
             f"  for (INDEX item = blockIdx.x; item < (INDEX){rows * tiles}; item += gridDim.x) {{"]
    lines += value_lambda(step, space_of(step), "k", None)
    lines += [f"    const INDEX row = item / {tiles};",
              f"    const int first = (int)(item % {tiles}) * {t};",
              f"    const int base = first * {stride} - {win.padding[-1]};",
              "    __syncthreads();  // the previous item's windows are read",
              f"    for (int j = threadIdx.x; j < {span}; j += {BLOCK}) {{",
              "      const int p = base + j;",
              f"      span[j] = (p >= 0 && p < {size_last}) ? value(row * {size_last} + p) : {identity};",
              "    }",
              "    __syncthreads();",
              f"    for (int o = threadIdx.x; o < {t} && first + o < {out_last}; o += {BLOCK}) {{",
              f"      float acc = {identity};",
              f"      for (int w = 0; w < {kern}; ++w) {{",
              f"        const float x = span[o * {stride} + w * {dil}];",
              f"        {combine}",
              "      }"]
    if not max_pool:  # the divisor of this output's window; the other pooled dims are 1-wide windows at 0
        lines += [f"      const int s{d} = 0;" for d in range(nd - 1)]
        lines.append(f"      const int s{nd - 1} = (first + o) * {stride} - {win.padding[-1]};")
        lines += ["  " + ln for ln in _avg_divisor(win, in_shape[-nd:])]
    lines += [f"      const INDEX i = row * {out_last} + first + o;", "      const float y = acc;"]
    lines += epilogue_lines(step, "i", "      ")
    lines += [f"      out[i] = kf_store<{out_ctype(step)}>(e_result);", "    }", "  }", "}", ""]
    return "\n".join(lines) + launcher(step, ctype, f"kf_blocks({rows * tiles}LL * {BLOCK}, {BLOCK})")
