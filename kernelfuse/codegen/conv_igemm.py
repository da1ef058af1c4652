"""Convolutions as implicit GEMM with the epilogue inside: the output is written once, already fused.

M = output pixels (batch x spatial), N = output channels of a group, K = input channels of a group x kernel
volume. A block computes a BM x BN tile of one group: the prologue gathers the input patch (im2col, never stored)
and the weights into shared memory, the warps multiply on TF32 tensor cores (mma.sync m16n8k8, fp32 accumulate),
and the epilogue stages the tile through shared memory so that each thread applies the anchor's `kN_apply` (the
renderer the stand-alone epilogue kernel uses) and the stores are coalesced in the output's layout. One kernel
covers 1-d, 2-d and 3-d, strided, padded, dilated and grouped convolutions, and transposed ones in gather form (an
output pixel sums the input positions that reach it) split into stride phases, so that no tap that lands between
input positions is multiplied (conv_geometry.Phase). K runs tap-major: where a stage of K is channels of one tap,
one bounds check serves the stage. Operands reach shared memory by cp.async, three stages deep. Sizes are
compile-time constants, as in every kernelfuse kernel; the binding checks the tensors against them. The geometry
this kernel shares with the dense one (kernelfuse.codegen.conv_tc) lives in kernelfuse.codegen.conv_geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph
from kernelfuse.codegen.binding import Binding, py_tuple
from kernelfuse.codegen.common import C_TYPES, INT32_LIMIT, apply_function, channels_last_format
from kernelfuse.codegen.conv_depthwise import render_depthwise
from kernelfuse.codegen.conv_geometry import BM, ConvShape, conv_shape, geometry, pixel_setup, tile_stores
from kernelfuse.codegen.conv_tc import dense_config, render_dense
from kernelfuse.codegen.conv_tma import render_dense_tma, tma_form, tma_forms, tma_launcher, tma_suffix, tma_tile
from kernelfuse.codegen.conv_wgmma import (
    WGC_MIN_TILES,
    WGC_ROW,
    WGC_THREADS,
    WGC_WRITER,
    render_dense_wgmma,
    wgmma_launch,
)
from kernelfuse.plan.conv import DENSE_CHANNELS, tap_major_strides
from kernelfuse.plan.ir import FusedStep, Plan

THREADS = BM  # four warps, each a 32-row slice of the BM = 128 tile
STAGES = 3  # shared-memory stages of K: two in flight while one multiplies (41 KB at the widest tile)


@dataclass(frozen=True)
class TileConfig:
    """Block tile: BM output pixels x `bn` output channels, `bk` of K per shared-memory stage."""

    bn: int
    bk: int

    @property
    def lda(self) -> int:  # +8 floats: the fragment loads' four k rows land on distinct banks
        return BM + 8

    @property
    def ldb(self) -> int:
        return self.bn + 8

    @property
    def ldc(self) -> int:  # +4: the accumulator stores' lanes (2t columns apart) land on distinct banks
        return BM + 4

    @property
    def smem_floats(self) -> int:
        return max(STAGES * self.bk * (self.lda + self.ldb), self.bn * self.ldc)


def tile_config(shape: ConvShape) -> TileConfig:
    """Narrow N tiles for few output channels (no wasted MMA columns), a wide one otherwise; K steps of 16."""
    bn = next((b for b in (8, 16, 32, 64) if b >= shape.cog), 64)
    return TileConfig(bn, 16 if shape.kg > 8 else 8)


def render_conv(plan: Plan, step: FusedStep, out_layout: str = "nchw") -> tuple[str, Binding]:
    """The kernel, its launcher and its binding for a convolution anchor with its epilogue (`impl` generated): the
    implicit GEMM, or for a depthwise one the direct kernel of `conv_depthwise`.
    `out_layout`: the output's memory order, "nchw" (contiguous) or "nhwc" (channels-last)."""
    shape = conv_shape(plan.graph, step)
    epi, k = step.epilogue, step.kernel
    if step.anchor.node.meta.dtype != torch.float32:  # the operands are copied to shared memory as they are
        raise ValueError(f"kernelfuse: {k}: the generated convolution takes fp32 tensors, not "
                         f"{step.anchor.node.meta.dtype}; plan it with the library (conv_impl='library')")
    ctype = C_TYPES[epi.out.dtype]
    index_t = "long long" if epi.out.numel > INT32_LIMIT else "int"
    has_bias = step.anchor.node.args[2] is not None
    ops = range(len(epi.operands))
    operand_params = "".join(f", const {ctype}* __restrict__ in{i}" for i in ops)
    operand_args = "".join(f", in{i}" for i in ops)
    launch_params = "".join(f", const void* in{i}" for i in ops)
    launch_args = "".join(f", (const {ctype}*)in{i}" for i in ops)
    smem = 0  # dynamic shared memory bytes
    wgmma = ""  # the launcher's branch to the kernel's wgmma form
    tma_entry = ""  # the TMA im2col kernel's own launchers, one a form (a channels-last input)
    if step.anchor.impl == "direct":  # planned for a depthwise convolution (kernelfuse.plan.fuse.depthwise)
        comment = f"// {k}: {step.chain(plan.graph)}  (direct depthwise convolution, epilogue inside, {out_layout} " \
                  "output)\n"
        body, grid, threads = render_depthwise(k, shape, ctype, index_t, has_bias, out_layout, operand_params,
                                               operand_args)
    elif dense_kernel(plan.graph, step):
        cfg = dense_config(shape)
        geo = geometry(k, shape)
        lane = "threadIdx.x" if cfg.threads == BM else f"threadIdx.x % {BM}"
        body, grid = render_dense(
            k, shape, geo, cfg, ctype, operand_params, pixel_setup(geo, shape, ctype, lane, cfg.a_nhwc),
            tile_stores(k, shape, cfg.bn, cfg.threads, index_t, ctype, has_bias, out_layout, operand_args,
                        cfg.epilogue_unroll))
        threads, smem = cfg.threads, cfg.smem_bytes
        hopper = cfg.wgmma and grid[0] * grid[1] * grid[2] >= WGC_MIN_TILES  # its wgmma form (codegen.conv_wgmma)
        tma = tma_form(shape, cfg)  # its TMA im2col form (codegen.conv_tma)
        comment = f"// {k}: {step.chain(plan.graph)}  (dense implicit GEMM on TF32 tensor cores, epilogue inside, " \
                  f"{'channels-last' if cfg.a_nhwc else 'NCHW'} input, {out_layout} output" \
                  f"{f'; {k}_kernel_tma: its TMA im2col form on a channels-last input, for Hopper' if tma else ''}" \
                  f"{f'; {k}_kernel_wg: its wgmma form, for Hopper' if hopper else ''})\n"
        if tma:  # the consumer warpgroups' epilogue: tma_tile's CH columns at a time, 128 threads each
            stores = tile_stores(k, shape, tma_tile(shape)[1], 128, index_t, ctype, has_bias, out_layout,
                                 operand_args, cfg.tma_epilogue_unroll, first="t")
            for form in tma_forms(cfg.round_tf32):
                body += render_dense_tma(k, shape, form, operand_params, stores)
                tma_entry += tma_launcher(k, shape, form, launch_params, launch_args)
        if hopper:
            body += render_dense_wgmma(
                k, shape, geo, cfg, operand_params,
                pixel_setup(geo, shape, ctype, WGC_ROW, writer=WGC_WRITER),
                tile_stores(k, shape, cfg.bn, WGC_THREADS, index_t, ctype, has_bias, out_layout, operand_args,
                            cfg.epilogue_unroll))
            wgmma += wgmma_launch(k, grid, cfg, ctype, launch_args)
    else:
        comment = f"// {k}: {step.chain(plan.graph)}  (implicit GEMM, epilogue inside, {out_layout} output)\n"
        body, grid = _kernel(k, shape, tile_config(shape), ctype, index_t, has_bias, step.anchor.fp32, out_layout, operand_params,
                             operand_args)
        threads = THREADS
    opt_in = f"""  const cudaError_t opted = kf_opt_in<{k}_kernel>({smem});
  if (opted != cudaSuccess) return opted;
""" if smem else ""
    launch = f"""
KF_EXPORT cudaError_t {k}_launch(const void* x, const void* w, const void* bias, void* out{launch_params}, cudaStream_t stream) {{
{wgmma}{opt_in}  dim3 grid({grid[0]}, {grid[1]}, {grid[2]});
  {k}_kernel<<<grid, {threads}, {smem}, stream>>>((const {ctype}*)x, (const {ctype}*)w, (const {ctype}*)bias, ({ctype}*)out{launch_args});
  return cudaGetLastError();
}}
{tma_entry}"""
    return comment + apply_function(k, epi, ctype, index_t) + body + launch, _binding(plan, step, shape, out_layout)


def dense_kernel(graph: Graph, step: FusedStep) -> bool:
    """Whether the anchor runs the dense kernel (kernelfuse.codegen.conv_tc): TF32, and the planner gave it the
    tap-major weight copy it reads (kernelfuse.plan.conv.tap_major_weights)."""
    node = step.anchor.node
    w = graph[node.args[1]].meta
    return step.anchor.impl == "generated" and not step.anchor.fp32 and node.meta.dtype == torch.float32 \
        and w is not None and w.stride == tap_major_strides(w.shape, bool(node.args[6])) \
        and conv_shape(graph, step).cig % DENSE_CHANNELS == 0


def carries_tma(graph: Graph, step: FusedStep) -> bool:
    """Whether the anchor's dense kernel has a TMA im2col form in the file (kernelfuse.codegen.conv_tma)."""
    return bool(carried_tma_forms(graph, step))


def carried_tma_forms(graph: Graph, step: FusedStep) -> tuple[str, ...]:
    """The TMA im2col kernel's forms the file carries for the anchor (conv_tma.tma_forms; none where it has none)."""
    if not dense_kernel(graph, step):
        return ()
    shape = conv_shape(graph, step)
    cfg = dense_config(shape)
    return tma_forms(cfg.round_tf32) if tma_form(shape, cfg) else ()


def _kernel(k: str, s: ConvShape, cfg: TileConfig, ctype: str, index_t: str, has_bias: bool, split: bool,
            out_layout: str, operand_params: str, operand_args: str) -> tuple[str, tuple[int, int, int]]:
    geo = geometry(k, s)
    nph, iv, tables, tap_setup, tap_lines, kp_expr = geo.nph, geo.iv, geo.tables, geo.tap_setup, geo.tap_lines, geo.kp_expr
    gather, spatial = geo.gather, geo.spatial
    b_per_thread = -(-cfg.bn * cfg.bk // THREADS)
    nf = cfg.bn // 8
    nl = "\n"
    if s.cig % cfg.bk == 0:  # a K stage is BK channels of one tap: one bounds check per stage
        a_copy = f"""    {{
      const int tap = kt * BK / {s.cig}, ci0 = kt * BK % {s.cig};
{nl.join(tap_lines("tap", "      "))}
      bool ok = m_ok;
{nl.join(gather("      "))}
      const float* src = xg + (ok ? {spatial} + ci0 * {iv} : 0);
#pragma unroll
      for (int j = 0; j < BK; ++j) kf_cp_async4(As + j * LDA + threadIdx.x, src + j * {iv}, ok);
    }}"""
    else:
        a_copy = f"""#pragma unroll
    for (int j = 0; j < BK; ++j) {{
      const int kidx = kt * BK + j;
      bool ok = m_ok && kidx < KGP;
      int off = 0;
      if (ok) {{
        const int tap = kidx / {s.cig}, ci = kidx % {s.cig};
{nl.join(tap_lines("tap", "        "))}
{nl.join(gather("        "))}
        off = ci * {iv} + {spatial};
      }}
      kf_cp_async4(As + j * LDA + threadIdx.x, xg + (ok ? off : 0), ok);
    }}"""
    # B: thread element j of a stage is column n = e % BN, row kq = e / BN (consecutive threads, consecutive
    # columns: conflict-free shared stores); its weight offset is w_base[j] plus a part common to the stage
    if s.transposed:  # weight (Cin, Cout/g, k...)
        w_offset = f"((grp * {s.cig} + ci) * {s.cog} + co) * {s.kv} + kp"
        w_base, w_stage = f"((grp * {s.cig} + kq) * {s.cog} + co) * {s.kv}", f"ci0 * {s.cog * s.kv} + kp"
    else:  # weight (Cout, Cin/g, k...)
        w_offset = f"(grp * {s.cog} + co) * {s.kg} + ci * {s.kv} + kp"
        w_base, w_stage = f"(grp * {s.cog} + co) * {s.kg} + kq * {s.kv}", f"ci0 * {s.kv} + kp"
    b_elem = f"""      const int e = threadIdx.x + j * {THREADS};
      if (e >= BN * BK) break;"""
    if s.cig % cfg.bk == 0:  # one tap per stage: the per-thread bases, computed once, plus the stage's offset
        b_setup = f"""  int w_base[{b_per_thread}];  // -1: the element is outside the weight (a column past COG)
#pragma unroll
  for (int j = 0; j < {b_per_thread}; ++j) {{
    const int e = threadIdx.x + j * {THREADS}, kq = e / BN, co = n0 + e % BN;
    w_base[j] = co < COG ? {w_base} : -1;
  }}"""
        b_copy = f"""    {{
      const int tap = kt * BK / {s.cig}, ci0 = kt * BK % {s.cig}, kp = {kp_expr}, stage = {w_stage};
#pragma unroll
      for (int j = 0; j < {b_per_thread}; ++j) {{
{b_elem}
        kf_cp_async4(Bs + (e / BN) * LDB + e % BN, w + (w_base[j] >= 0 ? w_base[j] + stage : 0), w_base[j] >= 0);
      }}
    }}"""
    else:
        b_setup = ""
        b_copy = f"""#pragma unroll
    for (int j = 0; j < {b_per_thread}; ++j) {{
{b_elem}
      const int kidx = kt * BK + e / BN, co = n0 + e % BN;
      const bool ok = co < COG && kidx < KGP;
      int off = 0;
      if (ok) {{
        const int tap = kidx / {s.cig}, ci = kidx % {s.cig}, kp = {kp_expr};
        off = {w_offset};
      }}
      kf_cp_async4(Bs + (e / BN) * LDB + e % BN, w + off, ok);
    }}"""
    m_phase = geo.m_phase
    unroll = "#pragma unroll" if nph == 1 and -(-s.cig * len(geo.found[0].taps) // cfg.bk) <= 8 else "#pragma unroll 1"
    grid = (-(-geo.max_m // BM) * nph, -(-s.cog // cfg.bn), s.groups)
    body = f"""{tables}
__global__ void __launch_bounds__({THREADS}, {_min_blocks(cfg, split)}) {k}_kernel(const {ctype}* __restrict__ x, const {ctype}* __restrict__ w, const {ctype}* __restrict__ bias, {ctype}* __restrict__ out{operand_params}) {{
  constexpr int BK = {cfg.bk}, BN = {cfg.bn}, LDA = {cfg.lda}, LDB = {cfg.ldb}, LDC = {cfg.ldc}, COG = {s.cog};
  __shared__ float smem[{cfg.smem_floats}];
  __shared__ int img_s[{BM}], pix_s[{BM}];
  // phases vary fastest: blocks running together write interleaved pixels of one region, so L2 gathers whole
  // sectors before they go to memory
  const int ph = blockIdx.x % {nph}, grp = blockIdx.z, m0 = blockIdx.x / {nph} * {BM}, n0 = blockIdx.y * BN;
  const int MPH = {m_phase}, KGP = {s.cig} * {geo.ntaps}, KT = (KGP + BK - 1) / BK;
  if (m0 >= MPH) return;  // this phase has fewer pixels than the largest one (the whole block leaves)
  (void)ph;
{pixel_setup(geo, s, ctype)}
{tap_setup}
{b_setup}
  // stage kt of A (the gathered input) and B (the weights) into shared buffer kt % STAGES, asynchronously
  auto issue = [&](int kt) {{
    float* As = smem + (kt % {STAGES}) * BK * (LDA + LDB);
    float* Bs = As + BK * LDA;
{a_copy}
{b_copy}
    kf_cp_async_commit();
  }};
  float acc[2][{nf}][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < {nf}; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  const int wm = (threadIdx.x / 32) * 32;
#pragma unroll
  for (int st = 0; st < {STAGES} - 1; ++st) {{
    if (st < KT) issue(st);
    else kf_cp_async_commit();  // empty groups keep the count the waits below rely on
  }}
{unroll}
  for (int kt = 0; kt < KT; ++kt) {{
    kf_cp_async_wait<{STAGES} - 2>();  // stage kt has landed (this thread's copies)
    __syncthreads();  // ... and every thread's; stage kt - 1's buffer is free again
    if (kt + {STAGES} - 1 < KT) issue(kt + {STAGES} - 1);  // refills kt - 1's buffer while kt multiplies
    else kf_cp_async_commit();
    const float* As = smem + (kt % {STAGES}) * BK * (LDA + LDB);
    const float* Bs = As + BK * LDA;
{_stage_products(nf, split)}
  }}
  __syncthreads();  // every warp is done with the stages: the accumulator tile reuses their memory
  // the tile through shared memory: every thread then applies the epilogue to elements in store order
  {{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < {nf}; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          smem[(j * 8 + 2 * t + (e & 1)) * LDC + wm + i * 16 + g + (e >> 1) * 8] = acc[i][j][e];
  }}
  __syncthreads();
{tile_stores(k, s, cfg.bn, THREADS, index_t, ctype, has_bias, out_layout, operand_args, 4)}
}}
"""
    return body, grid


def _stage_products(nf: int, split: bool) -> str:
    """C lines: the stage's products into the accumulator. 3xTF32 (`split`) sums each stage in a fresh tensor-core
    accumulator and adds it to `acc` in registers: the tensor cores' own fp32 accumulation rounds toward zero, an
    error that grows with K (level-2-sized convolutions measured 2-5x eager's float64 error with one accumulator
    across K; kernelfuse.codegen.gemm_tc has the same split, measured there)."""
    if not split:
        return """#pragma unroll
    for (int kk = 0; kk < BK; kk += 8)
      kf_igemm_k8<2, {nf}, false>(acc, As + kk * LDA, LDA, Bs + kk * LDB, LDB, wm, 0);""".replace("{nf}", str(nf))
    return f"""    float part[2][{nf}][4];  // this stage's products: a fresh tensor-core accumulator
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < {nf}; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8)
      kf_igemm_k8<2, {nf}, true>(part, As + kk * LDA, LDA, Bs + kk * LDB, LDB, wm, 0);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < {nf}; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];  // round to nearest, outside the tensor cores"""


def _binding(plan: Plan, step: FusedStep, shape: ConvShape, out_layout: str) -> Binding:
    epi, k = step.epilogue, step.kernel
    node = step.anchor.node
    dtype = epi.out.dtype
    w_meta = plan.graph[node.args[1]].meta
    ops = range(len(epi.operands))
    params = "".join(f", in{i}" for i in ops)
    x_meta = plan.graph[node.args[0]].meta
    dense = dense_kernel(plan.graph, step)
    cfg = dense_config(shape) if dense else None
    tma = cfg is not None and tma_form(shape, cfg)  # the file holds {k}_launch_tma (codegen.conv_tma) ...
    forms = tma_forms(cfg.round_tf32) if tma else ()  # ... and {k}_launch_tma_prerounded where it rounds
    lines = [f"# {k}: {step.chain(plan.graph)}  (implicit-GEMM convolution, epilogue inside)",
             f"def {k}(self, x, w, b{params}):",
             f'    _check_dense(x, "{k} input", {py_tuple(x_meta.shape)}, {dtype})',
             f'    _check_dense(w, "{k} weight", {py_tuple(w_meta.shape)}, {dtype})']
    if tma:  # the input in the layout of the kernel that runs (channels-last for a TMA one, else the dense one's)
        # and the launcher that runs (the pre-rounded form's only on the binding's own rounding copy); a 1-d
        # convolution's input viewed (N, C, 1, L) (no copy: the TMA kernel's H = 1, the dense kernel reads the same
        # bytes as NCL)
        other = channels_last_format(x_meta) if cfg.a_nhwc else "torch.contiguous_format"
        launchers = "".join(f", self._{k}_tma{tma_suffix(form)}" for form in forms)
        x_in, x_shape = ("x", x_meta.shape) if len(x_meta.shape) == 4 else \
            ("x.unsqueeze(2) if x.dim() == 3 else x", (*x_meta.shape[:2], 1, x_meta.shape[2]))
        lines[2] = (f"    x, fmt, launcher = self._conv_tma_input({x_in}, {other}, self._{k}{launchers})\n"
                    f'    _check_dense(x, "{k} input", {py_tuple(x_shape)}, {dtype}, fmt)')
    elif cfg is not None and cfg.a_nhwc:  # 16-byte copies of 4 input channels
        fmt = channels_last_format(x_meta)
        lines[2] = (f'    _check_dense(x, "{k} input (channels-last)", {py_tuple(x_meta.shape)}, {dtype}, {fmt})')
        # the forward passes the input as it is (NCHW): here it becomes channels-last (a copy where it is not)
        lines.insert(2, f"    if x.dim() == {len(x_meta.shape)}:\n        x = x.contiguous(memory_format={fmt})")
    if dense:  # the weight through its tap-major copy, in 16-byte copies
        lines[-1] = (f'    _check(w, "{k} weight (tap-major)", {py_tuple(w_meta.shape)}, {py_tuple(w_meta.stride)}, '
                     f'{dtype})')
        lines.append("    if w.data_ptr() % 16:")
        lines.append(f'        raise ValueError("kernelfuse: {k} weight must be 16-byte aligned")')
    if "prerounded" in forms:  # the TMA forms read the weight by descriptor as it is: rounded here, once a version
        lines.append(f"    if launcher is not self._{k}:\n        w = self._tf32_weight(w, \"{k}\")")
    if node.args[2] is not None:
        lines.append(f'    _check_dense(b, "{k} bias", {py_tuple((shape.cout,))}, {dtype})')
    for i, operand in enumerate(epi.operands):
        lines.append(f'    _check_dense(in{i}, "{k} operand in{i} ({operand.ref.name})", {py_tuple(operand.meta.shape)}, '
                     f"{dtype})")
    if out_layout == "nhwc":  # channels innermost (torch's channels-last for 2-d/3-d; 1-d has no name for it)
        dims = epi.out.shape
        stored, order = (dims[0], *dims[2:], dims[1]), (0, len(dims) - 1, *range(1, len(dims) - 1))
        lines.append(f"    out = torch.empty({py_tuple(stored)}, dtype={dtype}, device=x.device).permute{order}")
    else:
        lines.append(f"    out = torch.empty({py_tuple(epi.out.shape)}, dtype={dtype}, device=x.device)")
    bias = "b.data_ptr()" if node.args[2] is not None else "None"
    ptrs = "".join(f", in{i}.data_ptr()" for i in ops)
    launcher = "launcher" if tma else f"self._{k}"
    lines.append(f'    self._launch({launcher}, "{k}", x, x.data_ptr(), w.data_ptr(), {bias}, out.data_ptr(){ptrs})')
    lines.append("    return out")
    init = f'self._{k} = self._function("{k}_launch", [ctypes.c_void_p] * {4 + len(epi.operands)})'
    for form in forms:
        init += (f'\nself._{k}_tma{tma_suffix(form)} = self._function("{k}_launch_tma{tma_suffix(form)}", '
                 f"[ctypes.c_void_p] * {4 + len(epi.operands)})")
    return Binding(init, "\n".join(lines))


def _min_blocks(cfg: TileConfig, split: bool) -> int:
    """Blocks per SM the registers must allow (launch bounds). ptxas, sm_90: every tile fits 128 registers at 4
    blocks without spills (the operands reach shared memory by cp.async, not through registers); the 64-wide tile
    with 3xTF32's small parts spilled 32-48 bytes there and fits 168 registers at 3 blocks."""
    return 3 if split and cfg.bn == 64 else 4
