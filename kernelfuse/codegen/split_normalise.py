"""The normalise pass of a split norm (kernelfuse.codegen.split): every element normalised with its row's mean and
1/std from the workspace, then the epilogue. A flat loop in the output's order where the source's unit-stride dim
is the output's (its 16-byte form where every operand packs), a column's rows in one thread where there are few
long rows, else 32 x 32 tiles through shared memory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelfuse.codegen.iteration import (
    BLOCK,
    UNROLL,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    out_ctype,
    pointer_params,
    shape_numel,
    space_of,
    tensor_dtype,
    value_dtype,
    value_lambda,
)
from kernelfuse.codegen.reduce import normalised
from kernelfuse.plan.ir import GenStep

# The normalise pass walks a column's rows in one thread (the row's weight and bias read once for all of them, not
# once a row: a 16 x 4194304 LayerNorm read 16 x 32 MB of affine parameters) for at most this many rows.
ROWS_INNER_MAX = 64
# ... and only where a thread per column still fills an H100 (132 SMs x 2048 threads): fewer columns would leave
# too few loads in flight for the memory system (not measured: the bound is set so as not to need it).
ROWS_INNER_MIN_COLS = 1 << 18


def normalise_strategy(space: Space) -> str:
    """The pass's strategy, for the kernel's `// strategy:` line."""
    if _transposed_dim(space) is not None:
        return "a normalise kernel in 32 x 32 tiles transposed through shared memory"
    return "a normalise kernel in the output's order"


def normalise_kernels(step: GenStep, ctype: str, space: Space, stats: int) -> list[str]:
    """Kernel `{k}_normalise`, and `{k}_normalise4` where the pass packs (`normalise_packs`)."""
    lines = _split_normalise(step, ctype, space, stats)
    packs = normalise_packs(step, space, stats)
    return lines + (_packed_normalise(step, ctype, space, stats, packs) if packs else [])


def normalise_pass(step: GenStep, space: Space, stats: int) -> tuple[str, ...]:
    """The pass's launch for kernelfuse.codegen.split: (name, grid, work's type), and where it packs the alignment
    condition on its pointers and the 16-byte kernel's grid."""
    ds = _transposed_dim(space)
    elements = shape_numel(space.sizes) if ds is None else _tiles(space, ds) * BLOCK  # a tile per block
    if ds is None and _rows_inner(space):
        elements = space.count("r")  # a thread per column
    scalar = ("normalise", f"kf_blocks({elements}LL, {BLOCK})", "const float*")
    packs = normalise_packs(step, space, stats)
    if not packs:
        return scalar
    aligned = " && ".join(f"((uintptr_t){n} % 16 == 0)" for n in ("out", *packs) if n != "row")
    return (*scalar, aligned, f"kf_blocks({elements // 4}LL, {BLOCK})")


def normalise_packs(step: GenStep, space: Space, stats: int) -> dict[str, str]:
    """The tensors the normalise pass reads 4 elements at a time where it can ("run": 4 consecutive, "same": one
    value for the 4; `row` the statistics in `work`; `ep{i}` the epilogue's operands, a residual say), or none:
    fp32 only, the flat pass in the output's order, no prologue operand, the source a run (channels-last over a
    channels-last output, or an NCHW plane), the innermost dim a multiple of 4."""
    if _transposed_dim(space) is not None or _rows_inner(space) or step.prologue.operands \
            or step.mapped is not None or space.sizes[-1] % 4:
        return {}
    if {value_dtype(step), tensor_dtype(step, "src"), step.out_meta.dtype} != {torch.float32}:
        return {}
    operands = _epilogue_strides(step, space)
    if operands is None:
        return {}
    names = ["src", "row", *(n for n in ("weight", "bias") if n in space.strides), *operands]
    if any(n != "src" and tensor_dtype(step, n) != torch.float32 for n in names if n != "row"):
        return {}
    packs = {}
    row_strides = _row_strides(space)
    for name in names:
        strides = row_strides if name == "row" else operands.get(name) or space.strides[name]
        if strides[-1] == 0 and name != "src":
            packs[name] = "same"
        elif strides[-1] == 1 and all(t % 4 == 0 for t in strides[:-1]):
            packs[name] = "run"
        else:
            return {}
    if packs.get("row") == "run" and (stats % 4 or space.count("k") % 4):
        return {}
    return packs


def _epilogue_strides(step: GenStep, space: Space) -> dict[str, tuple[int, ...]] | None:
    """The epilogue operands' strides over `space` (`ep{i}`), or None where they do not follow its merged dims."""
    if not step.epilogue.operands:
        return {}
    with_operands = space_of(step, epilogue=True)
    if with_operands.sizes != space.sizes or with_operands.classes != space.classes:
        return None
    names = [f"ep{i}" for i in range(len(step.epilogue.operands))]
    if any(n not in with_operands.strides for n in names):
        return None
    return {n: with_operands.strides[n] for n in names}


def _row_strides(space: Space) -> tuple[int, ...]:
    """The pseudo-tensor `row`: an element's row, from its kept dims (the innermost fastest)."""
    row_strides, acc = [0] * len(space.sizes), 1
    for d in reversed(space.dims("k")):
        row_strides[d], acc = acc, acc * space.sizes[d]
    return tuple(row_strides)


def _packed_normalise(step: GenStep, ctype: str, space: Space, stats: int, packs: dict[str, str]) -> list[str]:
    """Kernel `{k}_normalise4`: the flat normalise pass 4 elements at a time, 16-byte loads and stores (the scalar
    pass issues six memory instructions an element: 2.2 TB/s on an H200 for a channels-last batch norm)."""
    rows = space.count("k")
    operands = _epilogue_strides(step, space) or {}
    flat = Space(space.sizes, ("t",) * len(space.sizes), {**space.strides, **operands, "row": _row_strides(space)})
    numel = shape_numel(space.sizes)
    base = {"src": "src", "row": f"work + {stats}", "weight": "weight", "bias": "bias"}

    def pack(name: str, into: str, ptr: str) -> str:
        if packs[name] == "same":
            return f"      const float {into} = kf_load(({ptr})[a_{name}]);"
        return f"      const kf_pack<float, 4> {into} = kf_pack_load<float, 4>({ptr} + a_{name});"

    def at(into: str, name: str) -> str:
        return f"{into}.v[j]" if packs[name] == "run" else into

    lines = [f"__global__ void __launch_bounds__({BLOCK}) {step.kernel}_normalise4({pointer_params(step, ctype)}, "
             "const float* __restrict__ work) {", f"  typedef {index_type(step)} INDEX;", "  {",
             *value_lambda(step, flat, "t", None),
             f"    for (INDEX v = (INDEX)blockIdx.x * blockDim.x + threadIdx.x; v < (INDEX){numel // 4}; "
             "v += (INDEX)gridDim.x * blockDim.x) {",
             "      const INDEX r0 = v * 4;",
             *decompose(flat, "t", "r0", "a_", list(packs), "      "),
             pack("src", "x", "src"), pack("row", "means", base["row"]),
             pack("row", "rstds", f"{base['row']} + {rows}")]
    lines += [pack(n, f"k_{n}", n) for n in ("weight", "bias") if n in packs]
    lines += [pack(n, f"k_{n}", f"e_in{n[2:]}_p") for n in operands]
    given = {f"in{n[2:]}": at(f"k_{n}", n) for n in operands}
    expr = normalised(step, lambda n: "", f"value_at(r, {at('x', 'src')})", lambda n: at(f"k_{n}", n))
    lines += ["      kf_pack<float, 4> q;", "#pragma unroll", "      for (int j = 0; j < 4; ++j) {",
              "        const INDEX r = r0 + j;",
              f"        const float mean = {at('means', 'row')}, rstd = {at('rstds', 'row')};",
              f"        const float y = {expr};",
              *epilogue_lines(step, "r", "        ", given),
              "        q.v[j] = kf_store<float>(e_result);", "      }",
              "      reinterpret_cast<kf_pack<float, 4>*>(out)[v] = q;", "    }", "  }", "}", ""]
    return lines


def _split_normalise(step: GenStep, ctype: str, space: Space, stats: int) -> list[str]:
    """Kernel `{k}_normalise`: every element normalised with its row's mean and 1/std from `work`, then the
    epilogue. Where the source's unit-stride dim is the output's (NCHW) a flat loop in that order; else (a
    channels-last source) 32 x 32 tiles through shared memory, read along the source's unit-stride dim and written
    along the output's, so both sides coalesce. The pseudo-tensor `row` maps an element to its row."""
    strides = {**space.strides, "row": _row_strides(space)}
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
    tile's; a block loops over (other dims, tile rows, tile columns). Where the statistics and affine operands
    (a batch norm's: per channel) follow one tile dim only, a thread loads them once a tile, in the phase whose
    lanes run along that dim: while reading (a channels-last source's channels) or while writing (a channels-last
    output's); else once an element."""
    do = len(space.sizes) - 1
    n_ds, n_do = space.sizes[ds], space.sizes[do]
    tiles_ds, tiles_do = -(-n_ds // 32), -(-n_do // 32)
    tiled = Space(space.sizes, tuple("t" if d in (ds, do) else "k" for d in range(len(space.sizes))), strides)
    tiles = _tiles(space, ds)
    flat = ("{ds} * {n} + {do}" if ds < do else "{do} * {n} + {ds}").replace("{n}", str(n_do if ds < do else n_ds))
    operands = [f"in{i}" for i in range(len(step.prologue.operands))]
    affine = [n for n in ("weight", "bias") if n in space.strides]
    along = {d: any(strides[n][d] for n in ("row", *affine)) for d in (ds, do)}
    phase = "read" if not along[do] else "write" if not along[ds] else None  # where the statistics are hoisted
    rows = space.count("k")

    def hoisted(i_ds: str, i_do: str) -> list[str]:
        """The statistics (and affine values) of the thread's lane, loaded once: `mean`, `rstd`, `k_weight`..."""
        lines = [f"    float mean = 0.0f, rstd = 0.0f{''.join(f', k_{n} = 0.0f' for n in affine)};",
                 f"    if ({i_ds} < {n_ds} && {i_do} < {n_do}) {{",
                 f"      const INDEX r = {flat.format(ds=i_ds, do=i_do)};"]
        lines += decompose(tiled, "t", "r", "a_", ["row", *affine], "      ")
        lines += [f"      mean = work[{stats} + b_row + a_row]; rstd = work[{stats + rows} + b_row + a_row];"]
        lines += [f"      k_{n} = kf_load({n}[b_{n} + a_{n}]);" for n in affine]
        return lines + ["    }"]

    def normalise(value: str) -> str:
        return f"      const float y = {normalised(step, lambda n: '', value, lambda n: f'k_{n}')};"

    lines = ["  __shared__ float tile[32][33];",
             f"  for (INDEX t = blockIdx.x; t < (INDEX){tiles}; t += gridDim.x) {{",
             f"    const INDEX t_do = t % {tiles_do}, t_ds = t / {tiles_do} % {tiles_ds}, b = t / {tiles_do * tiles_ds};"]
    lines += decompose(tiled, "k", "b", "b_", ["src", *operands, "out", "row", *affine], "    ")
    lines += value_lambda(step, tiled, "t", "b_")
    lines += ["    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;"]
    if phase == "read":
        lines += hoisted("(t_ds * 32 + tx)", "t_do * 32")
    lines += ["#pragma unroll  // a constant trip count: the rows' loads and math interleave",
              f"    for (int jj = 0; jj < {32 // (BLOCK // 32)}; ++jj) {{  // read along the source's unit-stride dim",
              f"      const int j = ty + jj * {BLOCK // 32};",
              "      const INDEX i_ds = t_ds * 32 + tx, i_do = t_do * 32 + j;",
              f"      if (i_ds >= {n_ds} || i_do >= {n_do}) continue;",
              f"      const INDEX r = {flat.format(ds='i_ds', do='i_do')};"]
    if phase == "read":
        lines.append(normalise("value(r)"))
    elif phase == "write":
        lines.append("      const float y = value(r);")
    else:
        lines += _normalise_element(step, tiled, stats, rows, lambda n: f"b_{n} + a_{n}")
    lines += ["      tile[j][tx] = y;", "    }", "    __syncthreads();"]
    if phase == "write":
        lines += hoisted("t_ds * 32", "(t_do * 32 + tx)")
    lines += ["#pragma unroll",
              f"    for (int jj = 0; jj < {32 // (BLOCK // 32)}; ++jj) {{  // write along the output's",
              f"      const int j = ty + jj * {BLOCK // 32};",
              "      const INDEX i_ds = t_ds * 32 + j, i_do = t_do * 32 + tx;",
              f"      if (i_ds >= {n_ds} || i_do >= {n_do}) continue;",
              f"      const INDEX r = {flat.format(ds='i_ds', do='i_do')};"]
    lines += decompose(tiled, "t", "r", "w_", ["out"], "      ")
    lines += ["      const INDEX i = b_out + w_out;"]
    lines.append(normalise("tile[tx][j]") if phase == "write" else "      const float y = tile[tx][j];")
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
