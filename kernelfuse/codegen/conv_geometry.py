"""The geometry both implicit-GEMM convolution kernels share (kernelfuse.codegen.conv_igemm's general one and
kernelfuse.codegen.conv_tc's dense one): the convolution's sizes as read from the graph (ConvShape), the stride
phases a transposed convolution splits into (Phase), and the C text that maps a thread to its output pixel, bounds
its input gathers and stores the block's accumulator tile through the epilogue (Geometry, pixel_setup,
tile_stores). M = output pixels (batch x spatial): a block covers BM of them, one a thread.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from kernelfuse.capture import Graph
from kernelfuse.plan.ir import FusedStep

BM = 128  # output pixels a block covers, one a thread (the kernels' blocks are BM threads)
LDC = BM + 4  # the accumulator tile's row stride (tile_stores): its stores land on distinct banks


@dataclass(frozen=True)
class ConvShape:
    """The convolution's sizes, read from the graph: what the kernel is specialised to."""

    batch: int
    cin: int
    cout: int
    groups: int
    in_size: tuple[int, ...]
    out_size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool

    @property
    def cig(self) -> int:
        return self.cin // self.groups

    @property
    def cog(self) -> int:
        return self.cout // self.groups

    @property
    def kv(self) -> int:
        return math.prod(self.kernel)

    @property
    def kg(self) -> int:
        return self.cig * self.kv

    @property
    def pixels(self) -> int:
        return math.prod(self.out_size)

    @property
    def m(self) -> int:
        return self.batch * self.pixels


def conv_shape(graph: Graph, step: FusedStep) -> ConvShape:
    node = step.anchor.node
    x, w = graph[node.args[0]].meta, graph[node.args[1]].meta
    stride, padding, dilation, transposed, _, groups = node.args[3:9]
    rank = len(w.shape) - 2
    cout = node.meta.shape[1]
    return ConvShape(x.shape[0], x.shape[1], cout, groups, tuple(x.shape[2:]), tuple(node.meta.shape[2:]),
                     tuple(w.shape[2:]), _per_dim(stride, rank), _per_dim(padding, rank), _per_dim(dilation, rank),
                     bool(transposed))


@dataclass(frozen=True)
class Phase:
    """Output pixels o = origin + step * v (v < count, per dimension) that one set of kernel taps reaches: input
    position i = scale * v + c for each tap (its flat kernel position, c). A forward convolution is one phase
    (step 1, scale = stride); a transposed one of stride s has prod(s) phases (step s, scale 1), each reading
    only the taps that land on an input position, so no multiply-add is spent on the zeros of the gather form."""

    origin: tuple[int, ...]
    count: tuple[int, ...]
    taps: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def pixels(self) -> int:
        return math.prod(self.count)


def phases(s: ConvShape) -> tuple[tuple[int, ...], tuple[int, ...], list[Phase]]:
    """(step, scale, phases) of the convolution: see Phase."""
    positions = list(itertools.product(*(range(k) for k in s.kernel)))
    if not s.transposed:
        taps = tuple((kp, tuple(q * d - p for q, d, p in zip(qs, s.dilation, s.padding, strict=True)))
                     for kp, qs in enumerate(positions))
        return (1,) * len(s.kernel), s.stride, [Phase((0,) * len(s.kernel), s.out_size, taps)]
    found = []
    for r in itertools.product(*(range(st) for st in s.stride)):
        count = tuple(max(0, -(-(o - rd) // st)) for o, rd, st in zip(s.out_size, r, s.stride, strict=True))
        if 0 in count:
            continue
        taps = tuple((kp, tuple((rd + p - q * d) // st for rd, p, q, d, st in zip(r, s.padding, qs, s.dilation,
                                                                                 s.stride, strict=True)))
                     for kp, qs in enumerate(positions)
                     if all((rd + p - q * d) % st == 0 for rd, p, q, d, st in zip(r, s.padding, qs, s.dilation,
                                                                                  s.stride, strict=True)))
        found.append(Phase(r, count, taps))
    return s.stride, (1,) * len(s.kernel), found


@dataclass(frozen=True)
class Geometry:
    """The C text both implicit-GEMM kernels share: the phases' tables, the thread's output pixel (the column of A it
    gathers) and the bounds of its gathers. A block of `threads` threads covers BM = `threads` output pixels."""

    rank: int
    nph: int
    iv: int  # input pixels per channel
    in_strides: list[int]  # input pixels per step of each spatial dimension
    tables: str
    tap_setup: str
    tap_lines: Callable[[str, str], list[str]]  # (tap expression, indent) -> the lines defining c0.. of that tap
    kp_expr: str  # the flat kernel position of the stage's tap
    ntaps: str
    count: list[str]
    v_lines: list[str]
    base: list[str]
    pix: str
    gather: Callable[[str], list[str]]  # indent -> the lines that bound-check the input position i0..
    spatial: str
    m_phase: str
    max_m: int
    found: tuple[Phase, ...]


def geometry(k: str, s: ConvShape, threads: int = BM) -> Geometry:
    """The shared C text of kernel `k` (see Geometry)."""
    rank = len(s.kernel)
    step, scale, found = phases(s)
    nph = len(found)
    iv = math.prod(s.in_size)
    in_strides = [math.prod(s.in_size[d + 1:]) for d in range(rank)]
    out_strides = [math.prod(s.out_size[d + 1:]) for d in range(rank)]
    tables = tap_setup = ""
    if not s.transposed or set(s.stride) == {1}:  # one phase whose sizes and taps are compile-time arithmetic
        (ph,) = found
        count = [str(c) for c in ph.count]
        origin = [str(o) for o in ph.origin]
        ntaps = str(len(ph.taps))

        def tap_lines(tap: str, ind: str) -> list[str]:
            # tap == flat kernel position; c = q * dilation - padding (forward) or (padding - q * dilation)
            lines = _unravel(tap, s.kernel, "q", ind)
            sign = -1 if s.transposed else 1
            return lines + [f"{ind}const int c{d} = {sign} * (q{d} * {s.dilation[d]} - {s.padding[d]});"
                            for d in range(rank)]
        kp_expr = "tap"
    else:  # a block's phase is blockIdx.x % NPH: its sizes and taps from small tables
        maxt = max(1, max(len(p.taps) for p in found))

        def table(rows: list) -> str:
            return "{" + ", ".join("{" + ", ".join(map(str, r)) + "}" if isinstance(r, list | tuple) else str(r)
                                   for r in rows) + "}"
        taps_c = [[list(c) for _, c in p.taps] + [[0] * rank] * (maxt - len(p.taps)) for p in found]
        taps_kp = [[kp for kp, _ in p.taps] + [0] * (maxt - len(p.taps)) for p in found]
        tables = (f"__device__ const int {k}_count[{nph}][{rank}] = {table([p.count for p in found])};\n"
                  f"__device__ const int {k}_origin[{nph}][{rank}] = {table([p.origin for p in found])};\n"
                  f"__device__ const int {k}_ntaps[{nph}] = {table([len(p.taps) for p in found])};\n"
                  f"__device__ const int {k}_kp[{nph}][{maxt}] = {table(taps_kp)};\n"
                  f"__device__ const int {k}_c[{nph}][{maxt}][{rank}] = "
                  "{" + ", ".join(table(t) for t in taps_c) + "};\n")
        count = [f"{k}_count[ph][{d}]" for d in range(rank)]
        origin = [f"{k}_origin[ph][{d}]" for d in range(rank)]
        ntaps = f"{k}_ntaps[ph]"

        # the block's taps in shared memory: the gathers read them at every element of every stage
        tap_setup = f"""  __shared__ int taps_s[{maxt}][{rank + 1}];  // c per dimension, then the flat kernel position
  for (int i = threadIdx.x; i < {maxt * (rank + 1)}; i += {threads}) {{
    const int tp = i / {rank + 1}, d = i % {rank + 1};
    taps_s[tp][d] = d < {rank} ? {k}_c[ph][tp][d] : {k}_kp[ph][tp];
  }}
  __syncthreads();"""

        def tap_lines(tap: str, ind: str) -> list[str]:
            return [f"{ind}const int c{d} = taps_s[{tap}][{d}];" for d in range(rank)]
        kp_expr = f"taps_s[tap][{rank}]"
    # the thread's output pixel: v over the phase's counts, o = origin + step * v
    v_lines, rest = [], "r"
    for d in range(rank - 1, -1, -1):
        v_lines.insert(0, f"    const int v{d} = {rest}{f' % {count[d]}' if d > 0 else ''};")
        rest = f"({rest} / {count[d]})"
    pix = " + ".join(f"({origin[d]} + {step[d]} * v{d}) * {out_strides[d]}" for d in range(rank))
    base = [f"    base[{d}] = {scale[d]} * v{d};" for d in range(rank)]

    def gather(ind: str) -> list[str]:
        lines = []
        for d in range(rank):
            lines.append(f"{ind}const int i{d} = base[{d}] + c{d};")
            lines.append(f"{ind}ok = ok && i{d} >= 0 && i{d} < {s.in_size[d]};")
        return lines
    spatial = " + ".join(f"i{d} * {in_strides[d]}" for d in range(rank))
    m_phase = f"{s.batch} * " + " * ".join(count)
    max_m = max(s.batch * p.pixels for p in found)
    return Geometry(rank, nph, iv, in_strides, tables, tap_setup, tap_lines, kp_expr, ntaps, count, v_lines, base,
                    pix, gather, spatial, m_phase, max_m, tuple(found))


def block_lines(geo: Geometry, per_tap: int) -> str:
    """C lines: the block's phase, group, first output pixel (m0) and channel (n0), the phase's pixels (MPH) and K
    stages (KT, `per_tap` a tap); a block past its phase's pixels returns. Phases vary fastest (see conv_igemm)."""
    return f"""  const int ph = blockIdx.x % {geo.nph}, grp = blockIdx.z;
  const int m0 = blockIdx.x / {geo.nph} * {BM}, n0 = blockIdx.y * BN;
  const int MPH = {geo.m_phase}, KT = {geo.ntaps} * {per_tap};
  if (m0 >= MPH) return;
  (void)ph;"""


def pixel_setup(geo: Geometry, s: ConvShape, ctype: str, lane: str = "threadIdx.x", origins: bool = False,
                writer: str | None = None) -> str:
    """C lines: the output pixel m = m0 + `lane` of this thread (its column of A), its input origin `base`, its
    image's input `xg`, and the block's image and pixel of each column (img_s, pix_s: -1 past the phase's pixels),
    written by the threads whose lane is threadIdx.x, or where given by those for which `writer` holds (one a
    lane); `origins`: the input origins too (org_s)."""
    nl = "\n"
    count = geo.count
    org = f"""
    for (int d = 0; d < {geo.rank}; ++d) org_s[threadIdx.x][d] = base[d];""" if origins else ""
    assert writer is None or not origins, "origins are written by the threads whose lane is threadIdx.x"
    writes = f"""
    if ({writer}) {{
      img_s[{lane}] = m_ok ? img : -1;
      pix_s[{lane}] = {geo.pix};
    }}""" if writer is not None else f"""
    if ({lane} == threadIdx.x) {{
      img_s[threadIdx.x] = m_ok ? img : -1;
      pix_s[threadIdx.x] = {geo.pix};{org}
    }}""" if lane != "threadIdx.x" else f"""
    img_s[threadIdx.x] = m_ok ? img : -1;
    pix_s[threadIdx.x] = {geo.pix};{org}"""
    return f"""  // the output pixel whose column of A this thread gathers
  const int m = m0 + {lane};
  const bool m_ok = m < MPH;
  int base[{geo.rank}];
  const {ctype}* xg = x;
  {{
    const int img = m_ok ? m / ({" * ".join(count)}) : 0, r = m_ok ? m % ({" * ".join(count)}) : 0;
{nl.join(geo.v_lines)}
{nl.join(geo.base)}
    xg = x + ((long long)img * {s.cin} + grp * {s.cig}) * {geo.iv};{writes}
  }}"""


def tile_stores(k: str, s: ConvShape, bn: int, threads: int, index_t: str, ctype: str, has_bias: bool,
                out_layout: str, operand_args: str, unroll: int = 1, first: str = "threadIdx.x") -> str:
    """C lines: the block's BM x `bn` accumulator tile, staged in shared memory as smem[n * LDC + m], through the
    epilogue (`kN_apply`) to the output, in store order (pixels fastest for NCHW, channels for channels-last), by
    `threads` threads whose index is `first` (the TMA kernel's warpgroups store their own tiles).

    `unroll` elements a thread at a time in two phases: their loads and math, then their stores, each one predicated
    store (kf_store_if; an element past the tile's last pixel or channel is computed at valid indices and not
    stored). So the elements' operand loads and math overlap: with a `continue` or an `if` around each store the
    compiler made every element a branch of its own, in series, latency-bound at the dense kernels' eight warps an
    SM (stop 57's SASS of level-2 54's kernels)."""
    if out_layout == "nchw":
        order = f"const int nl = e / {BM}, ml = e % {BM};"
        store = "i"
    else:
        order = f"const int ml = e / {bn}, nl = e % {bn};"
        store = f"(({index_t})img * {s.pixels} + pix) * {s.cout} + co"
    bias = " + kf_load(bias[co])" if has_bias else ""
    u = max(d for d in (1, 2, 4, 8) if d <= max(unroll, 1) and BM * bn % (threads * d) == 0)
    return f"""  for (int e0 = {first}; e0 < {BM} * BN; e0 += {threads * u}) {{
    {ctype} v[{u}];
    {index_t} at[{u}];
    bool ok[{u}];
#pragma unroll
    for (int j = 0; j < {u}; ++j) {{
      const int e = e0 + j * {threads};
      {order}
      const int img0 = img_s[ml], col = n0 + nl;
      ok[j] = img0 >= 0 && col < COG;
      const int img = ok[j] ? img0 : 0, co = grp * COG + (ok[j] ? col : 0), pix = pix_s[ml];
      const {index_t} i = (({index_t})img * {s.cout} + co) * {s.pixels} + pix;
      at[j] = {store};
      v[j] = kf_store<{ctype}>({k}_apply(smem[nl * LDC + ml]{bias}, i{operand_args}));
    }}
#pragma unroll
    for (int j = 0; j < {u}; ++j) kf_store_if(out + at[j], v[j], ok[j]);
  }}"""


def _unravel(flat: str, sizes: tuple[int, ...], name: str, ind: str) -> list[str]:
    """C lines `const int {name}{d} = ...;`: the coordinates of row-major index `flat` over `sizes`."""
    lines = []
    for d in range(len(sizes) - 1, -1, -1):
        lines.insert(0, f"{ind}const int {name}{d} = {flat}{f' % {sizes[d]}' if d > 0 else ''};")
        flat = f"({flat} / {sizes[d]})"
    return lines


def _per_dim(value: object, rank: int) -> tuple[int, ...]:
    """A convolution argument (stride, padding, dilation) per spatial dimension: one value stands for all."""
    values = tuple(value) if isinstance(value, list | tuple) else (value,)
    return values * rank if len(values) == 1 else values
