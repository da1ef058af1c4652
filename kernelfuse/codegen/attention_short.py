"""The short-rows form of fp32 attention: many small (batch, head) windows, S and L at most 64 (Swin's 7 x 7 windows,
49 queries and keys; ViT-like short sequences), head dims 32 and 64, on tensor cores (TF32 or 3xTF32) or in exact
fp32 FMAs.

The flash kernel (kernelfuse.codegen.attention_flash) gives such a window a block of 4 warps and one key tile:
its double-buffered K and V tiles half unused, its online softmax rescaling nothing, and its few warps a block all
waiting on the same loads. Here a block takes WINDOWS windows of one head (consecutive batch indices), each
window ceil(S / 16) / ROW_TILES warps of ROW_TILES x 16 query rows: every window's keys and values arrive by cp.async
at once (one group, no second buffer), an additive mask that is the same for every batch index (Swin's per-head
relative-position bias, (1, H, S, L)) is copied to shared memory once a block beside them, the queries go straight
from global memory into registers, and each warp runs one plain softmax over all its keys (no running statistics).
Fragments move 16 bytes at a time: the sums over d and over the keys are taken in orders that let a lane's operands
be neighbours (`kf_attention_short_kernel`'s comments), so the keys, values and queries are read, and the output
written, as float4. The tensor-core arithmetic is the flash kernel's (kf_tf32_parts, kf_mma_parts: 3xTF32 under the
strict policy, TF32 under the tf32 one), one key tile's products accumulated as there. `ShortRows.fma` computes the
same fragments with exact fp32 FMAs instead (the queries in shared memory too, each key's probabilities shuffled
across its quad): the strict policy's hand-written form (math "fma": torchvision's Swin) takes only that.

On by default since stop 58's measurements (SHORT_ROWS, SHORT_ROWS_FMA: the numbers beside them; re-measure with
`PYTHONPATH=. python benchmarks/attention_probe.py --fp32-only --short-rows w2r1,w1r1fma,...`): tensor-core steps
take `ShortRows(2, 1)`, exact-FMA ones `ShortRows(1, 1, fma=True)`, wherever `short_rows` allows it; None turns a
switch off. The step's launcher calls kf_attention_short first, which declines where a base is not 16-byte
aligned or the device's shared memory is short for the block (the step's own kernel then runs);
kf_attention_short_launches() counts the launches that took this form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.plan.ir import AttnStep

MAX_ROWS = 64  # queries and keys a window at most (four 16-row tiles; eight 8-key groups)
HEAD_DIMS = (32, 64)  # the float4 operand orders need d in steps of 32; above 64 the registers would not hold
MAX_SHARED = 227 * 1024  # a block's shared memory on an H100 / H200 (an A100's 163 KB: the launcher falls back)


@dataclass(frozen=True)
class ShortRows:
    """The short-rows kernel's tiling (kf_attention_short_kernel's last template arguments)."""

    windows: int = 2  # (batch, head) windows a block, of one head
    row_tiles: int = 1  # 16-row query tiles a warp (2: a key or value fragment serves two mma row tiles)
    min_blocks: int = 0  # __launch_bounds__'s blocks an SM (caps the registers), 0: none
    # exact fp32 FMAs in the mma fragments' places (the queries in shared memory too): for every fp32 step, the
    # hand-written form under the strict policy (math "fma") included, which takes no other short-rows tiling
    fma: bool = False

    def math(self, step: AttnStep) -> int:
        """kf_attention_short's MATH: 0 TF32, 1 3xTF32, 2 FMA."""
        return 2 if self.fma else 1 if step.math == "3xtf32" else 0

    def shared_bytes(self, step: AttnStep) -> int:
        """kf_short_tile::FLOATS in bytes: each window's keys and values, rows of D + 16 and D + 4 floats, and an
        additive mask's rows of LP floats (the keys rounded up to 8 mod 32)."""
        _, _, _, s, length, d = step.dims
        keys = -(-length // 8) * 8
        mask = -(-s // 16) * 16 * ((keys + 23) // 32 * 32 + 8) if step.mask_kind == "add" else 0
        queries = -(-s // 16) * 16 * (d + 4) if self.fma else 0
        return 4 * (self.windows * (keys * (2 * d + (8 if self.fma else 20)) + queries) + mask)

    def template_args(self) -> str:
        """kf_attention_short's RW, WPB and BLOCKS."""
        return f"{self.row_tiles}, {self.windows}, {self.min_blocks}"


# The switches (None keeps the flash or FMA kernel): the tiling of tensor-core steps (3xTF32, TF32), and that of
# exact-FMA ones (the strict hand-written form). Measured (stop 58, H200, benchmarks/attention_probe.py, ms, Swin
# window (640, 3, 49, 32) + bias / ViT-B (64, 12, 50, 64)): 3xTF32 flash 0.0703 / 0.0488, w2r1 0.0582 / 0.0462
# (w1r1 0.0616 / 0.0464, w4r1 0.0635 / 0.0509, w4r1b2 0.0573 / 0.0590, w2r2 0.0712 / 0.0523); FMA kernel
# 0.1218 / 0.0757, w1r1fma 0.0724 / 0.0600 (w2r1fma 0.0730 / 0.0658); eager's unfused attention 0.1233 / 0.1057
SHORT_ROWS: ShortRows | None = ShortRows(2, 1)
SHORT_ROWS_FMA: ShortRows | None = ShortRows(1, 1, fma=True)


def short_rows(step: AttnStep, vector_rows: bool, config: ShortRows | None = None) -> ShortRows | None:
    """The tiling of the short-rows form for an fp32 step, None where it does not apply: the switch off (`config`,
    else SHORT_ROWS_FMA for exact-FMA steps and SHORT_ROWS for the others), q, k or v not contiguous along d in
    16-byte rows (`vector_rows` false), exact fp32 asked (math "fma") of a tensor-core tiling, S or L over MAX_ROWS,
    a head dim not in HEAD_DIMS, ReLU attention or a soft cap (the form has neither), more shared memory than
    MAX_SHARED."""
    config = config or (SHORT_ROWS_FMA if step.math == "fma" else SHORT_ROWS)
    _, _, _, s, length, d = step.dims
    if config is None or not vector_rows or step.out_meta.dtype != torch.float32 or \
            (step.math == "fma" and not config.fma):
        return None
    if s > MAX_ROWS or length > MAX_ROWS or d not in HEAD_DIMS or step.activation != "softmax" or step.softcap:
        return None
    return config if config.shared_bytes(step) <= MAX_SHARED else None


SHORT_PRELUDE = r"""
// ---- fp32 attention on tensor cores for short rows (kernelfuse.codegen.attention_short): S, L <= 64, D 32 or 64.
// A block: WPB windows of one head (batch indices chunk * WPB ..), each WW = ceil(RT / RW) warps of RW 16-row
// query tiles (RT tiles cover S). Keys [WPB][BK][KP] and values [WPB][BK][VP] in shared memory, BK = NT * 8 keys
// (rows from L on zero); an additive mask that broadcasts over the batch (p.sm[0] == 0) in [RT * 16][LP].
#ifndef KF_EMULATION
// 4 bytes from global to shared memory (an additive mask's rows need not be 16-byte aligned)
__device__ __forceinline__ void kf_cp_async4(void* dst, const void* src) {
  KF_ASM_SM80("cp.async.ca.shared.global [%0], [%1], 4;" : : "r"(kf_shared_addr(dst)), "l"(src));
}
#endif

// Row pitches in floats: keys D + 16 (a quarter warp's float4 reads, rows g and g + 1 at columns 4 t, fall in 32
// distinct banks; FMA: D + 4, rows 2 t), values and the queries (FMA) D + 4 (rows 2 t at columns 4 g: likewise), the
// mask the keys rounded up to 8 mod 32 (a half warp's float2 reads, rows g at columns 2 t)
template <int D, int NT, int RT, bool FMA>
struct kf_short_tile {
  static constexpr int BK = NT * 8, KP = FMA ? D + 4 : D + 16, VP = D + 4, QP = D + 4, BQ = RT * 16,
                       LP = (BK + 23) / 32 * 32 + 8;
  static constexpr int FLOATS(int windows, bool mask) {
    return windows * (BK * (KP + VP) + (FMA ? BQ * QP : 0)) + (mask ? BQ * LP : 0);
  }
};

// MATH: 0 TF32, 1 3xTF32 (SPLIT), 2 exact fp32 FMAs (the scores and the output as the mma fragments lay them out)
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, int MATH, int NT, int RT, int RW, int WPB,
          int BLOCKS>
__global__ void __launch_bounds__(WPB * ((RT + RW - 1) / RW) * 32, BLOCKS)
    kf_attention_short_kernel(const kf_attn_params p, int batch, bool vec_out) {
  constexpr bool SPLIT = MATH == 1, FMA = MATH == 2;
  typedef kf_short_tile<D, NT, RT, FMA> Tile;
  constexpr int WW = (RT + RW - 1) / RW, THREADS = WPB * WW * 32, BK = Tile::BK, KP = Tile::KP, VP = Tile::VP,
                QP = Tile::QP, BQ = Tile::BQ, LP = Tile::LP, DT = D / 8;
  KF_DYNAMIC_SHARED(kf_attn_smem);
  float* ks = kf_attn_smem;                     // [WPB][BK][KP]
  float* vs = ks + WPB * BK * KP;               // [WPB][BK][VP]
  float* qs = vs + WPB * BK * VP;               // [WPB][BQ][QP]: FMA's queries
  float* bias = qs + (FMA ? WPB * BQ * QP : 0);  // [BQ][LP]: MASK 3 broadcast over the batch
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int chunk = blockIdx.x / p.heads, h = blockIdx.x % p.heads, hk = h / p.group;
  const int w = warp / WW, b = chunk * WPB + w, r0 = warp % WW * RW * 16;
  const bool live = b < batch;  // a ragged last block's windows past the batch load and compute nothing
  for (int i = 0; i < WPB && chunk * WPB + i < batch; ++i) {
    const long long bi = chunk * WPB + i;
    kf_attn_copy_rows<BK, D, KP, THREADS>(ks + i * BK * KP, (const float*)p.k + bi * p.sk[0] + hk * p.sk[1],
                                          p.sk[2], p.L);
    kf_attn_copy_rows<BK, D, VP, THREADS>(vs + i * BK * VP, (const float*)p.v + bi * p.sv[0] + hk * p.sv[1],
                                          p.sv[2], p.L);
    if constexpr (FMA)
      kf_attn_copy_rows<BQ, D, QP, THREADS>(qs + i * BQ * QP, (const float*)p.q + bi * p.sq[0] + h * p.sq[1],
                                            p.sq[2], p.S);
  }
  const bool shared_mask = MASK == 3 && sizeof(M) == 4 && p.sm[0] == 0;  // one head's mask serves every window
  if (shared_mask) {
    const M* src = (const M*)p.mask + h * p.sm[1];
    for (int i = tid; i < p.S * p.L; i += THREADS) {
      const int row = i / p.L, col = i - row * p.L;
      kf_cp_async4(bias + row * LP + col, src + row * p.sm[2] + col * p.sm[3]);
    }
  }
  kf_attn_cp_commit();
  // The queries, while the copies fly: lane (g, t) holds rows g and g + 8 of each of its row tiles, columns
  // 16 c + 4 t .. + 3 of each 16 columns c. q kᵀ sums over d in the order that makes these its A fragments: k-step
  // 2 c takes columns 16 c + 4 t (as operand column t) and + 1 (as t + 4), k-step 2 c + 1 columns + 2 and + 3; the
  // keys' B fragments follow the same order, one float4 of a key row for both k-steps.
  const float* Q = (const float*)p.q + b * p.sq[0] + h * p.sq[1];
  float4 qv[RW][2][FMA ? 1 : D / 16];
#pragma unroll
  for (int r = 0; r < (FMA ? 0 : RW); ++r)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r0 + r * 16 + g + half * 8;
#pragma unroll
      for (int c = 0; c < D / 16; ++c)
        qv[r][half][FMA ? 0 : c] = live && row < p.S
                                       ? *reinterpret_cast<const float4*>(Q + row * p.sq[2] + 16 * c + 4 * t)
                                       : float4{0.0f, 0.0f, 0.0f, 0.0f};
    }
  kf_attn_cp_wait<0>();
  __syncthreads();  // every window's keys and values, and the mask, in shared memory
  if (!live) return;
  const float* kt = ks + w * BK * KP + g * KP + 4 * t;  // key row 8 j + g, columns 16 c + 4 t ..
  const float* vt = vs + w * BK * VP + 2 * t * VP + 4 * g;  // value rows 8 kk + 2 t (+ 1), columns 32 c + 4 g ..
  float s[RW][NT][4];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) s[r][j][0] = s[r][j][1] = s[r][j][2] = s[r][j][3] = 0.0f;
  if constexpr (FMA) {  // lane (g, t): rows g and g + 8, keys 8 j + 2 t and + 1, four columns of d at a time
    const float* qt = qs + w * BQ * QP + (r0 + g) * QP;
    const float* kf = ks + w * BK * KP + 2 * t * KP;
#pragma unroll 2
    for (int c = 0; c < D / 4; ++c) {
      float4 q[RW][2];
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        q[r][0] = *reinterpret_cast<const float4*>(qt + r * 16 * QP + 4 * c);
        q[r][1] = *reinterpret_cast<const float4*>(qt + (r * 16 + 8) * QP + 4 * c);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float4 k0 = *reinterpret_cast<const float4*>(kf + j * 8 * KP + 4 * c);
        const float4 k1 = *reinterpret_cast<const float4*>(kf + j * 8 * KP + KP + 4 * c);
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float4 &a = q[r][e >> 1], &k = e & 1 ? k1 : k0;
            s[r][j][e] = fmaf(a.w, k.w, fmaf(a.z, k.z, fmaf(a.y, k.y, fmaf(a.x, k.x, s[r][j][e]))));
          }
      }
    }
  } else {
#pragma unroll
  for (int c = 0; c < D / 16; ++c) {
    unsigned int qb[RW][2][4], qsm[RW][2][4];  // k-steps 2 c and 2 c + 1
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const float4 &lo = qv[r][0][c], &hi = qv[r][1][c];
      kf_tf32_parts<SPLIT>(lo.x, qb[r][0][0], qsm[r][0][0]);
      kf_tf32_parts<SPLIT>(hi.x, qb[r][0][1], qsm[r][0][1]);
      kf_tf32_parts<SPLIT>(lo.y, qb[r][0][2], qsm[r][0][2]);
      kf_tf32_parts<SPLIT>(hi.y, qb[r][0][3], qsm[r][0][3]);
      kf_tf32_parts<SPLIT>(lo.z, qb[r][1][0], qsm[r][1][0]);
      kf_tf32_parts<SPLIT>(hi.z, qb[r][1][1], qsm[r][1][1]);
      kf_tf32_parts<SPLIT>(lo.w, qb[r][1][2], qsm[r][1][2]);
      kf_tf32_parts<SPLIT>(hi.w, qb[r][1][3], qsm[r][1][3]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float4 key = *reinterpret_cast<const float4*>(kt + j * 8 * KP + 16 * c);
      unsigned int kb[4], ksm[4];
      kf_tf32_parts<SPLIT>(key.x, kb[0], ksm[0]);
      kf_tf32_parts<SPLIT>(key.y, kb[1], ksm[1]);
      kf_tf32_parts<SPLIT>(key.z, kb[2], ksm[2]);
      kf_tf32_parts<SPLIT>(key.w, kb[3], ksm[3]);
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        kf_mma_parts<SPLIT>(s[r][j], qb[r][0], qsm[r][0], kb[0], kb[1], ksm[0], ksm[1]);
        kf_mma_parts<SPLIT>(s[r][j], qb[r][1], qsm[r][1], kb[2], kb[3], ksm[2], ksm[3]);
      }
    }
  }
  }
  // scale, soft cap, masks; then one plain softmax a row (its 4 lanes share the maximum and the sum)
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  float sum[RW][2];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = r0 + r * 16 + g + half * 8, col = j * 8 + 2 * t;
        float add[2] = {0.0f, 0.0f};  // the additive terms of keys col and col + 1
        if constexpr (MASK == 3)
          if (row < p.S) {
            if (shared_mask) {
              const float2 pair = *reinterpret_cast<const float2*>(bias + row * LP + col);  // past L: unread
              add[0] = pair.x;
              add[1] = pair.y;
            } else {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (col + e < p.L) add[e] = kf_attn_mask_value(mask[row * p.sm[2] + (col + e) * p.sm[3]]);
            }
            if (p.windows)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (col + e < p.L) add[e] += kf_attn_window<M>(p, b, h, row, col + e);
          }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          bool ok = col + e < p.L && (!CAUSAL || col + e <= row);  // rows past S are never written
          if constexpr (MASK == 1 || MASK == 2)
            if (ok && row < p.S) ok = (mask[row * p.sm[2] + (col + e) * p.sm[3]] != 0) == (MASK == 1);
          const float x = s[r][j][half * 2 + e] * p.scale + add[e];  // no soft cap here (short_rows)
          s[r][j][half * 2 + e] = ok ? x : -INFINITY;
          mx[half] = fmaxf(mx[half], s[r][j][half * 2 + e]);
        }
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
      if (mx[half] == -INFINITY) mx[half] = 0.0f;  // every key masked: every term zero, the sum 0
      sum[r][half] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[r][j][e] = expf(s[r][j][e] - mx[e >> 1]);
        sum[r][e >> 1] += s[r][j][e];
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      sum[r][half] += __shfl_xor_sync(0xffffffffu, sum[r][half], 1);
      sum[r][half] += __shfl_xor_sync(0xffffffffu, sum[r][half], 2);
    }
  }
  // p v: operand column t of key group kk stands for key 2 t, t + 4 for key 2 t + 1 (the scores' C fragments are
  // the A fragments, as in the flash kernel); output group j's column n is d = 32 (j / 4) + 4 n + j % 4, so that a
  // lane's value operands are a float4 of each of the rows 2 t and 2 t + 1, and its outputs 8 neighbours a row
  float o[RW][DT][4];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int j = 0; j < DT; ++j) o[r][j][0] = o[r][j][1] = o[r][j][2] = o[r][j][3] = 0.0f;
  if constexpr (FMA) {  // each key's probabilities of rows g and g + 8 from the quad's lane that holds them
    const float* vf = vs + w * BK * VP + 8 * t;  // columns 32 c + 8 t ..
#pragma unroll
    for (int kk = 0; kk < NT; ++kk)
#pragma unroll
      for (int key = 0; key < 8; ++key) {
        const int from = (lane & ~3) | key / 2;
        float pr[RW][2];
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          pr[r][0] = __shfl_sync(0xffffffffu, s[r][kk][key % 2], from);
          pr[r][1] = __shfl_sync(0xffffffffu, s[r][kk][2 + key % 2], from);
        }
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
          const float4 v0 = *reinterpret_cast<const float4*>(vf + (kk * 8 + key) * VP + 32 * c);
          const float4 v1 = *reinterpret_cast<const float4*>(vf + (kk * 8 + key) * VP + 32 * c + 4);
          const float vv[2][4] = {{v0.x, v0.y, v0.z, v0.w}, {v1.x, v1.y, v1.z, v1.w}};
#pragma unroll
          for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
              for (int e = 0; e < 4; ++e)  // row g + 8 (e >> 1), column 32 c + 8 t + 4 (e & 1) + jj
                o[r][4 * c + jj][e] = fmaf(pr[r][e >> 1], vv[e & 1][jj], o[r][4 * c + jj][e]);
        }
      }
  } else {
#pragma unroll
  for (int kk = 0; kk < NT; ++kk) {
    unsigned int pb[RW][4], psm[RW][4];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      kf_tf32_parts<SPLIT>(s[r][kk][0], pb[r][0], psm[r][0]);
      kf_tf32_parts<SPLIT>(s[r][kk][2], pb[r][1], psm[r][1]);
      kf_tf32_parts<SPLIT>(s[r][kk][1], pb[r][2], psm[r][2]);
      kf_tf32_parts<SPLIT>(s[r][kk][3], pb[r][3], psm[r][3]);
    }
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const float4 v0 = *reinterpret_cast<const float4*>(vt + kk * 8 * VP + 32 * c);
      const float4 v1 = *reinterpret_cast<const float4*>(vt + kk * 8 * VP + VP + 32 * c);
      const float lo[4] = {v0.x, v0.y, v0.z, v0.w}, hi[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        unsigned int bb0, bb1, bs0, bs1;
        kf_tf32_parts<SPLIT>(lo[jj], bb0, bs0);
        kf_tf32_parts<SPLIT>(hi[jj], bb1, bs1);
#pragma unroll
        for (int r = 0; r < RW; ++r) kf_mma_parts<SPLIT>(o[r][4 * c + jj], pb[r], psm[r], bb0, bb1, bs0, bs1);
      }
    }
  }
  }
  // each row's output divided by its sum (every key masked: NaN for the hand-written form, zeros for SDPA; a NaN
  // sum stays NaN): columns 32 c + 8 t .. + 7 of row g (+ 8), o[r][4 c + jj][half * 2 + e] at + 4 e + jj
  float* out = (float*)p.out + b * p.so[0] + h * p.so[1];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r0 + r * 16 + g + half * 8;
      const float l = sum[r][half];
      if (row >= p.S) continue;
#pragma unroll
      for (int c = 0; c < D / 32; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float y[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const float x = o[r][4 * c + jj][half * 2 + e];
            y[jj] = l != 0.0f ? x / l : EMPTY_NAN ? NAN : 0.0f;
          }
          float* dst = out + row * p.so[2] + (32 * c + 8 * t + 4 * e) * p.so[3];
          if (vec_out) {
            *reinterpret_cast<float4*>(dst) = float4{y[0], y[1], y[2], y[3]};
          } else {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) dst[jj * p.so[3]] = y[jj];
          }
        }
    }
}

// launches that took the short-rows kernel (a test's proof that it ran)
static long long kf_attention_short_count = 0;
KF_EXPORT long long kf_attention_short_launches() { return kf_attention_short_count; }

// The short-rows kernel (MATH, NT key groups, RT row tiles, RW tiles a warp, WPB windows a block, BLOCKS): true
// where it took the launch (`error` its result); false where q, k or v is not 16-byte aligned or the device gives a
// block less shared memory than it needs (an A100): the step's own kernel then
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN, int MATH, int NT, int RT, int RW, int WPB,
          int BLOCKS>
bool kf_attention_short(const kf_attn_params& p, int batch, cudaStream_t stream, cudaError_t& error) {
  static_assert(D % 32 == 0 && NT <= 8 && RT <= 4, "the short-rows form: D 32 or 64, S and L up to 64");
  constexpr auto kernel = kf_attention_short_kernel<M, D, MASK, CAUSAL, EMPTY_NAN, MATH, NT, RT, RW, WPB, BLOCKS>;
  constexpr int threads = WPB * ((RT + RW - 1) / RW) * 32;
  constexpr int bytes = kf_short_tile<D, NT, RT, MATH == 2>::FLOATS(WPB, MASK == 3) * (int)sizeof(float);
  if (!kf_attn_vectorised(p, 4, true)) return false;
  if (kf_opt_in<kernel>(bytes) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const bool vec_out = p.so[3] == 1 && p.so[0] % 4 == 0 && p.so[1] % 4 == 0 && p.so[2] % 4 == 0 &&
                       (uintptr_t)p.out % 16 == 0;
  ++kf_attention_short_count;
  kernel<<<(unsigned int)((batch + WPB - 1) / WPB * (long long)p.heads), threads, bytes, stream>>>(p, batch, vec_out);
  error = cudaGetLastError();
  return true;
}
"""
