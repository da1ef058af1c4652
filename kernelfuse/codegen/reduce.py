"""Row reductions and reduce-then-broadcast kernels (reductions, softmax, norms) for generated kernels.

Two row strategies, chosen from the merged space:
- `inner` (the source's innermost dim is reduced): a warp (short rows) or a whole block (long rows) per row; threads stride
  along the row, so loads are coalesced; partial results combine through warp shuffles and shared memory;
- `strided` (the source's innermost dim is kept, or rows are very short): one thread per row; neighbouring threads own
  neighbouring rows, so loads are coalesced across the warp;
and `split` for a few long rows (partials per chunk, then an ordered combine).

Kinds (kernelfuse.ops.reductions): one pass for sum/mean/prod/amax/amin; logsumexp and softmax take the row max
first (ATen's order: max, then sum of exp(x - max)); norms take the mean, then the biased variance around it
(two passes, more accurate than one-pass sums). Passes re-read the row and recompute the prologue instead of
storing it. Numerics follow ATen: float accumulation, NaN-propagating max/min, logsumexp's infinite max replaced by
0, softmax as exp(x - max) / sum, batch norm's running statistics with the unbiased variance.
"""

from __future__ import annotations

from kernelfuse.codegen.iteration import (
    BLOCK,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    launch_params,
    launcher,
    pointer_params,
    space_of,
    value_lambda,
)
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep

REDUCE_PRELUDE = r"""
struct kf_sum_op { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct kf_prod_op { __device__ __forceinline__ float operator()(float a, float b) const { return a * b; } };
struct kf_max_op { __device__ __forceinline__ float operator()(float a, float b) const { return (a != a || b != b) ? NAN : fmaxf(a, b); } };
struct kf_min_op { __device__ __forceinline__ float operator()(float a, float b) const { return (a != a || b != b) ? NAN : fminf(a, b); } };

// Combine `v` across the TPR threads of a row (TPR 1: the thread owns the row; 32: a warp; else the block).
template <int TPR, typename Op>
__device__ __forceinline__ float kf_row_reduce(float v, Op op) {
  if (TPR == 1) return v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (TPR <= 32) return v;
  __shared__ float kf_smem[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with kf_smem
  if (lane == 0) kf_smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {  // one thread combines the warps' results, in a fixed order
    float w = kf_smem[0];
#pragma unroll
    for (int j = 1; j < TPR / 32; ++j) w = op(w, kf_smem[j]);
    kf_smem[0] = w;
  }
  __syncthreads();
  return kf_smem[0];
}
"""

REDUCE_OPS = {"sum": ("kf_sum_op", "0.0f"), "mean": ("kf_sum_op", "0.0f"), "prod": ("kf_prod_op", "1.0f"),
              "amax": ("kf_max_op", "(-INFINITY)"), "amin": ("kf_min_op", "INFINITY")}


SPLIT_MAX_ROWS = 264  # two rows per SM of an H100: fewer rows than this leave multiprocessors idle
SPLIT_MIN_ROW = 65536
SPLIT_TARGET_BLOCKS = 1024
SPLIT_MIN_CHUNK = 4096
STRIDED_SPLIT_MAX_ROWS = 32768  # from here one thread per strided row keeps the GPU busy
STRIDED_TILE = 32  # neighbouring rows a split-strided block reads side by side
STRIDED_MIN_CHUNK = 256  # elements of a row per split-strided block: 32 per warp


def split_chunks(step: GenStep) -> int:
    """Chunks per row for a split reduction (1: none). A few long rows (a loss over the whole tensor, a sum over a
    large outer dim) are cut into chunks reduced by separate blocks, then combined in a fixed order. Rows whose
    elements are strided (a channels-last output pooled over space) are split too while there are too few rows
    for a thread each to fill the GPU."""
    spec = step.spec
    if spec is None or spec.kind not in REDUCE_OPS or spec.window is not None:  # type: ignore[attr-defined]
        return 1
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    if not reads_rows_contiguously(space):
        if rows >= STRIDED_SPLIT_MAX_ROWS or red < 2 * STRIDED_MIN_CHUNK:
            return 1
        tiles = -(-rows // STRIDED_TILE)
        return max(1, min(-(-SPLIT_TARGET_BLOCKS // tiles), red // STRIDED_MIN_CHUNK))
    if rows > SPLIT_MAX_ROWS or red < SPLIT_MIN_ROW:
        return 1
    return max(1, min(-(-SPLIT_TARGET_BLOCKS // rows), red // SPLIT_MIN_CHUNK))


def _split_kernel(step: GenStep, ctype: str, chunks: int) -> str:
    """Split reduction: each block reduces one chunk of its rows into `work`; one warp per row combines the chunks
    in order, then the epilogue. Deterministic: the same partials combine the same way on every call.
    Contiguous rows: a block per (chunk, row), its threads along the row. Strided rows: a block per (chunk, tile
    of 32 neighbouring rows), a warp across the tile (coalesced: neighbouring rows are neighbours in memory) and
    8 warps along the chunk, combined through shared memory."""
    spec = step.spec
    k = step.kernel
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    chunk = -(-red // chunks)
    op, identity = REDUCE_OPS[spec.kind]  # type: ignore[attr-defined]
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    strided = not reads_rows_contiguously(space)
    head = [f"__global__ void __launch_bounds__({BLOCK}) {k}_partial({pointer_params(step, ctype)}, "
            "float* __restrict__ work) {",
            f"  typedef {index_type(step)} INDEX;"]
    if strided:
        lanes = BLOCK // STRIDED_TILE
        lines = [f"// strategy: split strided, {rows} rows of {red} in {chunks} chunks of {chunk}, tiles of "
                 f"{STRIDED_TILE} rows, then a combine kernel", *head,
                 f"  const int tx = threadIdx.x % {STRIDED_TILE}, lane = threadIdx.x / {STRIDED_TILE};",
                 f"  constexpr int TPR = {lanes};",
                 f"  const INDEX row = (INDEX)blockIdx.y * {STRIDED_TILE} + tx;",
                 f"  const bool active = row < (INDEX){rows};",
                 "  const INDEX row_k = active ? row : 0;"]
        lines += decompose(space, "k", "row_k", "row_", tensors, "  ")
    else:
        lines = [f"// strategy: split, {rows} rows of {red} in {chunks} chunks of {chunk}, then a combine kernel",
                 *head,
                 f"  constexpr int TPR = {BLOCK};",
                 "  const int lane = threadIdx.x;",
                 "  const INDEX row = blockIdx.y;"]
        lines += decompose(space, "k", "row", "row_", tensors, "  ")
    lines += value_lambda(step, space, "r", "row_")
    lines += [f"  const INDEX begin = (INDEX)blockIdx.x * {chunk};",
              f"  const INDEX end = begin + {chunk} < (INDEX){red} ? begin + {chunk} : (INDEX){red};",
              f"  float s = {identity};"]
    if strided:
        lines += [f"  if (active) for (INDEX r = begin + lane; r < end; r += TPR) s = {op}()(s, value(r));",
                  f"  __shared__ float part[TPR][{STRIDED_TILE + 1}];",
                  "  part[lane][tx] = s;",
                  "  __syncthreads();",
                  "  if (lane != 0 || !active) return;",
                  f"  for (int j = 1; j < TPR; ++j) s = {op}()(s, part[j][tx]);  // in a fixed order"]
    else:
        lines += [f"  for (INDEX r = begin + lane; r < end; r += TPR) s = {op}()(s, value(r));",
                  f"  s = kf_row_reduce<TPR>(s, {op}());",
                  "  if (lane != 0) return;"]
    lines += [f"  work[row * {chunks} + blockIdx.x] = s;",
              "}", "",
              f"__global__ void __launch_bounds__({BLOCK}) {k}_combine({pointer_params(step, ctype)}, "
              "const float* __restrict__ work) {",
              f"  typedef {index_type(step)} INDEX;",
              "  constexpr int TPR = 32;",
              "  const int lane = threadIdx.x % TPR;",
              f"  const INDEX row = (INDEX)blockIdx.x * {BLOCK // 32} + threadIdx.x / TPR;",
              f"  if (row >= {rows}) return;",
              f"  float s = {identity};",
              f"  for (int c = lane; c < {chunks}; c += TPR) s = {op}()(s, work[row * {chunks} + c]);",
              f"  s = kf_row_reduce<TPR>(s, {op}());"]
    if spec.kind == "mean":  # type: ignore[attr-defined]
        lines.append(f"  s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
    lines += [ln[2:] for ln in _reduced_store(step, "s", ctype)]
    lines += ["}", ""]
    params, args = launch_params(step, ctype)
    lines.append(f"""
cudaError_t {k}_launch({params}, void* out, void* work, cudaStream_t stream) {{
  {k}_partial<<<dim3({chunks}, {-(-rows // STRIDED_TILE) if strided else rows}), {BLOCK}, 0, stream>>>({args}, ({ctype}*)out, (float*)work);
  {k}_combine<<<kf_blocks({rows}LL * 32, {BLOCK}), {BLOCK}, 0, stream>>>({args}, ({ctype}*)out, (const float*)work);
  return cudaGetLastError();
}}
""")
    return "\n".join(lines)


def reads_rows_contiguously(space: Space) -> bool:
    """Is the source's unit-stride dim a reduced one? Then a row's elements lie next to each other and the `inner`
    strategy coalesces (a channels-last source reduced over channels: its innermost logical dim is kept)."""
    if not space.dims("r"):
        return False
    src = space.strides["src"]
    unit = [d for d in range(len(space.sizes)) if src[d] == 1]
    return space.classes[unit[-1] if unit else -1] == "r"


def row_kernel(step: GenStep, ctype: str) -> str:
    spec = step.spec
    k = step.kernel
    chunks = split_chunks(step)
    if chunks > 1:
        return _split_kernel(step, ctype, chunks)
    space = space_of(step)
    index_t = index_type(step)
    rows, red = space.count("k"), space.count("r")
    inner = reads_rows_contiguously(space)
    tpr = 1 if not inner or red < 32 else 32 if red <= 1024 else BLOCK
    rows_per_block = BLOCK // tpr
    kind = spec.kind  # type: ignore[attr-defined]
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    if spec.broadcast:  # type: ignore[attr-defined]
        tensors += ["out"] + [n for n in ("weight", "bias") if n in space.strides]
    lines = [f"// strategy: {'inner' if inner else 'strided'}, {tpr} thread(s) per row, {rows} rows of {red}",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  constexpr int TPR = {tpr};",
             "  const int lane = threadIdx.x % TPR;",
             f"  for (INDEX row = (INDEX)blockIdx.x * {rows_per_block} + threadIdx.x / TPR; row < (INDEX){rows}; "
             f"row += (INDEX)gridDim.x * {rows_per_block}) {{"]
    lines += decompose(space, "k", "row", "row_", tensors, "    ")
    lines += value_lambda(step, space, "r", "row_")
    lines += _kind_lines(step, kind, red, ctype, space)
    lines += ["  }", "}", ""]
    grid = f"kf_blocks({rows}LL * {tpr}, {BLOCK})"
    return "\n".join(lines) + launcher(step, ctype, grid)


def _loop(body: list[str], ind: str = "    ") -> list[str]:
    return [f"{ind}for (INDEX r = lane; r < (INDEX)RED; r += TPR) {{", *[f"{ind}  {b}" for b in body], f"{ind}}}"]


def _kind_lines(step: GenStep, kind: str, red: int, ctype: str, space: Space) -> list[str]:
    spec = step.spec
    lines = [f"    constexpr INDEX RED = {red};"]
    if kind in REDUCE_OPS:
        op, identity = REDUCE_OPS[kind]
        lines.append(f"    float s = {identity};")
        lines += _loop([f"s = {op}()(s, value(r));"])
        lines.append(f"    s = kf_row_reduce<TPR>(s, {op}());")
        if kind == "mean":
            lines.append(f"    s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
        return lines + _reduced_store(step, "s", ctype)
    if kind in ("logsumexp", "softmax", "log_softmax"):
        lines.append("    float m = -INFINITY;")
        lines += _loop(["m = kf_max_op()(m, value(r));"])
        lines.append("    m = kf_row_reduce<TPR>(m, kf_max_op());")
        if kind == "logsumexp":
            lines.append("    m = fabsf(m) == INFINITY ? 0.0f : m;  // ATen: an infinite max is replaced by 0")
        lines.append("    float s = 0.0f;")
        lines += _loop(["s += expf(value(r) - m);"])
        lines.append("    s = kf_row_reduce<TPR>(s, kf_sum_op());")
        if kind == "logsumexp":
            lines.append("    const float lse = logf(s) + m;")
            return lines + _reduced_store(step, "lse", ctype)
        lines.append("    const float logs = logf(s);" if kind == "log_softmax" else "")
        expr = "value(r) - m - logs" if kind == "log_softmax" else "expf(value(r) - m) / s"
        return lines + _broadcast_store(step, expr, ctype, [], space)
    # norm: mean, then the biased variance around it; affine; batch norm updates its running statistics
    lines.append("    float s = 0.0f;")
    lines += _loop(["s += value(r);"])
    lines.append(f"    const float mean = kf_row_reduce<TPR>(s, kf_sum_op()) * {float_literal(1.0 / red)};")
    lines.append("    float q = 0.0f;")
    lines += _loop(["const float d = value(r) - mean;", "q += d * d;"])
    lines.append(f"    const float var = kf_row_reduce<TPR>(q, kf_sum_op()) * {float_literal(1.0 / red)};")
    lines.append(f"    const float rstd = 1.0f / sqrtf(var + {float_literal(spec.eps)});")  # type: ignore[attr-defined]
    if spec.running is not None:  # type: ignore[attr-defined]
        m = float_literal(spec.momentum)  # type: ignore[attr-defined]
        keep = float_literal(1.0 - spec.momentum)  # type: ignore[attr-defined]
        unbias = float_literal(red / max(red - 1, 1))
        lines += ["    if (lane == 0) {  // running statistics, as ATen updates them (unbiased variance)",
                  f"      run_mean[row] = kf_store<{ctype}>({m} * mean + {keep} * kf_load(run_mean[row]));",
                  f"      run_var[row] = kf_store<{ctype}>({m} * (var * {unbias}) + {keep} * kf_load(run_var[row]));",
                  "    }"]
    expr = "(value(r) - mean) * rstd"
    if spec.weight is not None:  # type: ignore[attr-defined]
        expr = f"({expr}) * kf_load(weight[row_weight + o_weight])"
    if spec.bias is not None:  # type: ignore[attr-defined]
        expr = f"{expr} + kf_load(bias[row_bias + o_bias])"
    affine = [n for n in ("weight", "bias") if n in space.strides]
    return lines + _broadcast_store(step, expr, ctype, affine, space)


def _reduced_store(step: GenStep, value: str, ctype: str) -> list[str]:
    lines = ["    if (lane == 0) {", f"      const float y = {value};"]
    lines += epilogue_lines(step, "row", "      ")
    lines += [f"      out[row] = kf_store<{ctype}>(e_result);", "    }"]
    return lines


def _broadcast_store(step: GenStep, expr: str, ctype: str, extra: list[str], space: Space) -> list[str]:
    """Write every element of the row: `expr` (the row's statistics applied), then the epilogue."""
    body = [ln.strip() for ln in decompose(space, "r", "r", "o_", ["out", *extra], "")]
    body.append(f"const float y = {expr};")
    body += [ln.strip() for ln in epilogue_lines(step, "row_out + o_out", "")]
    body.append(f"out[row_out + o_out] = kf_store<{ctype}>(e_result);")
    return _loop(body)
