"""The dense implicit-GEMM convolution: large channel counts on TF32 tensor cores, epilogue inside.

For a convolution whose weight the planner has copied tap-major (`kernelfuse.plan.conv.tap_major_weights`: each
output channel's K = taps x input channels, the channels contiguous), where eager computes in TF32 and each group has
a multiple of 32 input channels. A stage of K is then 32 channels of one tap, so one bounds check serves a pixel's
gathers of the stage, and the weight arrives in 16-byte cp.async copies. The input is read either as it is (NCHW:
4-byte cp.async, coalesced along the output pixels) or channels-last (16-byte copies of 4 channels, as the weight).
Tiles: 128 output pixels x 64 or 128 output channels a block, K in stages of 32 (DenseConfig). Shared layouts,
chosen so that every fragment load is conflict-free:
  A from NCHW: quads of two k (a pair) x two pixels 8 apart, element (k, m) at (k >> 1) * 2 * LDA2 +
  ((m >> 4) * 8 + (m & 7)) * 4 + (k & 1) * 2 + ((m >> 3) & 1), LDA2 = 130: one 16-byte load gives a lane its
  m16k8 fragment in the register order the MMA takes (no moves to build it);
  A from channels-last, and B: row m (n) holds its 32 k, the 16-byte chunks XOR-swizzled by bit 0 of the row.
Within each 16 k, MMA step s takes k = t and t + 4 from columns 4t + 2s and 4t + 2s + 1 of both operands (a
reordering of the sum's terms), so one 8- or 16-byte load serves both of a lane's k.
The geometry (phases, taps, bounds, the epilogue's stores) is the implicit GEMM's, from `conv_geometry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.codegen.conv_geometry import BM, LDC, ConvShape, Geometry, block_lines
from kernelfuse.codegen.conv_tma import tma_shape

BK = 32
LDA2 = BM + 2  # 2 * LDA2 % 32 == 4: a warp's 16-byte A loads (k-pair 2t + s, quad g) hit 32 distinct banks a phase


@dataclass(frozen=True)
class DenseConfig:
    """One tiling of the dense kernel: `bn` output channels a block, warps_m x warps_n warps over the 128 x bn tile,
    `stages` K stages in flight; the input read NCHW or channels-last (`a_nhwc`); TF32 rounding to nearest of the
    operands (`round_tf32`; else the tensor cores ignore the low mantissa bits); the epilogue loop unrolled. Its
    wgmma form (kernelfuse.codegen.conv_wgmma, NCHW input), carried where `wgmma`: `wg_stages` stages in its ring,
    `wg_min_blocks` blocks an SM the registers must allow, A by descriptor or (`wg_a_regs`) as register fragments,
    as the GEMM loop. Off by default: on level-2 54, 4, 46 and 2 (H200) each wgmma configuration ran no faster than
    the mma.sync kernel, and both ran 2.5-4x slower than cuDNN's channels-last call (benchmarks/NOTES.md, stop 47).
    Its TMA im2col form (kernelfuse.codegen.conv_tma, Hopper: a channels-last input, whatever `a_nhwc` says),
    carried where `tma` and the shape allows (conv_tma.tma_form); dense_config turns it on for such shapes, and it
    computes as this kernel does (operands rounded to TF32 where `round_tf32`, else truncated)."""

    bn: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3
    a_nhwc: bool = False
    round_tf32: bool = True
    epilogue_unroll: int = 1
    tma_epilogue_unroll: int = 8  # the TMA form's (stop 57, H200, level-2 54/46/32: 8 ran 5-9% faster than 4)
    wg_stages: int = 6
    wg_min_blocks: int = 1
    wg_a_regs: bool = False
    wgmma: bool = False
    tma: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def mf(self) -> int:  # m16 tiles of a warp
        return BM // self.warps_m // 16

    @property
    def nf(self) -> int:  # n8 tiles of a warp
        return self.bn // self.warps_n // 8

    @property
    def a_stage(self) -> int:
        return BM * BK if self.a_nhwc else BK // 2 * LDA2 * 2

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a block: the stages, or the accumulator tile after them, whichever is larger."""
        return 4 * max(self.stages * (self.a_stage + self.bn * BK), self.bn * LDC)


def dense_config(s: ConvShape) -> DenseConfig:
    """The tiling for convolution `s`: 64 output channels a block for up to 64 a group, else 128; the epilogue
    unrolled by 4 (its libm calls interleave: Mish twice 14.0 -> 11.1 ms on level-2 problem 4, H200). Measured
    against the other DenseConfig choices in benchmarks/results/session42_h200x2.md (calls 1-2). The file carries
    the TMA im2col form for Hopper where the shape allows it (conv_tma.tma_shape: a 1-d or 2-d convolution, dilated,
    strided or transposed of stride 1, whose tiles fill an H200 twice; its truncating form ran level-2 problem 54's
    convolution bare in 1.34 ms against this kernel's 3.11 on an H200); its launcher runs only on a
    compute-capability 9.0 device, so other GPUs run this kernel as before."""
    return DenseConfig(bn=64 if s.cog <= 64 else 128, epilogue_unroll=4, tma=tma_shape(s))


CONV_TC_PRELUDE = r"""
// ---- dense implicit-GEMM convolution on TF32 tensor cores (kernelfuse.codegen.conv_tc) ----
// A row of 32 floats whose 16-byte chunks are XOR-swizzled by bit 0 of the row: the offset of (row, k)
__device__ __forceinline__ int kf_swz32(int row, int k) { return row * 32 + ((((k >> 2) ^ ((row & 1) << 2))) << 2) + (k & 3); }
__device__ __forceinline__ float kf_tf32_or_raw(float x, bool round) { return round ? kf_round_tf32(x) : x; }
// Offset of element (k, m) of an NCHW-gathered A stage, LDA2 pairs a k-pair row (see the module's docstring)
template <int LDA2>
__device__ __forceinline__ int kf_a_nchw(int k, int m) {
  return (k >> 1) * 2 * LDA2 + ((m >> 4) * 8 + (m & 7)) * 4 + (k & 1) * 2 + ((m >> 3) & 1);
}

// One k16 step of a warp's (16 MF) x (8 NF) tile. As: the stage's A, NCHW-gathered (quads, kf_a_nchw) or
// channels-last (A_NHWC: swizzled rows of 32 k); Bs: its B in swizzled rows. ROUND: TF32 rounding to
// nearest as the operands enter the tensor cores. The CPU emulation computes each lane's elements with scalar FMAs
// on the same TF32 values (truncated where !ROUND, as the tensor cores read them).
template <int MF, int NF, int LDA2, bool A_NHWC, bool ROUND>
__device__ __forceinline__ void kf_conv_tc_k16(float (&acc)[MF][NF][4], const float* As, const float* Bs, int kk,
                                               int wm, int wn) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__)
  float4 bv[NF];
#pragma unroll
  for (int j = 0; j < NF; ++j) bv[j] = *reinterpret_cast<const float4*>(Bs + kf_swz32(wn + j * 8 + g, kk + 4 * t));
  float4 av[A_NHWC ? MF : 1][2];
  if constexpr (A_NHWC) {
#pragma unroll
    for (int i = 0; i < MF; ++i) {
      av[i][0] = *reinterpret_cast<const float4*>(As + kf_swz32(wm + i * 16 + g, kk + 4 * t));
      av[i][1] = *reinterpret_cast<const float4*>(As + kf_swz32(wm + i * 16 + g + 8, kk + 4 * t));
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    unsigned int b[NF][2];
#pragma unroll
    for (int j = 0; j < NF; ++j) {
      b[j][0] = __float_as_uint(kf_tf32_or_raw(s ? bv[j].z : bv[j].x, ROUND));
      b[j][1] = __float_as_uint(kf_tf32_or_raw(s ? bv[j].w : bv[j].y, ROUND));
    }
#pragma unroll
    for (int i = 0; i < MF; ++i) {
      float4 q;  // the lane's fragment: (g, k), (g + 8, k), (g, k + 1), (g + 8, k + 1) of k = kk + 4t + 2s
      if constexpr (A_NHWC) {
        q = s ? make_float4(av[i][0].z, av[i][1].z, av[i][0].w, av[i][1].w)
              : make_float4(av[i][0].x, av[i][1].x, av[i][0].y, av[i][1].y);
      } else {
        q = *reinterpret_cast<const float4*>(As + kf_a_nchw<LDA2>(kk + 4 * t + 2 * s, wm + i * 16 + g));
      }
      const unsigned int a[4] = {__float_as_uint(kf_tf32_or_raw(q.x, ROUND)), __float_as_uint(kf_tf32_or_raw(q.y, ROUND)),
                                 __float_as_uint(kf_tf32_or_raw(q.z, ROUND)), __float_as_uint(kf_tf32_or_raw(q.w, ROUND))};
#pragma unroll
      for (int j = 0; j < NF; ++j) kf_mma_tf32(acc[i][j], a, b[j]);
    }
  }
#else
  auto tf32 = [](float x) { return ROUND ? kf_round_tf32(x) : __uint_as_float(__float_as_uint(x) & 0xffffe000u); };
  for (int i = 0; i < MF; ++i)
    for (int j = 0; j < NF; ++j)
      for (int e = 0; e < 4; ++e) {
        const int m = wm + i * 16 + g + (e >> 1) * 8, n = wn + j * 8 + 2 * t + (e & 1);
        float v = acc[i][j][e];
        for (int k = kk; k < kk + 16; ++k) {
          const float a = A_NHWC ? As[kf_swz32(m, k)] : As[kf_a_nchw<LDA2>(k, m)];
          v = fmaf(tf32(a), tf32(Bs[kf_swz32(n, k)]), v);
        }
        acc[i][j][e] = v;
      }
#endif
}
"""


def render_dense(k: str, s: ConvShape, geo: Geometry, cfg: DenseConfig, ctype: str, operand_params: str, setup: str,
                 stores: str) -> tuple[str, tuple[int, int, int]]:
    """(kernel text, grid) of the dense kernel for convolution `k`; `setup` and `stores` are conv_geometry's pixel
    setup (with origins for a channels-last input) and epilogue stores, which this kernel shares."""
    nl = "\n"
    per_tap = s.cig // BK
    threads = cfg.threads
    grid = (-(-geo.max_m // BM) * geo.nph, -(-s.cog // cfg.bn), s.groups)
    rank = geo.rank
    assert not cfg.a_nhwc or rank > 1, "a 1-d convolution's input has no channels-last layout here"
    if cfg.a_nhwc:  # 16-byte copies of 4 channels: a thread's NA pixels are fixed, their origins read once
        na = BM * 8 // threads
        a_setup = f"""  __syncthreads();  // img_s and org_s are written
  constexpr int NA = {na};  // the pixels whose 16-byte chunk q of each stage this thread copies
  int a_img[NA], a_org[NA][{rank}];
#pragma unroll
  for (int i = 0; i < NA; ++i) {{
    const int ml = (threadIdx.x >> 3) + i * {threads // 8};
    a_img[i] = img_s[ml];
#pragma unroll
    for (int d = 0; d < {rank}; ++d) a_org[i][d] = org_s[ml][d];
  }}"""
        bounds = " && ".join(f"i{d} >= 0 && i{d} < {s.in_size[d]}" for d in range(rank))
        spatial = " + ".join(f"i{d} * {stride}" for d, stride in enumerate(geo.in_strides))
        a_copy = f"""    {{
{nl.join(geo.tap_lines("tap", "      "))}
      const int q = threadIdx.x & 7;
#pragma unroll
      for (int i = 0; i < NA; ++i) {{
        const int ml = (threadIdx.x >> 3) + i * {threads // 8};
{nl.join(f"        const int i{d} = a_org[i][{d}] + c{d};" for d in range(rank))}
        const bool ok = a_img[i] >= 0 && {bounds};
        kf_gemm_cp16(As + kf_swz32(ml, 4 * q),
                     ok ? x + ((long long)a_img[i] * {geo.iv} + {spatial}) * {s.cin} + grp * CIG + ci0 + 4 * q : x, ok);
      }}
    }}"""
    else:  # 4-byte copies along the pixels: a thread's pixel is fixed, one bounds check a stage
        rows, tpb = BK * BM // threads, threads // BM  # K rows a thread copies a stage; threads a pixel
        assert tpb == 1 or tpb % 2 == 0, "a thread's K rows keep one parity (pairs interleave in A)"
        # The thread's K rows are j = jj * tpb + a_j0. Its first row's addresses are computed once; the others
        # are compile-time offsets from them, so each copy is one instruction. Before this, the row was
        # recomputed from threadIdx.x per copy: ~10 integer instructions per 4-byte copy, 60% of the main
        # loop's instructions, in a kernel that ncu found issue-bound (level-2 54, H200, stop 47).
        a_setup = f"""  const int a_j0 = {"0" if tpb == 1 else f"threadIdx.x / {BM}"};  // this thread's first K row a stage
  const int a_dst0 = kf_a_nchw<LDA2>(a_j0, {"threadIdx.x" if tpb == 1 else f"threadIdx.x % {BM}"});"""
        step_a = f"jj * {tpb // 2} * 2 * LDA2" if tpb > 1 else "(jj >> 1) * 2 * LDA2 + (jj & 1) * 2"
        a_copy = f"""    {{
{nl.join(geo.tap_lines("tap", "      "))}
      bool ok = m_ok;
{nl.join(geo.gather("      "))}
      const {ctype}* src = xg + (ok ? {geo.spatial} + (long long)(ci0 + a_j0) * {geo.iv} : 0);
      float* const dst = As + a_dst0;
#pragma unroll
      for (int jj = 0; jj < {rows}; ++jj)
        kf_cp_async4(dst + {step_a}, src + jj * {tpb * geo.iv}LL, ok);
    }}"""
    b_chunks = cfg.bn * BK // 4 // threads
    origins = f"  __shared__ int org_s[{BM}][{rank}];\n" if cfg.a_nhwc else ""
    wm = f"(threadIdx.x >> 5) / {cfg.warps_n} * {BM // cfg.warps_m}"
    wn = f"(threadIdx.x >> 5) % {cfg.warps_n} * {cfg.bn // cfg.warps_n}"
    step = f"kf_conv_tc_k16<{cfg.mf}, {cfg.nf}, LDA2, {str(cfg.a_nhwc).lower()}, {str(cfg.round_tf32).lower()}>"
    body = f"""{geo.tables}
__global__ void __launch_bounds__({threads}, {2 if threads <= 128 else 1}) {k}_kernel(const {ctype}* __restrict__ x, const {ctype}* __restrict__ w, const {ctype}* __restrict__ bias, {ctype}* __restrict__ out{operand_params}) {{
  constexpr int BK = {BK}, BN = {cfg.bn}, LDA2 = {LDA2}, LDC = {LDC}, COG = {s.cog}, CIG = {s.cig}, KV = {s.kv};
  constexpr int A_STAGE = {cfg.a_stage}, STAGE = A_STAGE + BN * BK;
  KF_DYNAMIC_SHARED(smem);
  __shared__ int img_s[{BM}], pix_s[{BM}];
{origins}{block_lines(geo, per_tap)}
{setup}
{geo.tap_setup}
{a_setup}
  // the weight, copied tap-major by the planner: [group][output channel][tap][input channel]
  const {ctype}* wg = w + (long long)grp * COG * KV * CIG;
  // stage kt: 32 channels of one tap of A (the gathered input) and B (the weight), asynchronously
  auto issue = [&](int kt) {{
    float* As = smem + (kt % {cfg.stages}) * STAGE;
    float* Bs = As + A_STAGE;
    const int tap = kt / {per_tap}, ci0 = kt % {per_tap} * BK;
{a_copy}
    const int kp = {geo.kp_expr};
#pragma unroll
    for (int c = 0; c < {b_chunks}; ++c) {{
      const int e = threadIdx.x + c * {threads}, n = e >> 3, q = e & 7;
      const bool in = n0 + n < COG;
      kf_gemm_cp16(Bs + kf_swz32(n, 4 * q), in ? wg + ((long long)(n0 + n) * KV + kp) * CIG + ci0 + q * 4 : wg, in);
    }}
    kf_cp_async_commit();
  }};
  float acc[{cfg.mf}][{cfg.nf}][4];
#pragma unroll
  for (int i = 0; i < {cfg.mf}; ++i)
#pragma unroll
    for (int j = 0; j < {cfg.nf}; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  const int wm = {wm}, wn = {wn};
#pragma unroll
  for (int st = 0; st < {cfg.stages} - 1; ++st) {{
    if (st < KT) issue(st);
    else kf_cp_async_commit();  // empty groups keep the count the waits below rely on
  }}
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {{
    kf_cp_async_wait<{cfg.stages} - 2>();  // stage kt has landed (this thread's copies)
    __syncthreads();  // ... and every thread's; stage kt - 1's buffer is free again
    if (kt + {cfg.stages} - 1 < KT) issue(kt + {cfg.stages} - 1);
    else kf_cp_async_commit();
    const float* As = smem + (kt % {cfg.stages}) * STAGE;
    {step}(acc, As, As + A_STAGE, 0, wm, wn);
    {step}(acc, As, As + A_STAGE, 16, wm, wn);
  }}
  kf_cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: the accumulator tile reuses their memory
  {{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < {cfg.mf}; ++i)
#pragma unroll
      for (int j = 0; j < {cfg.nf}; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          smem[(wn + j * 8 + 2 * t + (e & 1)) * LDC + wm + i * 16 + g + (e >> 1) * 8] = acc[i][j][e];
  }}
  __syncthreads();
{stores}
}}
"""
    return body, grid
