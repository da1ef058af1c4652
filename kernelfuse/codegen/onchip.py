"""Long rows kept on chip across several blocks (sm_80+): read from memory once.

A reduce-then-broadcast row (softmax, log_softmax, a norm, a reduction whose value every element reads back)
needs the whole row's statistic before it writes any element. A row longer than a block's register cache was
read twice (level-1 LogSoftmax at 1.58x its memory floor, InstanceNorm 1.71x, L1Norm 1.54x). Here `C` blocks
share a row: each block copies its chunk into shared memory once (asynchronous copies, all in flight together)
and reduces it, publishes its partial statistic in global memory and waits until the row's every chunk has
arrived; it combines the C partials in rank order (every block gets the same bits) and writes its chunk from
shared memory.

Blocks take (row, chunk) work items in order from a counter: a block waits only on items taken before its row's
last one, by blocks that are running, so with at least `C` blocks resident (the launcher checks) no block waits
forever. Measured on an H100 (the first version combined the rows of a thread-block cluster through distributed
shared memory): the grid's blocks are at least as fast as a cluster's (L1Norm 6.48 against 6.74 ms), and unlike a
cluster of more than 4 blocks, which waits for free slots in one GPC, they go anywhere.

The launcher runs this kernel where the device can, and the one-block-per-row kernel of the same row otherwise
(older GPUs; the CPU emulation): both compute the same values up to the summation order.
"""

from __future__ import annotations

import torch

from kernelfuse.codegen.iteration import Space, decompose, launch_params, out_ctype, pack_kinds
from kernelfuse.plan.ir import GenStep

ONCHIP_THREADS = 512
# Of a row in one block's shared memory: four blocks fit an SM (an H100 SM has 227 KB), so some blocks' loads
# overlap others' waits and stores. Measured on an H100 (ms, 48 KB against 96 KB chunks): LogSoftmax rows of
# 393216 6.36 against 6.48, InstanceNorm rows of 262144 6.88 against 7.22, L1Norm rows of 65535 6.48 against 6.56.
CHUNK_BYTES = 48 * 1024
# Of blocks for one row (6 MB of row): at least this many must be resident at once.
ONCHIP_MAX_BLOCKS = 128
ONCHIP_UNROLL = 8
# Groups of four elements a statistics pass unrolls (8 elements a thread in flight, as ONCHIP_UNROLL).
ONCHIP_GROUP_UNROLL = 2
# The longest row kept on chip, in 4-byte elements (kernelfuse.plan.schedule restates it as MAPPED_MAX_ROW).
ONCHIP_MAX_ROW = ONCHIP_MAX_BLOCKS * CHUNK_BYTES // 4

ONCHIP_PRELUDE = r"""
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// One element copied from global to shared memory without passing through registers: a thread issues all of its
// chunk's copies before it waits, so the whole chunk is in flight at once.
__device__ __forceinline__ void kf_cp_async4(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
// Four elements at once, bypassing L1 (both addresses 16-byte aligned): a quarter of the copy instructions.
__device__ __forceinline__ void kf_cp_async16(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void kf_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// The next (row, chunk) work item of a grid kernel, the same for every thread of the block.
__device__ __forceinline__ unsigned kf_grid_claim(unsigned* claim) {
  __shared__ unsigned kf_item;
  __syncthreads();  // every thread has read the previous item
  if (threadIdx.x == 0) kf_item = atomicAdd(claim, 1u);
  __syncthreads();
  return kf_item;
}
// The row's value from the partials of its C blocks (every thread of a block holds its block's): each block
// publishes its own and counts itself in; the first warp waits for the rest, gathers all C partials at once and
// one thread combines them in rank order (the same bits in every block).
template <int C, typename Merge>
__device__ __forceinline__ void kf_grid_reduce3(float& a, float& b, float& c, Merge merge, float* part,
                                                unsigned* arrived, long long row, long long rank) {
  __shared__ float kf_parts[C][3];
  __shared__ float kf_total[3];
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      float* mine = part + (row * C + rank) * 3;
      mine[0] = a; mine[1] = b; mine[2] = c;
      __threadfence();  // the partial is visible before the arrival is counted
      atomicAdd(arrived + row, 1u);
      unsigned seen = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived + row) : "memory");
        if (seen < C) __nanosleep(32);
      } while (seen < C);
    }
    __syncwarp();
    const float* all = part + row * C * 3;
    for (int i = threadIdx.x; i < 3 * C; i += 32) kf_parts[i / 3][i % 3] = __ldcg(all + i);  // from L2, not L1
    __syncwarp();
    if (threadIdx.x == 0) {
      float ta = kf_parts[0][0], tb = kf_parts[0][1], tc = kf_parts[0][2];
      for (int r = 1; r < C; ++r) merge(ta, tb, tc, kf_parts[r][0], kf_parts[r][1], kf_parts[r][2]);
      kf_total[0] = ta; kf_total[1] = tb; kf_total[2] = tc;
    }
  }
  __syncthreads();
  a = kf_total[0]; b = kf_total[1]; c = kf_total[2];
  __syncthreads();  // read before the next item's partial overwrites kf_total
}
template <int C, typename Op>
__device__ __forceinline__ float kf_grid_reduce(float v, Op op, float* part, unsigned* arrived, long long row,
                                                long long rank) {
  float unused_b = 0.0f, unused_c = 0.0f;
  kf_grid_reduce3<C>(v, unused_b, unused_c, [op](float& x, float&, float&, float y, float, float) { x = op(x, y); },
                     part, arrived, row, rank);
  return v;
}
#endif
"""


def row_blocks(step: GenStep, red: int, inner: bool, per_block_row: int, cache_max: int) -> int:
    """Blocks per row for the on-chip kernel (0: none): a contiguous row that a block reads alone (`per_block_row`
    elements per thread) but cannot cache in registers, which must be read back after its statistic, and whose
    chunks fit the shared memory of at most ONCHIP_MAX_BLOCKS blocks."""
    spec = step.spec
    writes_row = spec.broadcast or step.mapped is not None  # type: ignore[attr-defined]
    if not inner or not writes_row or per_block_row <= cache_max or red <= 1024:
        return 0
    if step.source.meta.dtype != torch.float32:  # the asynchronous copies move 4-byte elements
        return 0
    blocks = max(2, -(-red * 4 // CHUNK_BYTES))
    return blocks if blocks <= ONCHIP_MAX_BLOCKS else 0


def combine_across_blocks(blocks: int, values: tuple[str, ...], op: str) -> str:
    """The statement that combines the row's partial `values` (one with a reduction functor, or three with a
    merge functor) of its `blocks` blocks into the row's, in every block."""
    where = "kf_work, kf_arrived, row, kf_rank"
    if len(values) == 1:
        return f"{values[0]} = kf_grid_reduce<{blocks}>({values[0]}, {op}(), {where});"
    return f"kf_grid_reduce3<{blocks}>({', '.join(values)}, {op}(), {where});"


def blocks_per_sm(red: int, blocks: int) -> int:
    """Blocks an SM should hold at once: as many chunks as its 227 KB of shared memory take (the launch bound that
    keeps registers from limiting them), at most 2048 threads."""
    return max(1, min(2048 // ONCHIP_THREADS, 227 * 1024 // (chunk_of(red, blocks) * 4 + 1024)))


def onchip_workspace(rows: int, blocks: int) -> int:
    """Floats of workspace: three partial statistics per (row, block), then a counter of taken work items and one
    of arrived blocks per row (unsigned ints in float slots, zeroed before each launch)."""
    return 3 * rows * blocks + 1 + rows


def chunk_of(red: int, blocks: int) -> int:
    """Row elements per block, a multiple of 4 (16-byte chunk starts when the row is aligned)."""
    per_block = -(-red // blocks)
    return -(-per_block // 4) * 4


def onchip_launcher(step: GenStep, ctype: str, blocks: int, rows: int, red: int, fallback_grid: str,
                    fallback_threads: int) -> str:
    """`kN_launch`: the on-chip kernel where the device holds at least `blocks` of its blocks at once (sm_80+), its
    counters zeroed first; else the one-block-per-row kernel."""
    k = step.kernel
    params, args = launch_params(step, ctype)
    smem = chunk_of(red, blocks) * 4
    parts = 3 * rows * blocks
    return f"""
KF_EXPORT cudaError_t {k}_launch({params}, void* out, void* work, cudaStream_t stream) {{
#ifdef __CUDACC__
  static int resident = -1;  // blocks of the on-chip kernel the device runs at once, decided once per process
  if (resident < 0) {{
    int dev = 0, major = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const bool fits = major >= 8
        && cudaFuncSetAttribute({k}_onchip_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, {smem}) == cudaSuccess
        && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, {k}_onchip_kernel, {ONCHIP_THREADS},
                                                         {smem}) == cudaSuccess;
    resident = fits && per_sm * sms >= {blocks} ? per_sm * sms : 0;  // fewer could wait on each other forever
    cudaGetLastError();  // a refusal above is an answer, not an error of this launch
  }}
  if (resident) {{
    unsigned* counters = (unsigned*)((float*)work + {parts});  // items taken, then arrivals per row
    const cudaError_t zeroed = cudaMemsetAsync(counters, 0, {rows + 1} * sizeof(unsigned), stream);
    if (zeroed != cudaSuccess) return zeroed;
    const long long items = {rows}LL * {blocks};
    {k}_onchip_kernel<<<(unsigned)(items < resident ? items : resident), {ONCHIP_THREADS}, {smem}, stream>>>(
        {args}, ({out_ctype(step)}*)out, (float*)work);
    return cudaGetLastError();
  }}
#endif
  {k}_kernel<<<{fallback_grid}, {fallback_threads}, 0, stream>>>({args}, ({out_ctype(step)}*)out);
  return cudaGetLastError();
}}
"""


def copies_vectors(space: Space) -> bool:
    """Can the chunk copy move 16 bytes at a time? Four consecutive row elements must be neighbours in memory:
    the fastest reduced dim has unit stride and a multiple of 4 elements (chunks start at multiples of 4), and the
    other reduced dims' strides are multiples of 4 (each group of four then stays as aligned as the chunk's start).
    The kernel still checks the chunk's address at run time and copies element by element where it is unaligned."""
    *outer, last = space.dims("r")
    src = space.strides["src"]
    return src[last] == 1 and space.sizes[last] % 4 == 0 and all(src[d] % 4 == 0 for d in outer)


def chunk_copy(slot: str, element_pass: list[str], grouped: bool = False) -> list[str]:
    """Lines that copy this block's chunk of the row into shared memory (`slot` at chunk offset j * TPR + lane)
    and wait for it: 16-byte copies where the kernel's KF_VECTOR_COPIES (`copies_vectors`) holds and the chunk's
    address is aligned, else `element_pass` (one copy per element, each thread's own: no barrier needed, the
    block-wide one follows vector copies, and `grouped` passes, whose threads read four elements others may have
    copied). KF_ROW_CONTIGUOUS: the row is one run of memory, so no element's address needs the reduced dims'
    decomposition."""
    first = slot.replace("j * TPR + lane", "q")
    return ["    {",
            "      const INDEX kf_base = kf_rank * CHUNK;",
            "      const INDEX kf_len = (INDEX)RED - kf_base < CHUNK ? (INDEX)RED - kf_base : CHUNK;",
            "      const float* const kf_from = source_ptr(kf_base);",
            "      if (KF_VECTOR_COPIES && (reinterpret_cast<size_t>(kf_from) & 15) == 0) {",
            "#pragma unroll 1",  # the copies are asynchronous: unrolled, the loop spilled on sm_80
            "        for (INDEX q = 4 * (INDEX)threadIdx.x; q < kf_len; q += 4 * TPR)",
            f"          kf_cp_async16(&{first}, KF_ROW_CONTIGUOUS ? kf_from + q : source_ptr(kf_base + q));",
            "      } else {",
            *[f"    {ln}" for ln in element_pass],
            "      }",
            "    }",
            "    kf_cp_async_wait_all();",
            "    __syncthreads();  // a thread's elements were copied by others" if grouped else
            "    if (KF_VECTOR_COPIES) __syncthreads();  // a 16-byte copy fills other threads' elements"]


def chunk_pass(body: list[str], group: int = 1, head: list[str] | None = None,
               tail: list[str] | None = None) -> list[str]:
    """A pass over this block's chunk of the row: a thread's elements are j * TPR + lane of the chunk, or with
    `group` 4 (rows of a multiple of 4 elements) the four elements from 4 * (j * TPR + lane) on, read from shared
    memory in one 16-byte load and guarded once (a quarter of the loads, guards and offsets an element). A group's
    `head` runs once before its four elements (`r0` the first: operands the four share, `group_invariant`, loaded
    once), its `tail` after them (a 16-byte store of their four results)."""
    lines = [ln for b in body for ln in b.split("\n")]
    if group == 1:
        return [f"#pragma unroll {ONCHIP_UNROLL}", "    for (int j = 0; j < PER; ++j) {",
                "      const INDEX r = kf_rank * CHUNK + lane + (INDEX)j * TPR;",
                "      if (r < (INDEX)RED && j * TPR + lane < CHUNK) {", *[f"        {t}" for t in lines], "      }",
                "    }"]
    return [f"#pragma unroll {ONCHIP_GROUP_UNROLL}", "    for (int j = 0; j < PER4; ++j) {",
            "      const INDEX q = 4 * (lane + (INDEX)j * TPR);  // the group's offset in the chunk",
            "      if (kf_rank * CHUNK + q < (INDEX)RED && q < CHUNK) {",
            "        const float4 kf_raw4 = *reinterpret_cast<const float4*>(&kf_row_cache[q]);",
            "        const float kf_raws[4] = {kf_raw4.x, kf_raw4.y, kf_raw4.z, kf_raw4.w};",
            "        const INDEX r0 = kf_rank * CHUNK + q;",
            *[f"        {t}" for t in head or []],
            "#pragma unroll", "        for (int t = 0; t < 4; ++t) {",
            "          const INDEX r = r0 + t;",
            "          const float raw = kf_raws[t];", *[f"          {t}" for t in lines], "        }",
            *[f"        {t}" for t in tail or []],
            "      }", "    }"]


def group_invariant(space: Space, names: list[str]) -> list[str]:
    """The tensors of `names` whose element is the same for a group's four row elements (`pack_kinds` "same"
    along the row's innermost dim). A per-channel bias before a group norm over (channels, plane): one load a
    group, not four."""
    kinds = pack_kinds(space, 4, space.dims("r")[-1])
    return [n for n in names if kinds.get(n) == "same"]


def group_runs(space: Space, name: str) -> bool:
    """Are a group's four elements of tensor `name` consecutive in memory and aligned as the group (`pack_kinds`
    "run" along the row's innermost dim)? Then its offset at `r0` is a multiple of 4 and the group's elements are
    that offset + t."""
    return pack_kinds(space, 4, space.dims("r")[-1]).get(name) == "run"


def chunk_group(space: Space) -> int:
    """Elements an on-chip pass takes at once: 4 where the row's length is a multiple of 4 (chunks are, so a
    group is whole or past the end), else 1."""
    return 4 if space.count("r") % 4 == 0 else 1


def source_pointer_lambda(space: Space) -> list[str]:
    """`source_ptr(r)`: the address of the row's element r (what the asynchronous copy reads)."""
    return ["    auto source_ptr = [&](INDEX r) -> const float* {",
            *decompose(space, "r", "r", "o_", ["src"], "      "), "      return src + row_src + o_src;", "    };"]
