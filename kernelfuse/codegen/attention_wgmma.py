"""The bf16 flash-attention forward on Hopper's warpgroup MMA (wgmma), for sm_90a builds: `kf_attention_tc` (the
plan's bf16 attention launcher, kernelfuse.codegen.attention_flash) takes it at run time where it applies, else the
mma.sync FlashAttention-2-style kernel runs unchanged.

Why: the mma.sync flash kernel measured 0.53-0.75x of cuDNN's SDPA at stops 43/44 (GPT-2 0.75x, head dim 128
0.53x); these kernels (benchmarks/wgmma_attention_probe.py, verified and timed on an H200, bf16; ratio = cuDNN's ms
/ ours) measured at head dim 64 (`pipe-2cta`) 1.070 on (8, 12, 1024, causal), 1.118 on (64, 12, 256), 0.810 on
(8, 16, 2048, causal), 0.707 on (4, 16, 4096); at head dim 128 (`pipe-d128n`) 0.899 on (8, 12, 1024, causal), 0.851
on (8, 16, 2048, causal), 0.699 on (4, 16, 4096): a gain on every shape measured. Through the planner (stop 56)
GPT-2 1.18x and head dim 128 0.87x of SDPA's best, while minGPT's head dim 96 (0.55x) and UNet's 40 (0.58x) and
every model with a padding mask (BERT, BART, T5) stayed on mma.sync: hence the other head dims and the masks here
(not yet measured on a GPU).

The kernel (the probe's `attention_v2`, pipelined, FAST softmax): 128 query rows a block (two warpgroups of 64),
S = Q Kᵀ by wgmma with both operands K-major from swizzled shared tiles, the online softmax on the accumulator
fragments (scale folded into exp2's argument), P as bf16 A fragments in registers, O += P V by wgmma with V read
MN-major (trans-b). Key tiles run last to first, so only the first iterations mask; tile j's S and tile j - 1's P V
are in flight together (FA3's intra-warpgroup overlap). Per head dim (WGA_CONFIG): 64 as `pipe-2cta` (64-key tiles,
a 3-deep K/V cp.async ring, two blocks an SM), 128 as `pipe-d128n` (128-key tiles, a 2-deep ring, P V one
m64n128k16 a k16 step over both atoms of V through the leading byte offset).

The shared layouts. A tile of DP head dims (WgaConfig.padded) is atoms of SW-byte rows, SW the widest swizzle mode
that divides it (128, 64 or 32 bytes: 64, 32 or 16 columns), each atom the tile's rows SW bytes apart, 16-byte chunk
c of row r at c ^ ((r SW / 128) % (SW / 16)) (PTX's Swizzle<log2(SW / 16), 4, 3>); the descriptors (kf_wg::
desc_fields) carry the layout type and a stride byte offset of 8 SW. Q Kᵀ: k16 step ks is 32 bytes into atom
ks / (SW / 32) of both operands; P V: N = DP over all of V's atoms, the leading byte offset between them. Head dim 96
(192-byte rows, not whole 128-byte atoms) is three 64-byte-swizzled atoms for Q, K and V alike, so one copy routine
and one descriptor form serve every tile, rather than a 128-byte atom beside a 64-byte one (two swizzle patterns in a
tile, for nothing: the tensor cores read every canonical layout without bank conflicts) or V padded to 128 columns
(an n128 product 25% of it zeros, an O accumulator of 64 floats a thread instead of 48 beside S's 64, a third more
of V's shared memory and copies). The copies have no bank conflicts in any mode: eight threads in a row write one
128-byte line's eight distinct chunks. The O accumulator is DP / 2 floats a thread: at 96 it does not fit two blocks
an SM (ptxas: 20-36 bytes spilled at 128 registers with 64-key tiles), so 96 takes 128-key tiles, one block an SM
and a 3-deep ring (169 KB). 32 is one 64-byte atom and 40 is padded to 48 (three 32-byte atoms), both as 64's
tiling; 80 is padded to 96 as 96's. Padded columns are zeros in Q and K (the copies' zero fill, src-size 0: shared
memory is never read unwritten), and V's only feed O's columns past D, which are not stored.

Explicit masks (MASK 1: bool, true attends; 2: bool, true masked; 3: additive in the query's dtype or fp32), read as
the mma.sync kernels read them: through the plan's strides (broadcast dims' 0, BERT's (B, 1, 1, L) padding), for
keys below L and rows below S (rows past S read row S - 1, never stored), the additive one added to the scaled
scores (then exp2's factor is 1), and a row whose every key is masked NaN (EMPTY_NAN, the hand-written form) or
zeros (SDPA) as the mma.sync kernels give it. Every tile is masked, and S and the last tile's P V are waited for
together (the mask's registers beside P's and the accumulator spill at 128 a thread otherwise). A bool mask's bits
are read once a tile, and the leading tiles that no query row of the block takes are skipped (only their copies go
on): a causal mask given as a tensor (minGPT's masked_fill) or padding, whose masked keys are the last ones, run
first. Keys must be contiguous in the mask (stride 1: the loads' offsets are then constants).

Where it runs (else the mma.sync kernel): the library was built for sm_90a and the device is compute capability
9.0 (kf_wg::sm90_sms, the loader's switch kf_wgmma_enable); bf16 with a head dim of WGA_CONFIG, any mask, no ReLU
(compile-time: those instantiations only), and at run time no soft cap, no window mask, a positive finite scale (the
softmax takes the raw scores' maximum), a mask's keys contiguous, q, k and v contiguous along d with 16-byte-aligned
rows and bases (kf_attn_vectorised). Any batch, head and row strides, S != L, grouped-query heads (kv head = head /
group) and any output strides (two columns a store where they are adjacent and aligned) are the plan's, through
kf_attn_params. Causal is top-left aligned (key <= query row), as the other kernels.

The tests' CPU emulation (KF_EMULATION) runs this kernel: kf_wg's bf16 descriptors carry the hardware's fields
(desc_fields: layout type, leading and stride byte offsets) beside the tile's host address, and each thread computes
its own accumulator fragment, reading the swizzled tiles through the hardware's addressing as the PTX ISA defines
it for each swizzle mode (the canonical K-major and MN-major layouts, then address bits 4.. XORed with bits 7..) and
A's register fragments gathered from its quad (that text: kernelfuse.codegen.attention_wgmma_emu).
kf_attention_wgmma_launches() counts the launches that took this kernel or its warp-specialized form.

The warp-specialized form (kernelfuse.codegen.attention_wgmma_ws: FlashAttention-3's TMA producer warpgroup and
setmaxnreg'd consumers, optionally ping-pong) is tried first by kf_attention_wgmma where the file carries it: its
gate (WS_MIN_KEYS, from stop 58's measurements) takes long rows: 4096 keys at head dim 64, 1024 at 128.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.codegen.attention_wgmma_emu import WGA_EMULATION
from kernelfuse.codegen.gemm_wgmma import accumulator_operands

WGA_ROWS = 128  # query rows a block: two warpgroups of 64


@dataclass(frozen=True)
class WgaConfig:
    """One head dim's tiling of the wgmma attention kernel (kf_wg::attn_config<D> in the CUDA)."""

    padded: int  # the shared tiles' and products' head dim: the real one, or more (zero columns past it)
    keys: int  # keys a tile: S is m64n{keys}, P V has keys / 16 k16 steps
    stages: int  # depth of the K and V cp.async rings
    blocks: int  # __launch_bounds__'s blocks an SM (2: at most 128 registers a thread)

    @property
    def swizzle(self) -> int:
        """Bytes of a swizzle atom's row (the swizzle mode): 128 where the padded head dim is whole 64-column atoms,
        else 64 (32 columns), else 32 (16 columns)."""
        return 128 if self.padded % 64 == 0 else 64 if self.padded % 32 == 0 else 32

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a block: the query tile, the K and V rings, the 1024-byte alignment of the
        swizzled tiles."""
        return WGA_ROWS * self.padded * 2 + 2 * self.stages * self.keys * self.padded * 2 + 1024


# per head dim: 64 and 128 the probe's `pipe-2cta` and `pipe-d128n`; 32 and 40 (padded to 48) as 64 (their
# accumulators fit two blocks an SM); 80 (padded to 96) and 96 with 128-key tiles, one block an SM and a 3-deep ring
# (the module docstring says why)
WGA_CONFIG = {
    32: WgaConfig(32, 64, 3, 2),
    40: WgaConfig(48, 64, 3, 2),
    64: WgaConfig(64, 64, 3, 2),
    80: WgaConfig(96, 128, 3, 1),
    96: WgaConfig(96, 128, 3, 1),
    128: WgaConfig(128, 128, 2, 1),
}


def _mma(n: int, a_regs: bool) -> str:
    """One wgmma.m64nNk16 bf16 product into the fp32 accumulator d: A and B K-major from descriptors (kf_wg::
    mma_bf16_ss, scale-d from `accumulate`), or A from registers and B MN-major (kf_wg::mma_bf16_rs, trans-b)."""
    count = n // 2
    regs, ops = accumulator_operands(count)
    if a_regs:
        a_operand = "{" + ", ".join(f"%{count + i}" for i in range(4)) + "}"
        return f"""__device__ __forceinline__ void mma_bf16_rs(float (&d)[{count}], const unsigned (&a)[4],
                                            uint64_t b) {{
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{count + 5}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {regs}, {a_operand}, %{count + 4}, p, 1, 1, 1;\\n}}\\n"
      : {ops}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}}
"""
    return f"""__device__ __forceinline__ void mma_bf16_ss(float (&d)[{count}], uint64_t a, uint64_t b,
                                            int accumulate) {{
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{count + 2}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {regs}, %{count}, %{count + 1}, p, 1, 1, 0, 0;\\n}}\\n"
      : {ops}
      : "l"(a), "l"(b), "r"(accumulate));
}}
"""


_KERNEL = r"""
// ---- bf16 flash attention on wgmma, sm_90a (kernelfuse.codegen.attention_wgmma) ----
#if defined(__CUDACC__) || defined(KF_EMULATION)
namespace kf_wg {
// per head dim D (kernelfuse.codegen.attention_wgmma.WGA_CONFIG): DP the tiles' head dim (zero columns from D on), SW
// the bytes of a swizzle atom's row, BC keys a tile, STAGES the K and V rings' depth, BLOCKS __launch_bounds__'s
// blocks an SM, SMEM the block's dynamic shared memory
template <int D> struct attn_config;
ATTN_CONFIGS
// The descriptor's fields but the start address (PTX ISA, "Matrix Descriptor Format"), for tiles of SW-byte rows
// swizzled in SW-byte mode: the leading byte offset (MN-major: between SW / 2-column atoms; K-major: unused), the
// stride byte offset (8 rows, or 8 keys MN-major: 8 SW), the layout type (1: 128-byte swizzle, 2: 64, 3: 32); the
// tiles start on the swizzle pattern's 8 SW-byte boundary, so the base offset is 0.
template <int SW> __device__ __forceinline__ uint64_t desc_fields(int leading) {
  static_assert(SW == 128 || SW == 64 || SW == 32, "a swizzled layout");
  return (uint64_t(leading >> 4) << 16) | (uint64_t(8 * SW >> 4) << 32) |
         (uint64_t(SW == 128 ? 1 : SW == 64 ? 2 : 3) << 62);
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// descriptor of a swizzled bf16 tile `offset` bytes in
template <int SW> __device__ __forceinline__ uint64_t desc_b16(const void* tile, int offset, int leading) {
  const uint64_t addr = (unsigned)__cvta_generic_to_shared(tile) + offset;
  return ((addr & 0x3FFFF) >> 4) | desc_fields<SW>(leading);
}
MMA_FORMS
// registers an in-flight wgmma reads or writes: the empty asm pins them, so their uses stay after the wait
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#elif defined(KF_EMULATION)
WGA_EMULATION
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)
template <bool B> struct flag { static constexpr bool value = B; };

// ROWS rows x D bf16 (row pitch `pitch` elements) into swizzled atoms of DP / (SW / 2) columns: atom a (head dims
// a SW / 2 on) is ROWS rows of SW bytes, atoms ROWS * SW bytes apart; 16-byte chunk c of row r at chunk
// c ^ ((r SW >> 7) % (SW / 16)) (the swizzle of bits 4.. by 7.. on the row's address). Rows from `valid` on and
// columns from D on are zeros (their copies read nothing). A thread keeps one chunk column of the atoms and steps RP
// rows (a multiple of 8: one swizzle phase) and AG atoms at a time: one address and one stride, where an address per
// copy held 32 more registers at head dim 128. Eight threads in a row write one 128-byte line's eight distinct
// chunks (a whole row of 128 bytes, two of 64, four of 32): no bank conflict.
template <int ROWS, int D, int DP, int SW, int THREADS>
__device__ __forceinline__ void attn_rows(char* tile, const unsigned short* src, long long pitch, int valid) {
  constexpr int CPA = SW / 16, AW = SW / 2, ATOMS = DP / AW;  // chunks an atom's row, columns an atom, atoms
  constexpr int RP = THREADS / CPA < ROWS ? THREADS / CPA : ROWS, AG = THREADS / CPA / RP;  // rows, atoms a pass
  static_assert(DP % AW == 0 && RP % 8 == 0 && ROWS % RP == 0 && THREADS % (CPA * RP) == 0, "whole passes");
  const int c = threadIdx.x % CPA, r0 = threadIdx.x / CPA % RP, a0 = threadIdx.x / CPA / RP;
  const unsigned short* from = src + r0 * pitch + a0 * AW + c * 8;
  char* dst = tile + a0 * ROWS * SW + r0 * SW + ((c ^ (r0 * SW >> 7 & (CPA - 1))) << 4);
#pragma unroll
  for (int a = 0; a < ATOMS; a += AG) {
    if (ATOMS % AG != 0 && a + a0 >= ATOMS) break;
#pragma unroll
    for (int i = 0; i < ROWS / RP; ++i) {
      const bool in = r0 + i * RP < valid && (D == DP || (a + a0) * CPA + c < D / 8);
      kf_cp_async16(dst + (a * ROWS + i * RP) * SW, in ? from + a * AW + i * RP * pitch : src, in);
    }
  }
}

// S fragment element i of this thread (n8 block i / 4: row my_row + 8 ((i >> 1) & 1), key key0 + 8 (i / 4) + 2 t
// + (i & 1)): its key, and whether it is a key below L on or before the causal diagonal
template <bool CAUSAL>
__device__ __forceinline__ bool attn_inside(int i, int key0, int my_row, int L, int& key) {
  key = key0 + 8 * (i / 4) + 2 * (threadIdx.x % 4) + (i & 1);
  return key < L && (!CAUSAL || key <= my_row + ((i >> 1) & 1) * 8);
}

// One tile's online softmax on the S fragments. Where MASKED, the masks first: keys past L, the causal diagonal, and
// the explicit mask (MASK 1 and 2: bit i of `valid`, the kernel's; 3: the mask row's value at the key, added to the
// scaled score). Then the row maximum, and exp2(s k - max k) as one FFMA and ex2.approx: k = scale_log2 on the raw
// scores (MASK 0, 1, 2: where the scale is positive, the raw scores' maximum is the scaled ones'), or 1 on the scores
// scaled with the additive mask (MASK 3: every tile is MASKED). The exponentials stay in s, O's factor goes to corr,
// row_sum holds this thread's partial sums.
template <int NS, bool MASKED, bool CAUSAL, int MASK, typename M>
__device__ __forceinline__ void attn_softmax(float (&s)[NS], float (&row_max)[2], float (&row_sum)[2],
                                             float (&corr)[2], int key0, int my_row, int L, unsigned long long valid,
                                             const M* const (&mask_rows)[2], float scale_log2) {
  constexpr float LOG2E = 1.4426950408889634f;
  const float k = MASK == 3 ? 1.0f : scale_log2;
  float m[2] = {row_max[0], row_max[1]};
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    if constexpr (MASKED) {
      int key;
      bool ok = attn_inside<CAUSAL>(i, key0, my_row, L, key);
      if constexpr (MASK == 1 || MASK == 2) ok = valid >> i & 1;
      if constexpr (MASK == 3)
        if (ok) s[i] = fmaf(s[i], scale_log2, kf_attn_mask_value(mask_rows[(i >> 1) & 1][key]) * LOG2E);
      if (!ok) s[i] = -INFINITY;
    }
    m[(i >> 1) & 1] = fmaxf(m[(i >> 1) & 1], s[i]);
  }
  float scaled[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
    scaled[h] = m[h] == -INFINITY ? 0.0f : m[h] * k;  // a row masked so far: exponentials 0, no NaN
    corr[h] = ex2(fmaf(row_max[h], k, -scaled[h]));   // old maximum -inf: 0 (O and the sum are 0)
    row_max[h] = m[h];
    row_sum[h] *= corr[h];
  }
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    s[i] = ex2(fmaf(s[i], k, -scaled[(i >> 1) & 1]));
    row_sum[(i >> 1) & 1] += s[i];
  }
}

// A key tile's products, in both kernels. S = Q Kᵀ over DP head dims, Q (BR rows) and K (BC rows) both K-major: k16
// step ks is 32 bytes into atom ks / (SW / 32) of each. O += P V: P's A fragments a k16 step over the tile's keys, V
// MN-major, N = the head dims over V's atoms (BC rows of SW bytes apart)
template <int DP, int SW, int BR, int BC, int NS>
__device__ __forceinline__ void qk_products(float (&s)[NS], const char* qw, const char* kt) {
  constexpr int KPA = SW / 32;
#pragma unroll
  for (int ks = 0; ks < DP / 16; ++ks)
    mma_bf16_ss(s, desc_b16<SW>(qw + (ks / KPA) * BR * SW, (ks % KPA) * 32, 16),
                desc_b16<SW>(kt + (ks / KPA) * BC * SW, (ks % KPA) * 32, 16), ks > 0);
}
template <int SW, int BC, int KSTEPS, int NA>
__device__ __forceinline__ void pv_products(float (&acc)[NA], unsigned (&pf)[KSTEPS][4], const char* vt) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) mma_bf16_rs(acc, pf[kk], desc_b16<SW>(vt, kk * 16 * SW, BC * SW));
}

// A query tile's end, in both kernels: each row's sum over its quad, then rows my_row and my_row + 8 of the output
// from the accumulator's fragments (D columns of N / 4 n8 groups' pairs), divided by the sum. A row whose every key
// is masked (sum 0): NaN (EMPTY_NAN, the hand-written form) or zeros (SDPA), as the mma.sync kernels give it; a NaN
// sum stays NaN
template <int D, bool EMPTY_NAN, int N>
__device__ __forceinline__ void store_rows(unsigned short* out, const kf_attn_params& p, int my_row, int t,
                                           const float (&acc)[N], float (&row_sum)[2], bool pairs) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 1);
    row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 2);
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = my_row + 8 * hh;
    if (row >= p.S) continue;
    const bool empty = row_sum[hh] == 0.0f;
    const float inv = 1.0f / row_sum[hh], fill = EMPTY_NAN ? NAN : 0.0f;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const int col = 8 * c + 2 * t;
      kf_attn_store2(out + row * p.so[2] + col * p.so[3], empty ? fill : acc[4 * c + 2 * hh] * inv,
                     empty ? fill : acc[4 * c + 2 * hh + 1] * inv, pairs, p.so[3]);
    }
  }
}
#endif
}  // namespace kf_wg

// A block: 128 query rows (two warpgroups) of one (batch, head) over the keys in tiles of BC (the launch's grid
// and arguments are kf_attn_launch's; `pairs`: two output columns a store)
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN>
__global__ void __launch_bounds__(256, kf_wg::attn_config<D>::BLOCKS)
    kf_attention_wgmma_kernel(const kf_attn_params p, int tiles, bool pairs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)
  using namespace kf_wg;
  using C = attn_config<D>;
  constexpr int BR = 128, BC = C::BC, STAGES = C::STAGES, THREADS = 256, DP = C::DP, SW = C::SW;
  constexpr int NS = BC / 2, KSTEPS = BC / 16;  // S's floats, P's k16 steps
  constexpr int Q_BYTES = BR * DP * 2, KV_BYTES = BC * DP * 2;
  // after iteration j's barrier come the copies of tile-iteration j + KAHEAD's K and j + VAHEAD's V, into slot
  // (iteration % STAGES); V is read one iteration after S (P V lags S by one), so it may be one less ahead
  constexpr int KAHEAD = STAGES - 1, VAHEAD = STAGES - 2;
  constexpr float LOG2E = 1.4426950408889634f;
  KF_DYNAMIC_SHARED(kf_wga_raw);
  char* smem = reinterpret_cast<char*>(((uintptr_t)kf_wga_raw + 1023) & ~(uintptr_t)1023);
  char* q_tile = smem;                          // BR rows, atoms BR * SW bytes apart
  char* k_ring = smem + Q_BYTES;                // STAGES tiles of BC rows
  char* v_ring = k_ring + STAGES * KV_BYTES;    // STAGES tiles of BC rows
  const int bh = blockIdx.x / tiles, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int tile = blockIdx.x % tiles, q0 = (CAUSAL ? tiles - 1 - tile : tile) * BR;  // causal: longest first
  const unsigned short* Q = (const unsigned short*)p.q + b * p.sq[0] + h * p.sq[1];
  const unsigned short* K = (const unsigned short*)p.k + b * p.sk[0] + hk * p.sk[1];
  const unsigned short* V = (const unsigned short*)p.v + b * p.sv[0] + hk * p.sv[1];
  const M* mask = (const M*)p.mask + (MASK ? b * p.sm[0] + h * p.sm[1] : 0);
  // the warpgroup's index from lane 0: branches on it are then warp-uniform to the compiler (a divergent-looking
  // branch around in-flight wgmma makes ptxas serialize them)
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int L = p.L, kv_end = CAUSAL ? min(L, q0 + BR) : L, ktiles = (kv_end + BC - 1) / BC;
  const int my_row = q0 + wg * 64 + warp * 16 + g;  // and my_row + 8
  const float scale_log2 = p.scale * LOG2E;
  // the mask's rows of my_row and my_row + 8; rows past S (never stored) read row S - 1's
  const M* const mask_rows[2] = {mask + min(my_row, p.S - 1) * p.sm[2], mask + min(my_row + 8, p.S - 1) * p.sm[2]};

  // key tiles run last to first, so the ones that need masks (the partial last one; causal, those reaching past
  // the block's first row; every one under an explicit mask) come first and the rest run in a loop without a
  // branch; ring slots follow the iteration
  auto tile_of = [&](int it) { return ktiles - 1 - it; };
  const int masked = ktiles - min(ktiles, (CAUSAL ? min(L, q0 + 1) : L) / BC);
  auto issue_loads = [&](int it) {  // the copies of iteration it (negative: the prologue's)
    const int ki = it + KAHEAD, vi = it + VAHEAD;
    if (ki >= 0 && ki < ktiles) {
      const int k0 = tile_of(ki) * BC;
      attn_rows<BC, D, DP, SW, THREADS>(k_ring + (ki % STAGES) * KV_BYTES, K + k0 * p.sk[2], p.sk[2], L - k0);
    }
    if (vi >= 0 && vi < ktiles) {
      const int k0 = tile_of(vi) * BC;
      attn_rows<BC, D, DP, SW, THREADS>(v_ring + (vi % STAGES) * KV_BYTES, V + k0 * p.sv[2], p.sv[2], L - k0);
    }
  };
  // Q lands with the first K (one commit group)
  attn_rows<BR, D, DP, SW, THREADS>(q_tile, Q + q0 * p.sq[2], p.sq[2], p.S - q0);
#pragma unroll
  for (int it = -KAHEAD; it < 0; ++it) {
    issue_loads(it);
    kf_attn_cp_commit();
  }
  float acc[DP / 2], s[NS];
  unsigned pf[KSTEPS][4];  // P's A fragments, one a k16 step over the tile's keys
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) acc[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const char* qw = q_tile + wg * 64 * SW;
  auto issue_s = [&](int it) { qk_products<DP, SW, BR, BC>(s, qw, k_ring + (it % STAGES) * KV_BYTES); };
  auto issue_pv = [&](int it) { pv_products<SW, BC>(acc, pf, v_ring + (it % STAGES) * KV_BYTES); };
  auto rescale_and_pack = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) acc[i] *= corr[(i >> 1) & 1];
    // k16 step kk: n8 block 2 kk gives a0 (row g) and a1 (row g + 8); block 2 kk + 1 gives a2, a3
#pragma unroll
    for (int c = 0; c < NS / 4; ++c) {
      pf[c / 2][(c & 1) * 2 + 0] = kf_bf16x2(s[4 * c + 0], s[4 * c + 1]);
      pf[c / 2][(c & 1) * 2 + 1] = kf_bf16x2(s[4 * c + 2], s[4 * c + 3]);
    }
  };
  // a bool mask's bits of a tile (MASK 1, 2): bit i, S element i takes part (read after the tile's barrier, their
  // latency beside the products': before it, beside the last tile's P in registers, they spilled at head dim 64)
  auto tile_bits = [&](int it) {
    unsigned long long valid = 0;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      int key;
      const bool ok = attn_inside<CAUSAL>(i, tile_of(it) * BC, my_row, L, key) &&
                      (mask_rows[(i >> 1) & 1][key] != 0) == (MASK == 1);
      valid |= (unsigned long long)ok << i;
    }
    return valid;
  };
  // a tile's start: one barrier (this iteration's K and the last one's V landed for every thread, and every
  // warpgroup is past the last iteration, so the slots the copies below overwrite are free), the next copies;
  // with a bool mask the barrier ORs the threads' `taken`: does any query row of the block take a key of the tile
  auto begin = [&](int it, bool taken) {
    kf_attn_cp_wait<STAGES - 2>();
    fence_async();
    if constexpr (MASK == 1 || MASK == 2)  // lane 0's: warp-uniform to the compiler, as wg
      taken = __shfl_sync(0xffffffffu, __syncthreads_or(taken), 0);
    else
      __syncthreads();
    issue_loads(it);
    kf_attn_cp_commit();
    return taken;
  };
  // a tile's products and softmax after its begin; MASKED and FIRST (no P V to overlap yet) are compile-time, so
  // the body has no branch. OVERLAP: S waited for alone, the softmax beside the last tile's P V; with a mask both
  // are waited for together (the mask's registers beside P's and the accumulator would not fit 128 a thread)
  auto iteration = [&](int it, auto masked_tile, auto first, unsigned long long valid) {
    constexpr bool MASKED = decltype(masked_tile)::value, FIRST = decltype(first)::value, OVERLAP = MASK == 0;
    float corr[2];
    fence();
    issue_s(it);
    commit();
    if constexpr (!FIRST) {  // the last tile's P V behind this S
      issue_pv(it - 1);
      commit();
      wait<OVERLAP ? 1 : 0>();
    } else {
      wait<0>();
    }
    pin(s);
    if constexpr (!OVERLAP) {
      pin(acc);
      pin(pf);
    }
    attn_softmax<NS, MASKED, CAUSAL, MASK>(s, row_max, row_sum, corr, tile_of(it) * BC, my_row, L, valid,
                                           mask_rows, scale_log2);
    if constexpr (OVERLAP) {
      wait<0>();  // the softmax above ran while P V did
      pin(acc);
      pin(pf);
    }
    rescale_and_pack(corr);
  };
  auto step = [&](int it, auto masked_tile, auto first) {
    begin(it, true);
    const unsigned long long valid = MASK == 1 || MASK == 2 ? tile_bits(it) : 0;
    iteration(it, masked_tile, first, valid);
  };
  if constexpr (MASK == 0) {
    if (masked > 0) step(0, flag<true>{}, flag<true>{});
    else step(0, flag<false>{}, flag<true>{});
    for (int it = 1; it < masked; ++it) step(it, flag<true>{}, flag<false>{});
    for (int it = max(1, masked); it < ktiles; ++it) step(it, flag<false>{}, flag<false>{});
  } else if constexpr (MASK == 3) {  // every tile reads the mask
    step(0, flag<true>{}, flag<true>{});
    for (int it = 1; it < ktiles; ++it) step(it, flag<true>{}, flag<false>{});
  } else {
    // the leading tiles that no query row of the block takes (a causal mask given as a tensor, padding: the last
    // keys, which run first) are skipped, only their copies go on; the first one taken starts the loop
    int it = 0;
    unsigned long long valid = tile_bits(0);
    while (!begin(it, valid != 0) && it + 1 < ktiles) valid = tile_bits(++it);
    iteration(it, flag<true>{}, flag<true>{}, valid);  // no branch around wgmma: all untaken, the last one runs
    for (++it; it < ktiles; ++it) step(it, flag<true>{}, flag<false>{});
  }
  kf_attn_cp_wait<0>();
  fence_async();
  __syncthreads();
  fence();
  issue_pv(ktiles - 1);
  commit();
  wait<0>();
  pin(acc);
  store_rows<D, EMPTY_NAN>((unsigned short*)p.out + b * p.so[0] + h * p.so[1], p, my_row, t, acc, row_sum, pairs);
#else
  __trap();  // never launched: kf_attention_wgmma takes it only where the loader built sm_90a for a 9.0 device
#endif
}

// launches that took the wgmma kernel or its warp-specialized form (attention_wgmma_ws; a test's proof that one ran)
static long long kf_attention_wgmma_count = 0;
KF_EXPORT long long kf_attention_wgmma_launches() { return kf_attention_wgmma_count; }

// kf_attention_tc's Hopper branch (the head dims of kf_wg::attn_config, no ReLU: the instantiations it makes): the
// wgmma kernel where the library holds it for this device and the step's parameters suit it; false: the caller's
// kernel
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN>
bool kf_attention_wgmma(const kf_attn_params& p, int batch, cudaStream_t stream, cudaError_t& error) {
  if (kf_wg::sm90_sms() == 0 || p.cap_out != 0.0f || p.windows != 0 || !(p.scale > 0.0f && p.scale < INFINITY) ||
      (MASK != 0 && p.sm[3] != 1) || !kf_attn_vectorised(p, 2, true))
    return false;
  ++kf_attention_wgmma_count;
#if defined(KF_ATTENTION_WS)  // the warp-specialized form first, where the file carries it and it applies
  if (kf_attention_ws<M, D, MASK, CAUSAL, EMPTY_NAN>(p, batch, stream, error)) return true;
#endif
  error = kf_attn_launch<kf_attention_wgmma_kernel<M, D, MASK, CAUSAL, EMPTY_NAN>>(
      p, batch, 128, 256, kf_wg::attn_config<D>::SMEM, kf_attn_pairs(p, 2), stream);
  return true;
}
#endif  // __CUDACC__ || KF_EMULATION
"""


def _configs() -> str:
    """kf_wg::attn_config's specializations, one a head dim of WGA_CONFIG."""
    return "".join(f"template <> struct attn_config<{d}> {{\n  static constexpr int DP = {c.padded}, SW = {c.swizzle}, "
                   f"BC = {c.keys}, STAGES = {c.stages}, BLOCKS = {c.blocks}, SMEM = {c.smem_bytes()};\n}};\n"
                   for d, c in WGA_CONFIG.items())


ATTENTION_WGMMA_PRELUDE = _KERNEL.replace("ATTN_CONFIGS\n", _configs()).replace(
    "WGA_EMULATION\n", WGA_EMULATION).replace(
    "MMA_FORMS", "".join([_mma(n, False) for n in sorted({c.keys for c in WGA_CONFIG.values()})] +
                         [_mma(n, True) for n in sorted({c.padded for c in WGA_CONFIG.values()})]))
