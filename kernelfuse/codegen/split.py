"""Split reductions and split norms: a few long rows cut into chunks that separate blocks reduce, then combined in
a fixed order (deterministic: no float atomics). Contiguous rows take a block per (chunk, row); strided rows (a
channels-last source reduced over space) a block per (chunk, tile of neighbouring rows), a warp across the tile.
A norm splits its statistics that way in one Welford pass (each chunk's mean and squared deviations, merged by
Chan's formula) and normalises every element in a pass of its own; its numerics are the row kernels'
(kernelfuse.codegen.reduce).
"""

from __future__ import annotations

from kernelfuse.codegen.arg_reduce import INDEX_KINDS, arg_split_combine, arg_split_partial, arg_workspace
from kernelfuse.codegen.iteration import (
    BLOCK,
    UNROLL,
    decompose,
    index_type,
    launch_params,
    out_ctype,
    pointer_params,
    space_of,
    value_lambda,
)
from kernelfuse.codegen.reduce import REDUCE_OPS, moments_store, reduced_store, rstd, running_lines
from kernelfuse.codegen.row_passes import reads_rows_contiguously
from kernelfuse.codegen.split_normalise import normalise_kernels, normalise_pass, normalise_strategy
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep

# norm: the statistics split, then one pass over every element; argmax/argmin: (value, index) partials
SPLIT_KINDS = frozenset({*REDUCE_OPS, *INDEX_KINDS, "norm", "moments"})
SPLIT_MAX_ROWS = 264  # two rows per SM of an H100: fewer rows than this leave multiprocessors idle
SPLIT_MIN_ROW = 65536
SPLIT_TARGET_BLOCKS = 1024
SPLIT_MIN_CHUNK = 4096
STRIDED_SPLIT_MAX_ROWS = 32768  # from here one thread per strided row keeps the GPU busy
STRIDED_TILE = 32  # neighbouring rows a split-strided block reads side by side (fewer rows: a power of two above)
STRIDED_MIN_CHUNK = 256  # elements of a row per split-strided block: 32 per warp


def split_chunks(step: GenStep) -> int:
    """Chunks per row for a split reduction or normalisation (1: none). A few long rows (a loss over the whole
    tensor, a sum over a large outer dim, batch norm's channels) are cut into chunks reduced by separate blocks,
    then combined in a fixed order. Rows whose elements are strided (a channels-last output pooled over space) are
    split too while there are too few rows for a thread each to fill the GPU."""
    spec = step.spec
    if spec is None or spec.kind not in SPLIT_KINDS or spec.window is not None or step.mapped is not None:  # type: ignore[attr-defined]
        return 1  # a broadcast consumer needs the whole row's value in the block that writes it
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    if not reads_rows_contiguously(space):
        if rows >= STRIDED_SPLIT_MAX_ROWS or red < 2 * STRIDED_MIN_CHUNK:
            return 1
        tiles = -(-rows // strided_tile(rows))
        return max(1, min(-(-SPLIT_TARGET_BLOCKS // tiles), red // STRIDED_MIN_CHUNK))
    if rows > SPLIT_MAX_ROWS or red < SPLIT_MIN_ROW:
        return 1
    return max(1, min(-(-SPLIT_TARGET_BLOCKS // rows), red // SPLIT_MIN_CHUNK))


def strided_tile(rows: int) -> int:
    """Strided rows a split block reads side by side: 32, or the power of two that covers fewer rows (16 channels:
    a warp reads two neighbouring positions of all 16, 128 contiguous bytes, with no thread idle)."""
    return min(STRIDED_TILE, 1 << max(rows - 1, 0).bit_length())


def split_workspace(step: GenStep) -> int:
    """Floats of device workspace a split kernel needs (0: none): a partial result per (row, chunk); a split norm
    keeps two per (row, chunk) (mean, squared deviations) and adds each row's mean and 1/std after them."""
    chunks = split_chunks(step)
    if chunks == 1:
        return 0
    rows = space_of(step).count("k")
    if step.spec.kind in INDEX_KINDS:  # type: ignore[attr-defined]
        return arg_workspace(rows, chunks)
    if step.spec.kind == "moments":  # type: ignore[attr-defined]
        return 2 * rows * chunks
    return 2 * rows * chunks + 2 * rows if step.spec.kind == "norm" else rows * chunks  # type: ignore[attr-defined]


def split_kernel(step: GenStep, ctype: str, chunks: int) -> str:
    """Split reduction: each block reduces one chunk of its rows into `work`; one warp per row combines the chunks
    in order, then the epilogue. Deterministic: the same partials combine the same way on every call.
    Contiguous rows: a block per (chunk, row), its threads along the row. Strided rows: a block per (chunk, tile
    of up to 32 neighbouring rows), a warp across the tile (coalesced: neighbouring rows are neighbours in memory)
    and the rest along the chunk, combined through shared memory.
    A norm's blocks gather each chunk's (mean, squared deviations) in one Welford pass, a warp per row merges them
    (Chan) into the row's mean and 1/std (running statistics as the one-kernel norm updates them), then a kernel
    of its own normalises every element: two reads of the row, not three."""
    spec = step.spec
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    strided = not reads_rows_contiguously(space)
    norm = spec.kind in ("norm", "moments")  # type: ignore[attr-defined]
    alone = spec.kind == "moments"  # type: ignore[attr-defined]  # the statistics are the output: no normalise pass
    tile = strided_tile(rows)
    tiles = f", tiles of {tile} rows" if strided else ""
    then = "a combine kernel"
    if norm:
        then = "a Welford combine kernel" + ("" if alone else f", then {normalise_strategy(space)}")
    lines = [f"// strategy: split{' norm' if norm else ''}{' strided' if strided else ''}, {rows} rows of {red} in "
             f"{chunks} chunks of {-(-red // chunks)}{tiles}, then {then}"]
    scale = float_literal(1.0 / red)
    k = step.kernel
    combine_grid = f"kf_blocks({rows}LL * 32, {BLOCK})"
    partial_grid = f"dim3({chunks}, {-(-rows // tile) if strided else rows})"
    if norm:
        stats = 2 * rows * chunks  # work: the partial means, the partial squared deviations, each row's mean, 1/std
        store = f"  {moments_store(step)}" if alone else \
            f"  if (lane == 0) {{ work[{stats} + row] = mean; work[{stats + rows} + row] = rstd; }}"
        moments = [f"  const float var = m2 * {scale}, rstd = {rstd(step)};", store,
                   *running_lines(step, red, ctype, "  ")]
        lines += _split_partial(step, ctype, chunks, "moments", None)
        lines += _split_combine_welford(step, ctype, chunks, moments)
        passes = [("moments", partial_grid, "float*"), ("combine", combine_grid, "float*")]
        if not alone:
            lines += normalise_kernels(step, ctype, space, stats)
            passes.append(normalise_pass(step, space, stats))
    elif spec.kind in INDEX_KINDS:  # type: ignore[attr-defined]
        lines += _split_partial(step, ctype, chunks, "partial", None)
        combine = arg_split_combine(spec.kind, rows, chunks)  # type: ignore[attr-defined]
        lines += [*_combine_head(step, ctype, "combine", True), *combine, "}", ""]
        passes = [("partial", partial_grid, "float*"), ("combine", combine_grid, "const float*")]
    else:
        finish = [f"  s = s * {scale};  // ATen's mean: sum times 1/N"] if spec.kind == "mean" else []  # type: ignore[attr-defined]
        finish += [ln[2:] for ln in reduced_store(step, "s", ctype)]
        op, identity = REDUCE_OPS[spec.kind]  # type: ignore[attr-defined]
        lines += _split_partial(step, ctype, chunks, "partial", (op, identity))
        lines += _split_combine(step, ctype, chunks, "combine", op, identity, finish, const=True)
        passes = [("partial", partial_grid, "float*"), ("combine", combine_grid, "const float*")]
    params, args = launch_params(step, ctype)
    launches = "\n".join(_launch(k, pass_, args, out_ctype(step)) for pass_ in passes)
    lines.append(f"""
KF_EXPORT cudaError_t {k}_launch({params}, void* out, void* work, cudaStream_t stream) {{
{launches}
  return cudaGetLastError();
}}
""")
    return "\n".join(lines)


def _split_partial(step: GenStep, ctype: str, chunks: int, name: str, reduce: tuple[str, str] | None) -> list[str]:
    """Kernel `{k}_{name}`: each block combines value(r) with `reduce` (its op and identity) over one chunk of its
    row(s) into work[row * chunks + chunk]; `reduce` None: the chunk's mean and squared deviations instead
    (Welford), the latter rows * chunks further on; or an argmax/argmin's (value, index) pair."""
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    chunk = -(-red // chunks)
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    strided = not reads_rows_contiguously(space)
    lines = [f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_{name}({pointer_params(step, ctype)}, "
             "float* __restrict__ work) {",
             f"  typedef {index_type(step)} INDEX;"]
    if strided:
        tile = strided_tile(rows)
        lines += [f"  const int tx = threadIdx.x % {tile}, lane = threadIdx.x / {tile};",
                  f"  constexpr int TPR = {BLOCK // tile};",
                  f"  const INDEX row = (INDEX)blockIdx.y * {tile} + tx;",
                  f"  const bool active = row < (INDEX){rows};",
                  "  const INDEX row_k = active ? row : 0;"]
        lines += decompose(space, "k", "row_k", "row_", tensors, "  ")
    else:
        lines += [f"  constexpr int TPR = {BLOCK};",
                  "  const int lane = threadIdx.x;",
                  "  const INDEX row = blockIdx.y;"]
        lines += decompose(space, "k", "row", "row_", tensors, "  ")
    lines += value_lambda(step, space, "r", "row_")
    lines += [f"  const INDEX begin = (INDEX)blockIdx.x * {chunk};",
              f"  const INDEX end = begin + {chunk} < (INDEX){red} ? begin + {chunk} : (INDEX){red};"]
    kind = step.spec.kind  # type: ignore[attr-defined]
    if kind in INDEX_KINDS:
        return lines + arg_split_partial(kind, rows, chunks, strided, strided_tile(rows), UNROLL)
    if reduce is None:
        return lines + _welford_partial(strided, rows, chunks)
    op, identity = reduce
    lines.append(f"  float s = {identity};")
    if strided:
        lines += [f"  if (active) for (INDEX r = begin + lane; r < end; r += TPR) s = {op}()(s, value(r));",
                  f"  __shared__ float part[TPR][{tile + 1}];",
                  "  part[lane][tx] = s;",
                  "  __syncthreads();",
                  "  if (lane != 0 || !active) return;",
                  f"  for (int j = 1; j < TPR; ++j) s = {op}()(s, part[j][tx]);  // in a fixed order"]
    else:
        lines += [f"#pragma unroll {UNROLL}",
                  f"  for (INDEX r = begin + lane; r < end; r += TPR) s = {op}()(s, value(r));",
                  f"  s = kf_row_reduce<TPR>(s, {op}());",
                  "  if (lane != 0) return;"]
    return lines + [f"  work[row * {chunks} + blockIdx.x] = s;", "}", ""]


def _welford_partial(strided: bool, rows: int, chunks: int) -> list[str]:
    """The Welford body of a norm's partial kernel: (n, mean, m2) over the chunk, merged across the block in a
    fixed order; the mean and m2 stored (n is the chunk's length, known to the combine kernel)."""
    lines = ["  float n = 0.0f, mean = 0.0f, m2 = 0.0f;"]
    if strided:
        tile = strided_tile(rows)
        lines += [*_welford_loop("if (active) "),
                  f"  __shared__ float part[3][TPR][{tile + 1}];",
                  "  part[0][lane][tx] = n; part[1][lane][tx] = mean; part[2][lane][tx] = m2;",
                  "  __syncthreads();",
                  "  if (lane != 0 || !active) return;",
                  "  for (int j = 1; j < TPR; ++j) kf_welford_merge(n, mean, m2, part[0][j][tx], part[1][j][tx], "
                  "part[2][j][tx]);  // in a fixed order"]
    else:
        lines += [*_welford_loop(),
                  "  kf_row_reduce_welford<TPR>(n, mean, m2);",
                  "  if (lane != 0) return;"]
    return lines + [f"  work[row * {chunks} + blockIdx.x] = mean;",
                    f"  work[{rows * chunks} + row * {chunks} + blockIdx.x] = m2;", "}", ""]


def _welford_loop(guard: str = "") -> list[str]:
    """A thread's pass over its elements of the chunk, four at a time (kf_welford_add4: four independent loads in
    flight, one division), the last ones one by one; `guard` prefixes both loops."""
    four = "kf_welford_add4(n, mean, m2, value(r), value(r + TPR), value(r + 2 * TPR), value(r + 3 * TPR));"
    return ["  INDEX r = begin + lane;",
            f"  {guard}for (; r + 3 * TPR < end; r += 4 * TPR) {four}",
            f"  {guard}for (; r < end; r += TPR) kf_welford_add(n, mean, m2, value(r));"]


def _combine_head(step: GenStep, ctype: str, name: str, const: bool) -> list[str]:
    """The opening of a combine kernel `{k}_{name}`: a warp (TPR lanes) per `row`, rows past the last return."""
    rows = space_of(step).count("k")
    return [f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_{name}({pointer_params(step, ctype)}, "
            f"{'const ' if const else ''}float* __restrict__ work) {{",
            f"  typedef {index_type(step)} INDEX;",
            "  constexpr int TPR = 32;",
            "  const int lane = threadIdx.x % TPR;",
            f"  const INDEX row = (INDEX)blockIdx.x * {BLOCK // 32} + threadIdx.x / TPR;",
            f"  if (row >= {rows}) return;"]


def _split_combine_welford(step: GenStep, ctype: str, chunks: int, finish: list[str]) -> list[str]:
    """Kernel `{k}_combine` of a split norm: a warp per row merges the row's chunk moments (Chan's formula, each
    chunk weighted by its length) in a fixed order into `n`, `mean`, `m2`, then `finish`."""
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    chunk = -(-red // chunks)
    return [f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_combine({pointer_params(step, ctype)}, "
            "float* __restrict__ work) {",
            f"  typedef {index_type(step)} INDEX;",
            "  const int lane = threadIdx.x % 32;",
            f"  const INDEX row = (INDEX)blockIdx.x * {BLOCK // 32} + threadIdx.x / 32;",
            f"  if (row >= {rows}) return;",
            "  float n = 0.0f, mean = 0.0f, m2 = 0.0f;",
            f"  for (int c = lane; c < {chunks}; c += 32) {{",
            f"    const INDEX left = (INDEX){red} - (INDEX)c * {chunk};",
            f"    const float count = (float)(left < {chunk} ? (left > 0 ? left : 0) : {chunk});",
            f"    kf_welford_merge(n, mean, m2, count, work[row * {chunks} + c], "
            f"work[{rows * chunks} + row * {chunks} + c]);",
            "  }",
            "  kf_row_reduce_welford<32>(n, mean, m2);",
            *finish, "}", ""]


def _split_combine(step: GenStep, ctype: str, chunks: int, name: str, op: str, identity: str, finish: list[str],
                   const: bool = False) -> list[str]:
    """Kernel `{k}_{name}`: a warp per row combines the row's partials in a fixed order into `s`, then `finish`."""
    return [*_combine_head(step, ctype, name, const),
            f"  float s = {identity};",
            f"  for (int c = lane; c < {chunks}; c += TPR) s = {op}()(s, work[row * {chunks} + c]);",
            f"  s = kf_row_reduce<TPR>(s, {op}());",
            *finish, "}", ""]


def _launch(k: str, pass_: tuple[str, ...], args: str, out_t: str) -> str:
    """One pass's launch: (name, grid, work's type), and where it has a 16-byte kernel (`{name}4`) the condition
    on its pointers' alignment and that kernel's grid."""
    name, grid, work = pass_[:3]
    call = f"({args}, ({out_t}*)out, ({work})work);"
    if len(pass_) == 3:
        return f"  {k}_{name}<<<{grid}, {BLOCK}, 0, stream>>>{call}"
    aligned, grid4 = pass_[3:]
    return (f"  if ({aligned})\n    {k}_{name}4<<<{grid4}, {BLOCK}, 0, stream>>>{call}\n"
            f"  else\n    {k}_{name}<<<{grid}, {BLOCK}, 0, stream>>>{call}")
