"""What Hopper's TMA kernels share (the dense convolution's, kernelfuse.codegen.conv_tma; the warp-specialized
attention's, kernelfuse.codegen.attention_wgmma_ws): the mbarrier PTX (init, arrive, arrive with an expected
transaction count, the parity wait), a tiled 4-d bulk tensor copy, setmaxnreg, named barriers, the driver's tiled
tensor-map encoder through the runtime's entry points and a bf16 row-tile encoder on it; and their CPU emulation
(KF_EMULATION): the mbarriers as counters with the hardware's phase and tx-count rules blocking by atomic waits, the
tiled copy done at once by the issuing thread (what the TMA unit writes, in the 128-byte swizzle, zeros out of
bounds, then its bytes completed on the barrier), named barriers as std::barriers. Not emulated: the copies'
asynchrony beyond the producer's own thread, the proxy fences, setmaxnreg.

The file carries TMA_PRELUDE once, before either kernel's prelude (kernelfuse.codegen.cuda).
"""

TMA_PRELUDE = r"""
// ---- TMA, mbarriers, setmaxnreg and named barriers, sm_90a (kernelfuse.codegen.tma_prelude) ----
#if defined(__CUDACC__)
#include <cuda.h>  // CUtensorMap and its enums only: the encoders come through the runtime's driver entry points
#endif
#if defined(__CUDACC__) || defined(KF_EMULATION)
#if defined(KF_EMULATION)
// a tensor map as this emulation reads it: the convolution's input {C, W, H, N} (im2col) or weight {RSC, K} (tiled,
// rows of 32 floats), or a tiled bf16 map (`b16`: the attention's rows, encode_b16_rows)
struct CUtensorMap {
  const float* base;
  long long dims[4];
  int lower[2], upper[2];  // the im2col box's corners, W first
  int rows;                // the box's pixels (im2col) or rows (tiled); each is 32 floats
  int traversal[2];        // the im2col box's traversal strides (the convolution's), W first
  const unsigned short* b16 = nullptr;  // a tiled bf16 map: its base, byte strides of dims 1..3, box {64, rows}
  long long strides[3] = {0, 0, 0};
};
#define __grid_constant__
#endif
namespace kf_tma {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// the producer's arrive, announcing the bytes the slot's copies will complete
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// until the phase of parity `parity` has completed (a fresh barrier passes parity 1 at once)
__device__ __forceinline__ void wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nKF_TMA_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra KF_TMA_WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// a tiled box at coordinates {c0, c1, c2, c3} (innermost first) of a 4-d map, its bytes completed on `bar`
__device__ __forceinline__ void tile4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                       int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(smem_u32(bar)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// a warpgroup's register budget (setmaxnreg: a multiple of 8 in 24..256): the producer's warpgroup gives registers
// to the consumers' (e.g. 40 x 128 + 232 x 256 <= 64K)
template <int N = 40> __device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N = 232> __device__ __forceinline__ void consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// named barrier `id` (1..15; 0 is __syncthreads) of `threads` threads: wait for all, or arrive without waiting
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// consumer warpgroup cw's 128 threads (named barriers 1 and 2)
__device__ __forceinline__ void warpgroup_sync(int cw) { named_sync(cw + 1, 128); }
#elif defined(KF_EMULATION)
// An mbarrier as one word: phase (bit 63), arrivals a phase (48..55), arrivals pending (32..47), tx bytes pending
// (0..31). A phase completes (the bit flips, the counts reset) when both pending counts reach zero, as on the GPU.
using bar_word = std::atomic<unsigned long long>;
inline bar_word& word(uint64_t* bar) { return *reinterpret_cast<bar_word*>(bar); }
inline void bar_init(uint64_t* bar, int count) {
  new (bar) bar_word((unsigned long long)count << 48 | (unsigned long long)count << 32);
}
inline void fence_init() {}
inline void update(uint64_t* bar, long long tx, int arrivals) {
  bar_word& w = word(bar);
  unsigned long long old = w.load(), next;
  do {
    const unsigned long long phase = old >> 63, count = old >> 48 & 0xff;
    const long long pending = (long long)(old >> 32 & 0xffff) - arrivals, bytes = (long long)(old & 0xffffffffu) + tx;
    if (pending < 0 || bytes < 0) __builtin_trap();  // more arrivals or bytes than the phase expects
    next = pending == 0 && bytes == 0 ? (phase ^ 1) << 63 | count << 48 | count << 32
                                      : phase << 63 | count << 48 | (unsigned long long)pending << 32 |
                                            (unsigned long long)bytes;
  } while (!w.compare_exchange_weak(old, next));
  w.notify_all();
}
inline void arrive(uint64_t* bar) { update(bar, 0, 1); }
inline void arrive_expect_tx(uint64_t* bar, unsigned bytes) { update(bar, bytes, 1); }
inline void wait(uint64_t* bar, int parity) {
  bar_word& w = word(bar);
  for (unsigned long long v = w.load(); (int)(v >> 63) == parity; v = w.load()) w.wait(v);
}
// a bf16 map's box (encode_b16_rows: 64 columns of 128 bytes x map->rows rows) at {c0, c1, c2, c3}, written as the
// TMA unit writes it in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), zeros out of bounds;
// then the box's bytes (all of them, as the hardware counts them) completed on the barrier
inline void tile4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  unsigned short* out = static_cast<unsigned short*>(dst);
  for (int r = 0; r < map->rows; ++r)
    for (int k = 0; k < 64; ++k) {
      const long long row = c1 + r, col = c0 + k;
      const bool in = row < map->dims[1] && col < map->dims[0] && c2 < map->dims[2] && c3 < map->dims[3];
      const char* at = reinterpret_cast<const char*>(map->b16) + row * map->strides[0] + c2 * map->strides[1] +
                       c3 * map->strides[2] + col * 2;
      out[r * 64 + (((k >> 3) ^ (r & 7)) << 3) + (k & 7)] = in ? *reinterpret_cast<const unsigned short*>(at) : 0;
    }
  update(bar, -128LL * map->rows, 0);
}
template <int N = 40> inline void producer_registers() {}
template <int N = 232> inline void consumer_registers() {}
// named barriers: one std::barrier an (id, thread count: 128, 256 or 384), made by its first user
inline std::barrier<>& named(int id, int threads) {
  static std::atomic<std::barrier<>*> bars[16][3];
  std::atomic<std::barrier<>*>& slot = bars[id][threads / 128 - 1];
  std::barrier<>* bar = slot.load();
  if (bar == nullptr) {
    std::barrier<>* made = new std::barrier<>(threads);
    if (slot.compare_exchange_strong(bar, made)) bar = made;
    else delete made;  // another thread's came first: `bar` holds it
  }
  return *bar;
}
inline void named_sync(int id, int threads) { named(id, threads).arrive_and_wait(); }
inline void named_arrive(int id, int threads) { (void)named(id, threads).arrive(); }
inline void warpgroup_sync(int cw) { named_sync(cw + 1, 128); }
#endif

// Host side: the driver's tiled tensor-map encoder
#if !defined(KF_EMULATION)
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// a driver function through the runtime (the library does not link libcuda); null where there is none
inline void* driver_fn(const char* name) {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
#endif
  return fn;
}
inline EncodeTiled tiled_encoder() {
  static const EncodeTiled encode = (EncodeTiled)driver_fn("cuTensorMapEncodeTiled");
  return encode;
}
#endif
// A tiled bf16 map of `dims` {columns, rows, heads, batch} with element strides {row, head, batch} (the columns
// contiguous), boxes of 64 columns (128 bytes: one 128-byte swizzle atom's row) x `rows` rows, 128-byte swizzle,
// zeros out of bounds. A dim of size 1 takes any stride (a valid one here); false: not encoded (a stride not a
// positive multiple of 16 bytes where the dim is larger, the base not 16-byte aligned, no encoder).
inline bool encode_b16_rows(CUtensorMap* map, const void* base, const long long (&dims)[4],
                            const long long (&strides)[3], int rows) {
  long long bytes[3];
  long long extent = dims[0] * 2;
  for (int i = 0; i < 3; ++i) {
    bytes[i] = dims[i + 1] == 1 ? (extent + 15) / 16 * 16 : strides[i] * 2;
    if (bytes[i] <= 0 || bytes[i] % 16 != 0 || bytes[i] >= (1LL << 40)) return false;
    extent = bytes[i] * dims[i + 1];
  }
  if ((uintptr_t)base % 16 != 0 || dims[0] % 64 != 0 || rows < 1 || rows > 256) return false;
#if defined(KF_EMULATION)
  *map = CUtensorMap{nullptr, {dims[0], dims[1], dims[2], dims[3]}, {0, 0}, {0, 0}, rows, {1, 1},
                     static_cast<const unsigned short*>(base), {bytes[0], bytes[1], bytes[2]}};
  return true;
#else
  const EncodeTiled encode = tiled_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t size[4] = {(cuuint64_t)dims[0], (cuuint64_t)dims[1], (cuuint64_t)dims[2], (cuuint64_t)dims[3]};
  const cuuint64_t stride[3] = {(cuuint64_t)bytes[0], (cuuint64_t)bytes[1], (cuuint64_t)bytes[2]};
  const cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1}, ones[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), size, stride, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#endif
}
}  // namespace kf_tma
#endif  // __CUDACC__ || KF_EMULATION
"""
