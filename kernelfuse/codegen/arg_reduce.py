"""argmax / argmin in the row and split reduction kernels: each thread keeps a (value, index) pair, and pairs
combine so that the result is eager's exactly, whatever the order of the combines.

torch's semantics (checked on the CPU, and ATen's CUDA kernel keeps them): a NaN is the extreme (the first NaN's
index wins), equal values (-0.0 == 0.0 included) keep the lowest index. The pair order below is total with the
index as the last key, so the warp shuffles, the block's fixed-order combine and a split's chunk partials all pick
the same element. Values are compared as floats (half types load exactly), the index is the element's number
within the row (row-major over the reduced dims: torch's index into the flattened tensor where every dim is
reduced), and the output is int64.

A thread reading strided rows (one thread per row, the `strided` strategy, e.g. an argmin over a middle dim)
waits on each load before its compare: UNROLL loads are issued together before any is compared, so that enough
bytes are in flight per thread to reach memory bandwidth.
"""

from __future__ import annotations

from kernelfuse.codegen.common import INT32_LIMIT
from kernelfuse.ops.reductions import INDEX_KINDS

__all__ = ["ARG_PRELUDE", "INDEX_KINDS", "arg_row_lines", "arg_split_combine", "arg_split_partial",
           "arg_workspace"]

UNROLL = 8  # a thread's loads in flight at once (8 x 4 bytes x 2048 threads: 64 KB per SM; not measured)
NO_INDEX = "0x7fffffffffffffffLL"  # the identity's index: any element of the row beats it

ARG_PRELUDE = r"""
// argmax/argmin pairs (value, index): is (vb, ib) the better one? A NaN is the extreme (only an earlier NaN beats
// it); equal values (-0.0 == 0.0) keep the lower index. A total order, so any combine order gives eager's index.
template <bool MAX>
__device__ __forceinline__ bool kf_arg_better(float va, long long ia, float vb, long long ib) {
  if (va != va) return vb != vb && ib < ia;
  if (vb != vb) return true;
  return (MAX ? vb > va : vb < va) || (vb == va && ib < ia);
}
template <bool MAX>
__device__ __forceinline__ void kf_arg_add(float& v, long long& i, float vb, long long ib) {
  if (kf_arg_better<MAX>(v, i, vb, ib)) { v = vb; i = ib; }
}
// A thread's next element, at a higher index than any it took: it wins only if strictly beyond the extreme so
// far or a NaN, and nothing beats a NaN (the general kf_arg_better in two compares).
template <bool MAX, typename I>
__device__ __forceinline__ void kf_arg_next(float& v, I& i, float vb, I ib) {
  if (v == v && !(MAX ? vb <= v : vb >= v)) { v = vb; i = ib; }
}
// kf_row_reduce for a pair: the TPR threads of a row end with the row's (value, index).
template <int TPR, bool MAX>
__device__ __forceinline__ void kf_row_reduce_arg(float& v, long long& i) {
  if (TPR > 1) {
#pragma unroll
    for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      const long long i2 = __shfl_xor_sync(0xffffffffu, i, o);
      kf_arg_add<MAX>(v, i, v2, i2);
    }
  }
  if (TPR <= 32) return;
  __shared__ float kf_arg_v[32];
  __shared__ long long kf_arg_i[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { kf_arg_v[warp] = v; kf_arg_i[warp] = i; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int j = 1; j < TPR / 32; ++j) kf_arg_add<MAX>(kf_arg_v[0], kf_arg_i[0], kf_arg_v[j], kf_arg_i[j]);
  }
  __syncthreads();
  v = kf_arg_v[0];
  i = kf_arg_i[0];
}
"""


def _max(kind: str) -> str:
    return "true" if kind == "argmax" else "false"


def _identity(kind: str) -> str:
    return "(-INFINITY)" if kind == "argmax" else "INFINITY"


def arg_row_lines(kind: str, red: int, tpr: int) -> list[str]:
    """A row kernel's argmax/argmin (after `RED` and the `value(r)` lambda): each of the row's `tpr` threads
    starts at its first element and takes the rest in increasing order, in batches of UNROLL loads; the pairs
    combine across the row and one thread stores the index."""
    assert tpr <= red, "row_strategy gives every thread of a row an element"  # no identity pair needed
    m = _max(kind)
    at = "int" if red <= INT32_LIMIT else "long long"
    return ["    float best = value(lane);  // TPR <= RED: every thread of the row has an element",
            f"    {at} at = lane;",
            f"    INDEX r0 = lane + TPR;  // {UNROLL} loads in flight before the first compare",
            f"    for (; r0 + (INDEX)({UNROLL - 1} * TPR) < (INDEX)RED; r0 += (INDEX)({UNROLL} * TPR)) {{",
            f"      float v[{UNROLL}];",
            "#pragma unroll",
            f"      for (int u = 0; u < {UNROLL}; ++u) v[u] = value(r0 + (INDEX)u * TPR);",
            "#pragma unroll",
            f"      for (int u = 0; u < {UNROLL}; ++u) kf_arg_next<{m}>(best, at, v[u], ({at})(r0 + (INDEX)u * TPR));",
            "    }",
            f"    for (; r0 < (INDEX)RED; r0 += TPR) kf_arg_next<{m}>(best, at, value(r0), ({at})r0);",
            "    long long at_row = at;",
            f"    kf_row_reduce_arg<TPR, {m}>(best, at_row);",
            "    if (lane == 0) out[row] = at_row;"]


def arg_workspace(rows: int, chunks: int) -> int:
    """Floats of a split argmax's workspace: each (row, chunk)'s value, then its 64-bit index (8-byte aligned)."""
    return _index_offset(rows, chunks) + 2 * rows * chunks


def _index_offset(rows: int, chunks: int) -> int:
    return rows * chunks + rows * chunks % 2


def arg_split_partial(kind: str, rows: int, chunks: int, strided: bool, tile: int, unroll: int) -> list[str]:
    """The body of a split argmax's partial kernel (after its `begin`/`end` of the chunk): the chunk's pair,
    combined across the block in a fixed order, stored at (row, chunk) of the workspace."""
    m = _max(kind)
    lines = [f"  float s = {_identity(kind)};", f"  long long at = {NO_INDEX};"]
    take = f"for (INDEX r = begin + lane; r < end; r += TPR) kf_arg_add<{m}>(s, at, value(r), (long long)r);"
    if strided:
        lines += [f"  if (active) {take}",
                  f"  __shared__ float part[TPR][{tile + 1}];",
                  f"  __shared__ long long part_i[TPR][{tile + 1}];",
                  "  part[lane][tx] = s;",
                  "  part_i[lane][tx] = at;",
                  "  __syncthreads();",
                  "  if (lane != 0 || !active) return;",
                  f"  for (int j = 1; j < TPR; ++j) kf_arg_add<{m}>(s, at, part[j][tx], part_i[j][tx]);  // in order"]
    else:
        lines += [f"#pragma unroll {unroll}",
                  f"  {take}",
                  f"  kf_row_reduce_arg<TPR, {m}>(s, at);",
                  "  if (lane != 0) return;"]
    return lines + [f"  work[row * {chunks} + blockIdx.x] = s;",
                    f"  ((long long*)(work + {_index_offset(rows, chunks)}))[row * {chunks} + blockIdx.x] = at;",
                    "}", ""]


def arg_split_combine(kind: str, rows: int, chunks: int) -> list[str]:
    """The body of a split argmax's combine kernel (a warp per `row`): the row's chunk pairs, then its index."""
    m = _max(kind)
    return [f"  const long long* const work_i = (const long long*)(work + {_index_offset(rows, chunks)});",
            f"  float s = {_identity(kind)};",
            f"  long long at = {NO_INDEX};",
            f"  for (int c = lane; c < {chunks}; c += TPR) kf_arg_add<{m}>(s, at, work[row * {chunks} + c], "
            f"work_i[row * {chunks} + c]);",
            f"  kf_row_reduce_arg<TPR, {m}>(s, at);",
            "  if (lane == 0) out[row] = at;"]
