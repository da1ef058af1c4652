"""Long rows kept on chip across a thread-block cluster (Hopper, sm_90+): read from memory once.

A reduce-then-broadcast row (softmax, log_softmax, a norm, a reduction whose value every element reads back)
needs the whole row's statistic before it writes any element. A row longer than a block's register cache was
read twice (level-1 LogSoftmax at 1.58x its memory floor, InstanceNorm 1.71x, L1Norm 1.54x). Here a cluster of
`C` blocks shares a row: each block copies its chunk into shared memory once (asynchronous copies, all in flight
together) and reduces it, the blocks combine their partial statistics through distributed shared memory in a
fixed order (every block gets the same bits), and each block writes its chunk from shared memory.

The launcher runs the cluster kernel where the device supports cluster launch and can place the cluster, and
the one-block-per-row kernel of the same row otherwise (pre-Hopper GPUs; the CPU emulation): both compute the
same values up to the summation order.
"""

from __future__ import annotations

import torch

from kernelfuse.codegen.iteration import Space, decompose, launch_params
from kernelfuse.plan.ir import GenStep

CLUSTER_THREADS = 512
# Of a row in one block's shared memory: two blocks fit an SM (an H100 SM has 227 KB), so one block's loads overlap
# the other's statistics and stores. Measured on an H100 with one 200 KB block of 1024 threads per SM: log_softmax
# over rows of 393216 at 1.74x its memory floor, the phases of all SMs in step with DRAM idle in between.
CLUSTER_CHUNK_BYTES = 96 * 1024
# Measured on an H100: 3 blocks per row at 1.17x the memory floor (L1Norm); 11 and 16 blocks (the non-portable
# size) slower than two passes from one block (InstanceNorm 1.85x, LogSoftmax 1.72x): a large cluster waits for
# free slots in one GPC.
CLUSTER_MAX = 4
CLUSTER_UNROLL = 8

CLUSTER_PRELUDE = r"""
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
// One element copied from global to shared memory without passing through registers: a thread issues all of its
// chunk's copies before it waits, so the whole chunk is in flight at once.
__device__ __forceinline__ void kf_cp_async4(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void kf_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// The cluster's value of a row from each block's partial `v` (every thread of every block holds it): combined in
// rank order, so every block computes the same bits. The second sync keeps a block's partial alive until every
// other block has read it.
template <int C, typename Op>
__device__ __forceinline__ float kf_cluster_reduce(float v, Op op) {
  __shared__ float kf_part;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (threadIdx.x == 0) kf_part = v;
  cluster.sync();
  float t = *cluster.map_shared_rank(&kf_part, 0);
#pragma unroll
  for (int b = 1; b < C; ++b) t = op(t, *cluster.map_shared_rank(&kf_part, b));
  cluster.sync();
  return t;
}
template <int C, typename Merge>
__device__ __forceinline__ void kf_cluster_reduce3(float& a, float& b, float& c, Merge merge) {
  __shared__ float kf_part3[3];
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (threadIdx.x == 0) { kf_part3[0] = a; kf_part3[1] = b; kf_part3[2] = c; }
  cluster.sync();
  const float* p = cluster.map_shared_rank(kf_part3, 0);
  float ta = p[0], tb = p[1], tc = p[2];
#pragma unroll
  for (int r = 1; r < C; ++r) {
    const float* q = cluster.map_shared_rank(kf_part3, r);
    merge(ta, tb, tc, q[0], q[1], q[2]);
  }
  cluster.sync();
  a = ta; b = tb; c = tc;
}
#endif
"""


def cluster_size(step: GenStep, red: int, inner: bool, per_block_row: int, cache_max: int) -> int:
    """Blocks per row for the cluster kernel (0: none): a contiguous row that a block reads alone (`per_block_row`
    elements per thread) but cannot cache in registers, which must be read back after its statistic, and whose
    chunks fit the shared memory of at most CLUSTER_MAX blocks."""
    spec = step.spec
    writes_row = spec.broadcast or step.mapped is not None  # type: ignore[attr-defined]
    if not inner or not writes_row or per_block_row <= cache_max or red <= 1024:
        return 0
    if step.source.meta.dtype != torch.float32:  # the asynchronous copies move 4-byte elements
        return 0
    blocks = max(2, -(-red * 4 // CLUSTER_CHUNK_BYTES))
    return blocks if blocks <= CLUSTER_MAX else 0


def chunk_of(red: int, blocks: int) -> int:
    """Row elements per block, a multiple of 4 (16-byte chunk starts when the row is aligned)."""
    per_block = -(-red // blocks)
    return -(-per_block // 4) * 4


def cluster_launcher(step: GenStep, ctype: str, blocks: int, rows: int, red: int, fallback_grid: str,
                     fallback_threads: int) -> str:
    """`kN_launch`: the cluster kernel where the device can run it, else the one-block-per-row kernel."""
    k = step.kernel
    params, args = launch_params(step, ctype)
    smem = chunk_of(red, blocks) * 4
    return f"""
cudaError_t {k}_launch({params}, void* out, cudaStream_t stream) {{
#ifdef __CUDACC__
  cudaLaunchAttribute dims[1];
  dims[0].id = cudaLaunchAttributeClusterDimension;
  dims[0].val.clusterDim.x = {blocks};
  dims[0].val.clusterDim.y = 1;
  dims[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {{}};
  config.gridDim = dim3((unsigned)({rows}LL * {blocks}));
  config.blockDim = dim3({CLUSTER_THREADS});
  config.dynamicSmemBytes = {smem};
  config.stream = stream;
  config.attrs = dims;
  config.numAttrs = 1;
  static int usable = -1;  // decided once per process: cluster launch supported and the cluster placeable
  if (usable < 0) {{
    int dev = 0, supported = 0, clusters = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, dev);
    usable = supported
        && cudaFuncSetAttribute({k}_cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, {smem}) == cudaSuccess
        && cudaOccupancyMaxActiveClusters(&clusters, {k}_cluster_kernel, &config) == cudaSuccess && clusters > 0;
    cudaGetLastError();  // a refusal above is an answer, not an error of this launch
  }}
  if (usable) return cudaLaunchKernelEx(&config, {k}_cluster_kernel, {args}, ({ctype}*)out);
#endif
  {k}_kernel<<<{fallback_grid}, {fallback_threads}, 0, stream>>>({args}, ({ctype}*)out);
  return cudaGetLastError();
}}
"""


def source_pointer_lambda(space: Space) -> list[str]:
    """`source_ptr(r)`: the address of the row's element r (what the asynchronous copy reads)."""
    return ["    auto source_ptr = [&](INDEX r) -> const float* {",
            *decompose(space, "r", "r", "o_", ["src"], "      "), "      return src + row_src + o_src;", "    };"]
