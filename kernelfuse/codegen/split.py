"""Split reductions and split norms: a few long rows cut into chunks that separate blocks reduce, then combined in
a fixed order (deterministic: no float atomics). Contiguous rows take a block per (chunk, row); strided rows (a
channels-last source reduced over space) a block per (chunk, tile of neighbouring rows), a warp across the tile.
A norm splits its statistics that way in one Welford pass (each chunk's mean and squared deviations, merged by
Chan's formula) and normalises every element in a pass of its own; its numerics are the row kernels'
(kernelfuse.codegen.reduce).
"""

from __future__ import annotations

from collections.abc import Callable

from kernelfuse.codegen.arg_reduce import INDEX_KINDS, arg_split_combine, arg_split_partial, arg_workspace
from kernelfuse.codegen.iteration import (
    BLOCK,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    launch_params,
    out_ctype,
    pointer_params,
    shape_numel,
    space_of,
    value_lambda,
)
from kernelfuse.codegen.reduce import (
    REDUCE_OPS,
    normalised,
    reads_rows_contiguously,
    reduced_store,
    rstd,
    running_lines,
)
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep

# norm: the statistics split, then one pass over every element; argmax/argmin: (value, index) partials
SPLIT_KINDS = frozenset({*REDUCE_OPS, *INDEX_KINDS, "norm"})
SPLIT_MAX_ROWS = 264  # two rows per SM of an H100: fewer rows than this leave multiprocessors idle
SPLIT_MIN_ROW = 65536
SPLIT_TARGET_BLOCKS = 1024
SPLIT_MIN_CHUNK = 4096
STRIDED_SPLIT_MAX_ROWS = 32768  # from here one thread per strided row keeps the GPU busy
STRIDED_TILE = 32  # neighbouring rows a split-strided block reads side by side (fewer rows: a power of two above)
STRIDED_MIN_CHUNK = 256  # elements of a row per split-strided block: 32 per warp
# iterations of a thread's loop over a contiguous chunk issued together: one 4-byte load in flight per thread
# (2048 per SM, 8 KB) is too few to cover memory latency on an H100; the results are bitwise the same
UNROLL = 4
# The normalise pass walks a column's rows in one thread (the row's weight and bias read once for all of them, not
# once a row: a 16 x 4194304 LayerNorm read 16 x 32 MB of affine parameters) for at most this many rows.
ROWS_INNER_MAX = 64
# ... and only where a thread per column still fills an H100 (132 SMs x 2048 threads): fewer columns would leave
# too few loads in flight for the memory system (not measured: the bound is set so as not to need it).
ROWS_INNER_MIN_COLS = 1 << 18


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
    norm = spec.kind == "norm"  # type: ignore[attr-defined]
    tile = strided_tile(rows)
    tiles = f", tiles of {tile} rows" if strided else ""
    then = "a combine kernel"
    if norm:
        then = "a Welford combine kernel, then a normalise kernel " + ("in the output's order" if _transposed_dim(space) is None
                                                             else "in 32 x 32 tiles transposed through shared memory")
    lines = [f"// strategy: split{' norm' if norm else ''}{' strided' if strided else ''}, {rows} rows of {red} in "
             f"{chunks} chunks of {-(-red // chunks)}{tiles}, then {then}"]
    scale = float_literal(1.0 / red)
    k = step.kernel
    combine_grid = f"kf_blocks({rows}LL * 32, {BLOCK})"
    partial_grid = f"dim3({chunks}, {-(-rows // tile) if strided else rows})"
    if norm:
        stats = 2 * rows * chunks  # work: the partial means, the partial squared deviations, each row's mean, 1/std
        moments = [f"  const float var = m2 * {scale}, rstd = {rstd(step)};",
                   f"  if (lane == 0) {{ work[{stats} + row] = mean; work[{stats + rows} + row] = rstd; }}",
                   *running_lines(step, red, ctype, "  ")]
        lines += _split_partial(step, ctype, chunks, "moments", None)
        lines += _split_combine_welford(step, ctype, chunks, moments)
        lines += _split_normalise(step, ctype, space, stats)
        ds = _transposed_dim(space)
        elements = shape_numel(space.sizes) if ds is None else _tiles(space, ds) * BLOCK  # a tile per block
        if ds is None and _rows_inner(space):
            elements = space.count("r")  # a thread per column
        passes = [("moments", partial_grid, "float*"), ("combine", combine_grid, "float*"),
                  ("normalise", f"kf_blocks({elements}LL, {BLOCK})", "const float*")]
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
    launches = "\n".join(f"  {k}_{name}<<<{grid}, {BLOCK}, 0, stream>>>({args}, ({out_ctype(step)}*)out, "
                         f"({work})work);"
                         for name, grid, work in passes)
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


def _split_normalise(step: GenStep, ctype: str, space: Space, stats: int) -> list[str]:
    """Kernel `{k}_normalise`: every element normalised with its row's mean and 1/std from `work`, then the
    epilogue. Where the source's unit-stride dim is the output's (NCHW) a flat loop in that order; else (a
    channels-last source) 32 x 32 tiles through shared memory, read along the source's unit-stride dim and written
    along the output's, so both sides coalesce. The pseudo-tensor `row` maps an element to its row."""
    row_strides, acc = [0] * len(space.sizes), 1
    for d in reversed(space.dims("k")):
        row_strides[d], acc = acc, acc * space.sizes[d]
    strides = {**space.strides, "row": tuple(row_strides)}
    ds = _transposed_dim(space)
    head = [f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_normalise({pointer_params(step, ctype)}, "
            "const float* __restrict__ work) {",
            f"  typedef {index_type(step)} INDEX;"]
    if ds is None:
        flat = Space(space.sizes, ("t",) * len(space.sizes), strides)
        lines = [*head, "  {", *value_lambda(step, flat, "t", None)]
        cols, rows = space.count("r"), space.count("k")
        if _rows_inner(space):  # r = row * cols + c: a warp's columns coalesce in every row
            lines += [f"    for (INDEX c = (INDEX)blockIdx.x * blockDim.x + threadIdx.x; c < (INDEX){cols}; "
                      "c += (INDEX)gridDim.x * blockDim.x) {", f"#pragma unroll {UNROLL}",
                      f"    for (INDEX rw = 0; rw < (INDEX){rows}; ++rw) {{", f"      const INDEX r = rw * {cols} + c;"]
            close = ["    }", "    }"]
        else:
            lines += [f"#pragma unroll {UNROLL}",
                      f"    for (INDEX r = (INDEX)blockIdx.x * blockDim.x + threadIdx.x; r < (INDEX){shape_numel(space.sizes)}; "
                      "r += (INDEX)gridDim.x * blockDim.x) {"]
            close = ["    }"]
        lines += _normalise_element(step, flat, stats, rows, lambda n: f"a_{n}")
        lines += epilogue_lines(step, "r", "      ")
        return lines + [f"      out[r] = kf_store<{out_ctype(step)}>(e_result);", *close, "  }", "}", ""]
    return head + _transposed_normalise(step, ctype, space, strides, ds, stats)


def _rows_inner(space: Space) -> bool:
    """Does the flat normalise pass take a column's rows in one thread: few rows, the kept dims outermost (so
    element r is row * cols + c), columns enough to fill the GPU?"""
    rows, cols = space.count("k"), space.count("r")
    return 1 < rows <= ROWS_INNER_MAX and cols >= ROWS_INNER_MIN_COLS and space.classes == tuple(sorted(space.classes))


def _transposed_dim(space: Space) -> int | None:
    """The source's unit-stride dim where it is not the output's (the last): the normalise pass then transposes
    through shared memory; None where one flat order coalesces both."""
    unit = [d for d in range(len(space.sizes)) if space.strides["src"][d] == 1]
    return unit[-1] if unit and unit[-1] != len(space.sizes) - 1 else None


def _tiles(space: Space, ds: int) -> int:
    """32 x 32 tiles of the transposing normalise pass: over dims `ds` and the last, times every other index."""
    n_ds, n_do = space.sizes[ds], space.sizes[-1]
    return shape_numel(space.sizes) // (n_ds * n_do) * -(-n_ds // 32) * -(-n_do // 32)


def _transposed_normalise(step: GenStep, ctype: str, space: Space, strides: dict[str, tuple[int, ...]], ds: int,
                          stats: int) -> list[str]:
    """The tiled body of `{k}_normalise`: dims `ds` (the source's unit stride) and the last (the output's) are the
    tile's; a block loops over (other dims, tile rows, tile columns)."""
    do = len(space.sizes) - 1
    n_ds, n_do = space.sizes[ds], space.sizes[do]
    tiles_ds, tiles_do = -(-n_ds // 32), -(-n_do // 32)
    tiled = Space(space.sizes, tuple("t" if d in (ds, do) else "k" for d in range(len(space.sizes))), strides)
    tiles = _tiles(space, ds)
    flat_r = ("i_ds * {n} + i_do" if ds < do else "i_do * {n} + i_ds").format(n=n_do if ds < do else n_ds)
    operands = [f"in{i}" for i in range(len(step.prologue.operands))]
    affine = [n for n in ("weight", "bias") if n in space.strides]
    lines = ["  __shared__ float tile[32][33];",
             f"  for (INDEX t = blockIdx.x; t < (INDEX){tiles}; t += gridDim.x) {{",
             f"    const INDEX t_do = t % {tiles_do}, t_ds = t / {tiles_do} % {tiles_ds}, b = t / {tiles_do * tiles_ds};"]
    lines += decompose(tiled, "k", "b", "b_", ["src", *operands, "out", "row", *affine], "    ")
    lines += value_lambda(step, tiled, "t", "b_")
    lines += ["    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;",
              "#pragma unroll  // a constant trip count: the rows' loads and math interleave",
              f"    for (int jj = 0; jj < {32 // (BLOCK // 32)}; ++jj) {{  // read along the source's unit-stride dim",
              f"      const int j = ty + jj * {BLOCK // 32};",
              "      const INDEX i_ds = t_ds * 32 + tx, i_do = t_do * 32 + j;",
              f"      if (i_ds >= {n_ds} || i_do >= {n_do}) continue;",
              f"      const INDEX r = {flat_r};"]
    lines += _normalise_element(step, tiled, stats, space.count("k"), lambda n: f"b_{n} + a_{n}")
    lines += ["      tile[j][tx] = y;", "    }", "    __syncthreads();",
              "#pragma unroll",
              f"    for (int jj = 0; jj < {32 // (BLOCK // 32)}; ++jj) {{  // write along the output's",
              f"      const int j = ty + jj * {BLOCK // 32};",
              "      const INDEX i_ds = t_ds * 32 + j, i_do = t_do * 32 + tx;",
              f"      if (i_ds >= {n_ds} || i_do >= {n_do}) continue;",
              f"      const INDEX r = {flat_r};"]
    lines += decompose(tiled, "t", "r", "w_", ["out"], "      ")
    lines += ["      const INDEX i = b_out + w_out;", "      const float y = tile[tx][j];"]
    lines += epilogue_lines(step, "i", "      ")
    return lines + [f"      out[i] = kf_store<{out_ctype(step)}>(e_result);", "    }", "    __syncthreads();", "  }", "}",
                    ""]


def _normalise_element(step: GenStep, space: Space, stats: int, rows: int, offset: Callable[[str], str]) -> list[str]:
    """`y`: element r normalised by its row's statistics (mean at work[stats + row], 1/std `rows` further), its
    row and affine offsets over the `t` dims as `a_*` (`offset(name)` adds the rest)."""
    affine = [n for n in ("weight", "bias") if n in space.strides]
    row = offset("row")
    return decompose(space, "t", "r", "a_", ["row", *affine], "      ") + [
        f"      const float mean = work[{stats} + {row}], rstd = work[{stats + rows} + {row}];",
        f"      const float y = {normalised(step, offset)};"]
