"""The warp-specialized form of the bf16 flash attention on Hopper (FlashAttention-3's structure), for sm_90a
builds: `kf_attention_ws_kernel`, taken by kf_attention_wgmma (kernelfuse.codegen.attention_wgmma) before its own
kernel where the file carries it and the step suits it; else that kernel runs unchanged.

Why: the wgmma kernel (cp.async copies by the same threads that multiply, at most 128 registers a thread at head dim
64) measured 0.70-0.76x of cuDNN's SDPA on long unmasked rows at head dims 64 and 128 (stop 57,
benchmarks/results/wgmma_attention_probe_s57_h200.md); FlashAttention-3 closes that gap with a producer warpgroup
feeding the tensor cores by TMA and consumers holding larger tiles in the registers the producer gives up.

Measured (stop 58, H200, `benchmarks/wgmma_attention_probe.py --configs ...`, ratio = the best SDPA backend's ms
/ ours, the wgmma kernel's in brackets): head dim 64 (3 consumer warpgroups, 192 query rows) 0.983 (0.861) on
(4, 16, 4096), 0.998 (0.829) on (2, 16, 8192), but 0.889 (0.909) on (8, 16, 2048, causal), 0.929 (1.059) on GPT-2's
(8, 12, 1024, causal), 0.737 (1.040) on (64, 12, 256); head dim 128 (2 consumers, ping-pong) 0.983 (0.698) on (4, 16,
4096), 0.988 (0.753) on (8, 16, 2048, causal), 1.056 (0.856) on (8, 12, 1024, causal). Hence WS_MIN_KEYS: 4096 keys
at head dim 64, 1024 at 128 (shorter rows not measured at 128).

The kernel: (NC + 1) warpgroups. Warpgroup 0 is the producer: setmaxnreg lowers it to PREG registers, and one
thread issues every copy by TMA (cp.async.bulk.tensor, 4-d maps {d, rows, heads, batch} of q, k and v encoded on
the host at each launch, boxes of 64 columns x rows in the 128-byte swizzle: each box one swizzle atom of the
wgmma kernel's layout, head dim 128 two boxes side by side): the query tile once (its own mbarrier), then for each
key tile (last to first, as the wgmma kernel: masked tiles first) K into ring slot it % STAGES behind k_empty, then V
behind v_empty, each announced on its full barrier with mbarrier.arrive.expect_tx (the bytes of the whole box:
rows past S or L come as zeros, and the TMA unit counts them too). The NC consumer warpgroups (64 query rows each,
setmaxnreg raised to CREG) run the wgmma kernel's iteration on the ring: wait k_full, S = Q Kᵀ; wait v_full of the
previous tile, P V of it behind S (FA3's intra-warpgroup overlap: the softmax of tile j while P V of j - 1 runs);
each warp hands K's slot back (one arrive a warp on k_empty) once wait_group 1 has retired S, V's once wait_group 0
has retired P V. With PINGPONG the consumer warpgroups take turns to issue their products (named barriers 1..NC,
FA3's inter-warpgroup schedule: one warpgroup's softmax beside the other's products); the turns are balanced (the
last warpgroup skips its final hand-over), so no barrier is left with arrivals at the block's end. With PERSISTENT
the grid is one block an SM and each block takes work tiles blockIdx.x, + gridDim.x, ... (in the wgmma kernel's
order: a (batch, head)'s query tiles together, causal longest first), its ring and barrier phases running on across
them: the query tile has its own empty barrier (each consumer warp arrives once the tile's last S is retired), so
the producer loads the next tile's Q and first K and V while the consumers finish the last P V and store.

What it takes (kf_attention_ws; else false and the wgmma kernel runs): head dims of WS_CONFIG (64, 128: whole
128-byte atoms), no explicit mask (MASK 0; causal is top-left as the other kernels), L at least the head dim's
WS_MIN_KEYS (the file carries the form only for such steps: carries_ws), the run-time switch on
(kf_attention_ws_enable, on by default: the probe turns it off to time the wgmma kernel from the same library), and
tensor maps that encode (strides positive multiples of 16 bytes where a dim is larger than 1: a broadcast k or v,
stride 0, stays on the wgmma kernel). Everything kf_attention_wgmma checks first (no soft cap or window mask, a
positive finite scale, q, k and v contiguous along d with 16-byte-aligned rows and bases) holds too. A launch counts
in kf_attention_ws_launches() and in kf_attention_wgmma_launches() (the Hopper kernels' count).

The tests' emulation (KF_EMULATION) runs this kernel text: the copies synchronous in the producer's thread
(tma_prelude's tile4d: the swizzled box, zeros out of bounds), the mbarriers counters with the hardware's phase and
tx rules, the named barriers std::barriers, the products kf_wg's emulated wgmma. Not emulated: the products'
asynchrony (so a slot handed back before its last reader retires would not show), setmaxnreg, the proxy fences.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.codegen.attention_wgmma import WGA_CONFIG, _mma


@dataclass(frozen=True)
class WsConfig:
    """One head dim's tiling of the warp-specialized kernel (kf_ws::config<D> in the CUDA)."""

    consumers: int  # consumer warpgroups, 64 query rows each
    keys: int  # keys a tile (S is m64n{keys})
    stages: int  # depth of the K and V rings
    producer_regs: int  # setmaxnreg of the producer's warpgroup
    consumer_regs: int  # setmaxnreg of the consumers' (PREG x 128 + CREG x 128 NC <= 64K)
    pingpong: bool = False  # the consumers take turns to issue their products (named barriers)
    persistent: bool = False  # one block an SM, each over several work tiles (its ring running on across them)

    @property
    def rows(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    def smem_bytes(self, d: int) -> int:
        """The query tile, the K and V rings, the 1024-byte alignment, the mbarriers (q's full and empty; K's and
        V's full and empty a slot)."""
        return self.rows * d * 2 + 2 * self.stages * self.keys * d * 2 + 1024 + (2 + 4 * self.stages) * 8

    def check(self, d: int) -> None:
        """The tiling is one the kernel takes: whole k16 steps, an n of wgmma, two slots at least, the shared memory
        of a block, and setmaxnreg within the block's registers at launch (__launch_bounds__(threads, 1): ptxas
        gives each thread 64K / threads, a multiple of 8; a consumers' increase past that pool would wait forever)."""
        assert d % 64 == 0 and self.keys % 16 == 0 and 16 <= self.keys <= 256 and self.stages >= 2, (d, self)
        regs = [self.producer_regs, self.consumer_regs]
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), self
        pool = 65536 // self.threads // 8 * 8 * self.threads
        assert self.producer_regs * 128 + self.consumer_regs * 128 * self.consumers <= pool, (self, pool)
        assert self.smem_bytes(d) <= 227 * 1024, (d, self, self.smem_bytes(d))


# per head dim: 64 as FA3's 3 consumer warpgroups (192 query rows) with 128-key tiles; 128 as its 2 x 64 rows with
# 128-key tiles and ping-pong (chosen from FA3's published tilings, not measured here)
WS_CONFIG = {
    64: WsConfig(consumers=3, keys=128, stages=3, producer_regs=24, consumer_regs=160),
    128: WsConfig(consumers=2, keys=128, stages=2, producer_regs=24, consumer_regs=240, pingpong=True),
}

# THE GATE. Per head dim, the fewest keys (L) from which an unmasked bf16 attention step takes the warp-specialized
# form; None: never (the file does not carry it). From the measurements in the module's docstring
WS_MIN_KEYS: dict[int, int | None] = {64: 4096, 128: 1024}


def carries_ws(dims: tuple[int, ...], mask_kind: str) -> bool:
    """Whether a bf16 tensor-core attention step of `dims` (B, H, H kv, S, L, d) and mask kind carries the form:
    its head dim in WS_CONFIG with a WS_MIN_KEYS threshold its L reaches, no explicit mask (read at call time, so a
    test or the probe may set the gate)."""
    d, length = dims[5], dims[4]
    threshold = WS_MIN_KEYS.get(d)
    return d in WS_CONFIG and threshold is not None and length >= threshold and mask_kind == "none"


# Before attention_wgmma's prelude (its kf_attention_wgmma calls the form first where the file carries it)
WS_DECLARATION = r"""
// ---- the warp-specialized wgmma attention is in this file (kernelfuse.codegen.attention_wgmma_ws) ----
#define KF_ATTENTION_WS 1
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN>
bool kf_attention_ws(const kf_attn_params& p, int batch, cudaStream_t stream, cudaError_t& error);
"""

_KERNEL = r"""
// ---- bf16 flash attention, warp-specialized: TMA producer, wgmma consumers, sm_90a
// (kernelfuse.codegen.attention_wgmma_ws) ----
#if defined(__CUDACC__) || defined(KF_EMULATION)
namespace kf_wg {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
MMA_FORMS
#endif
}  // namespace kf_wg
namespace kf_ws {
// per head dim D (attention_wgmma_ws.WS_CONFIG): NC consumer warpgroups of 64 query rows, BC keys a tile, STAGES the
// K and V rings' depth, PREG and CREG the producer's and consumers' setmaxnreg, PINGPONG, MIN_KEYS the gate's L
template <int D> struct config {
  static constexpr bool OK = false;
};
WS_CONFIGS
}  // namespace kf_ws

// A block: work tiles of NC x 64 query rows of one (batch, head), tile_id = blockIdx.x + n gridDim.x for n = 0, 1..
// below `total` (tiles x batch x heads; one a block, or PERSISTENT: one block an SM, its ring and barriers running on
// across its tiles); warpgroup 0 the producer, 1..NC the consumers (`pairs`: two output columns a store)
template <int D, bool CAUSAL, bool EMPTY_NAN>
__global__ void __launch_bounds__(kf_ws::config<D>::THREADS, 1)
    kf_attention_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                           const __grid_constant__ CUtensorMap tv, const kf_attn_params p, int tiles, int total,
                           bool pairs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)
  using namespace kf_wg;
  using C = kf_ws::config<D>;
  constexpr int NC = C::NC, BR = 64 * NC, BC = C::BC, STAGES = C::STAGES, SW = 128, ATOMS = D / 64;
  constexpr int NS = BC / 2, KSTEPS = BC / 16, Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  constexpr float LOG2E = 1.4426950408889634f;
  KF_DYNAMIC_SHARED(kf_ws_raw);
  char* smem = reinterpret_cast<char*>(((uintptr_t)kf_ws_raw + 1023) & ~(uintptr_t)1023);
  char* q_tile = smem;                        // ATOMS atoms of BR rows, BR * SW bytes apart
  char* k_ring = smem + Q_BYTES;              // STAGES tiles of ATOMS atoms of BC rows
  char* v_ring = k_ring + STAGES * KV_BYTES;  // the same
  uint64_t* q_full = reinterpret_cast<uint64_t*>(v_ring + STAGES * KV_BYTES);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* v_full = k_full + STAGES;
  uint64_t* k_empty = v_full + STAGES;
  uint64_t* v_empty = k_empty + STAGES;
  const int L = p.L;
  // a work tile's (batch, head, kv head, first query row, key tiles): causal query tiles longest first
  struct work_t {
    int b, h, hk, q0, ktiles;
  };
  auto work = [&](int id) {
    work_t w;
    const int bh = id / tiles, tile = id % tiles;
    w.b = bh / p.heads;
    w.h = bh % p.heads;
    w.hk = w.h / p.group;
    w.q0 = (CAUSAL ? tiles - 1 - tile : tile) * BR;
    w.ktiles = ((CAUSAL ? min(L, w.q0 + BR) : L) + BC - 1) / BC;
    return w;
  };
  // the warpgroup's index from lane 0: warp-uniform to the compiler
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    kf_tma::bar_init(q_full, 1);
    kf_tma::bar_init(q_empty, 4 * NC);  // every consumer warp, once the tile's last S is retired
    for (int i = 0; i < STAGES; ++i) {
      kf_tma::bar_init(&k_full[i], 1);
      kf_tma::bar_init(&v_full[i], 1);
      kf_tma::bar_init(&k_empty[i], 4 * NC);  // every consumer warp arrives once its products reading the slot are
      kf_tma::bar_init(&v_empty[i], 4 * NC);  // retired
    }
    kf_tma::fence_init();
  }
  __syncthreads();
  if (wg == 0) {  // the producer: one thread issues every copy; ring slot and parity follow n, the block's count
    kf_tma::producer_registers<C::PREG>();
    if (threadIdx.x == 0) {
      int n = 0, local = 0;
      for (int id = blockIdx.x; id < total; id += gridDim.x, ++local) {
        const work_t w = work(id);
        kf_tma::wait(q_empty, (local & 1) ^ 1);  // the last tile's S are all retired (fresh: at once)
        kf_tma::arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) kf_tma::tile4d(q_tile + a * BR * SW, &tq, q_full, a * 64, w.q0, w.h, w.b);
        // key tiles last to first (the masked ones first), as the consumers take them
        for (int it = 0; it < w.ktiles; ++it, ++n) {
          const int slot = n % STAGES, parity = ((n / STAGES) & 1) ^ 1, k0 = (w.ktiles - 1 - it) * BC;
          char* const kt = k_ring + slot * KV_BYTES;
          char* const vt = v_ring + slot * KV_BYTES;
          kf_tma::wait(&k_empty[slot], parity);  // the consumers are done with the slot's last tile (fresh: at once)
          kf_tma::arrive_expect_tx(&k_full[slot], KV_BYTES);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a)
            kf_tma::tile4d(kt + a * BC * SW, &tk, &k_full[slot], a * 64, k0, w.hk, w.b);
          kf_tma::wait(&v_empty[slot], parity);
          kf_tma::arrive_expect_tx(&v_full[slot], KV_BYTES);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a)
            kf_tma::tile4d(vt + a * BC * SW, &tv, &v_full[slot], a * 64, k0, w.hk, w.b);
        }
      }
    }
    return;
  }
  kf_tma::consumer_registers<C::CREG>();
  const int cw = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale_log2 = p.scale * LOG2E;
  const unsigned char* const no_mask[2] = {nullptr, nullptr};
  const char* qw = q_tile + cw * 64 * SW;
  float acc[D / 2], s[NS];
  unsigned pf[KSTEPS][4];  // P's A fragments, one a k16 step over the tile's keys
  float row_max[2], row_sum[2];
  int n = 0;  // the ring's count (the block's key tiles so far), as the producer's
  auto issue_s = [&](int r) { qk_products<D, SW, BR, BC>(s, qw, k_ring + (r % STAGES) * KV_BYTES); };
  auto issue_pv = [&](int r) { pv_products<SW, BC>(acc, pf, v_ring + (r % STAGES) * KV_BYTES); };
  auto release = [&](uint64_t* bar) {  // this warp is done with the slot (its products retired)
    __syncwarp();
    if (lane == 0) kf_tma::arrive(bar);
  };
  // PINGPONG: consumer cw issues its products on its turn (named barrier cw + 1, its 128 threads and the previous
  // warpgroup's arrival), then hands the turn to the next; the last warpgroup starts the round and skips its very
  // last hand-over, so every barrier's arrivals are matched
  constexpr bool PP = C::PINGPONG && NC > 1;
  auto my_turn = [&]() {
    if constexpr (PP) kf_tma::named_sync(cw + 1, 256);
  };
  auto next_turn = [&](bool last) {
    if constexpr (PP)
      if (!(last && cw == NC - 1)) kf_tma::named_arrive((cw + 1) % NC + 1, 256);
  };
  if constexpr (PP)
    if (cw == NC - 1) kf_tma::named_arrive(1, 256);
  int local = 0;
  for (int id = blockIdx.x; id < total; id += gridDim.x, ++local) {
    const work_t w = work(id);
    const int ktiles = w.ktiles, my_row = w.q0 + cw * 64 + warp * 16 + g;  // and my_row + 8
    const int masked = ktiles - min(ktiles, (CAUSAL ? min(L, w.q0 + 1) : L) / BC);
    auto tile_of = [&](int it) { return ktiles - 1 - it; };  // key tiles last to first: the masked ones first
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
    // a key tile's products and softmax (ring position n + it); MASKED and FIRST (no P V to overlap yet) are
    // compile-time
    auto step = [&](int it, auto masked_tile, auto first) {
      constexpr bool MASKED = decltype(masked_tile)::value, FIRST = decltype(first)::value;
      const int r = n + it;
      float corr[2];
      my_turn();
      // both operands' tiles first (the producer issued V of the last tile before K of this one): a wait between
      // the products would make ptxas fence them again (C7519)
      if constexpr (!FIRST) kf_tma::wait(&v_full[(r - 1) % STAGES], ((r - 1) / STAGES) & 1);
      kf_tma::wait(&k_full[r % STAGES], (r / STAGES) & 1);
      fence();
      issue_s(r);
      commit();
      if constexpr (!FIRST) {  // the last tile's P V behind this S
        issue_pv(r - 1);
        commit();
        next_turn(false);
        wait<1>();
      } else {
        next_turn(false);
        wait<0>();
      }
      pin(s);
      release(&k_empty[r % STAGES]);
      attn_softmax<NS, MASKED, CAUSAL, 0>(s, row_max, row_sum, corr, tile_of(it) * BC, my_row, L, 0, no_mask,
                                          scale_log2);
      if constexpr (!FIRST) {
        wait<0>();  // the softmax above ran while P V did
        pin(acc);
        pin(pf);
        release(&v_empty[(r - 1) % STAGES]);
      }
#pragma unroll
      for (int i = 0; i < D / 2; ++i) acc[i] *= corr[(i >> 1) & 1];
      // k16 step kk: n8 block 2 kk gives a0 (row g) and a1 (row g + 8); block 2 kk + 1 gives a2, a3
#pragma unroll
      for (int c = 0; c < NS / 4; ++c) {
        pf[c / 2][(c & 1) * 2 + 0] = kf_bf16x2(s[4 * c + 0], s[4 * c + 1]);
        pf[c / 2][(c & 1) * 2 + 1] = kf_bf16x2(s[4 * c + 2], s[4 * c + 3]);
      }
    };
    kf_tma::wait(q_full, local & 1);
    if (masked > 0) step(0, flag<true>{}, flag<true>{});
    else step(0, flag<false>{}, flag<true>{});
    for (int it = 1; it < masked; ++it) step(it, flag<true>{}, flag<false>{});
    for (int it = max(1, masked); it < ktiles; ++it) step(it, flag<false>{}, flag<false>{});
    release(q_empty);  // every S of the tile is retired: the producer may load the next tile's Q
    const int r = n + ktiles - 1;
    my_turn();
    kf_tma::wait(&v_full[r % STAGES], (r / STAGES) & 1);
    fence();
    issue_pv(r);
    commit();
    next_turn(id + (int)gridDim.x >= total);
    wait<0>();
    pin(acc);
    release(&v_empty[r % STAGES]);  // (the next tile's ring runs on from here)
    n += ktiles;
    // (a row whose every key is masked, sum 0: none here but L = 0, which never launches)
    store_rows<D, EMPTY_NAN>((unsigned short*)p.out + w.b * p.so[0] + w.h * p.so[1], p, my_row, t, acc, row_sum,
                             pairs);
  }
#else
  __trap();  // never launched: kf_attention_ws takes it only where the loader built sm_90a for a 9.0 device
#endif
}

// launches that took the warp-specialized kernel (a test's proof that it ran); its run-time switch (on: the probe
// turns it off to time the wgmma kernel from the same library)
static long long kf_attention_ws_count = 0;
static bool kf_attention_ws_on = true;
KF_EXPORT long long kf_attention_ws_launches() { return kf_attention_ws_count; }
KF_EXPORT void kf_attention_ws_enable(int on) { kf_attention_ws_on = on != 0; }

// kf_attention_wgmma's first choice (after its own checks): the warp-specialized kernel where its head dim has a
// config, no explicit mask, L reaches the gate, the switch is on and the tensor maps encode; false: the caller's
template <typename M, int D, int MASK, bool CAUSAL, bool EMPTY_NAN>
bool kf_attention_ws(const kf_attn_params& p, int batch, cudaStream_t stream, cudaError_t& error) {
  if constexpr (MASK != 0 || !kf_ws::config<D>::OK) {
    return false;
  } else {
    using C = kf_ws::config<D>;
    if (!kf_attention_ws_on || p.S < 1 || p.L < 1 || p.L < C::MIN_KEYS) return false;
    const long long hk = p.heads / p.group;
    CUtensorMap tq, tk, tv;
    if (!kf_tma::encode_b16_rows(&tq, p.q, {D, p.S, p.heads, batch}, {p.sq[2], p.sq[1], p.sq[0]}, 64 * C::NC) ||
        !kf_tma::encode_b16_rows(&tk, p.k, {D, p.L, hk, batch}, {p.sk[2], p.sk[1], p.sk[0]}, C::BC) ||
        !kf_tma::encode_b16_rows(&tv, p.v, {D, p.L, hk, batch}, {p.sv[2], p.sv[1], p.sv[0]}, C::BC))
      return false;
    const cudaError_t opted = kf_opt_in<kf_attention_ws_kernel<D, CAUSAL, EMPTY_NAN>>(C::SMEM);
    if (opted != cudaSuccess) {
      error = opted;
      return true;
    }
    const int tiles = (p.S + 64 * C::NC - 1) / (64 * C::NC), threads = C::THREADS, smem = C::SMEM;
    const long long work = tiles * (long long)batch * p.heads;
    if (work >= (1LL << 31)) return false;
#if defined(KF_EMULATION)
    const int sms = 2;  // the emulation's persistent blocks: two, so each runs its ring across several tiles
#else
    const int sms = kf_wg::sm90_sms();
#endif
    const unsigned int grid = (unsigned int)(C::PERSISTENT && work > sms ? sms : work);
    const int total = (int)work;
    const bool pairs = kf_attn_pairs(p, 2);
    ++kf_attention_ws_count;
    kf_attention_ws_kernel<D, CAUSAL, EMPTY_NAN><<<grid, threads, smem, stream>>>(tq, tk, tv, p, tiles, total, pairs);
    error = cudaGetLastError();
    return true;
  }
}
#endif  // __CUDACC__ || KF_EMULATION
"""


def _configs() -> str:
    """kf_ws::config's specializations, one a head dim of WS_CONFIG whose gate is on (MIN_KEYS: its threshold); the
    others keep the primary template's OK = false, so no step of theirs takes the form."""
    out = []
    for d, c in WS_CONFIG.items():
        c.check(d)
        gate = WS_MIN_KEYS.get(d)
        if gate is None:
            continue
        flags = f"PINGPONG = {str(c.pingpong).lower()}, PERSISTENT = {str(c.persistent).lower()}"
        ints = (f"NC = {c.consumers}, BC = {c.keys}, STAGES = {c.stages}, PREG = {c.producer_regs}, "
                f"CREG = {c.consumer_regs}, THREADS = {c.threads}, SMEM = {c.smem_bytes(d)}, MIN_KEYS = {gate}")
        out.append(f"template <> struct config<{d}> {{\n  static constexpr bool OK = true, {flags};\n"
                   f"  static constexpr int {ints};\n}};\n")
    return "".join(out)


def _forms() -> str:
    """The wgmma product forms the configs need beyond the wgmma kernel's (attention_wgmma's MMA_FORMS)."""
    ss = {c.keys for c in WS_CONFIG.values()} - {c.keys for c in WGA_CONFIG.values()}
    rs = set(WS_CONFIG) - {c.padded for c in WGA_CONFIG.values()}  # P V is m64n{d}
    return "".join([_mma(n, False) for n in sorted(ss)] + [_mma(n, True) for n in sorted(rs)])


def ws_prelude() -> str:
    """The form's CUDA (after attention_wgmma's prelude and tma_prelude's), for the configs and gate as they are
    now (read at generate time, so the probe may set other tilings)."""
    return _KERNEL.replace("WS_CONFIGS\n", _configs()).replace("MMA_FORMS\n", _forms())
