"""Row reductions and reduce-then-broadcast kernels (reductions, softmax, norms) for generated kernels.

Two row strategies, chosen from the merged space:
- `inner` (the source's innermost dim is reduced): a warp (short rows) or a whole block (long rows) per row; threads stride
  along the row, so loads are coalesced; partial results combine through warp shuffles and shared memory;
- `strided` (the source's innermost dim is kept, or rows are very short): one thread per row; neighbouring threads own
  neighbouring rows, so loads are coalesced across the warp;
and `split` for a few long rows (kernelfuse.codegen.split, which shares this module's numerics). A contiguous row
too long for a block's registers is shared by several blocks that keep it on chip (kernelfuse.codegen.onchip).
The CUDA helpers these kernels call are in kernelfuse.codegen.reduce_prelude.

Kinds (kernelfuse.ops.reductions): one pass for sum/mean/prod/amax/amin (and argmax/argmin, whose (value, index)
pairs are kernelfuse.codegen.arg_reduce's); logsumexp and softmax find the max and the sum of exp(x - max) in one
pass (a larger max rescales the sum: one read of the row fewer than ATen's max pass then sum pass, ~1e-7 relative
apart); norms take the mean and the biased variance in one Welford pass (as ATen's CUDA norms do; as accurate as
two passes, unlike one-pass sums of squares). A row kept in registers, or a chunk kept on chip, instead takes two
passes per thread over what it keeps, cheaper in instructions (`two_passes`). Passes re-read the row and recompute
the prologue instead of storing it. Numerics follow ATen: float accumulation, NaN-propagating max/min,
logsumexp's infinite max replaced by 0, softmax as exp(x - max) / sum, batch norm's running statistics with the
unbiased variance.
"""

from __future__ import annotations

from collections.abc import Callable

from kernelfuse.codegen.arg_reduce import INDEX_KINDS, arg_row_lines
from kernelfuse.codegen.iteration import (
    BLOCK,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    launcher,
    out_ctype,
    pointer_params,
    space_of,
    value_at_lambda,
    value_lambda,
)
from kernelfuse.codegen.onchip import (
    ONCHIP_THREADS,
    blocks_per_sm,
    chunk_group,
    chunk_of,
    combine_across_blocks,
    copies_vectors,
    onchip_launcher,
    onchip_workspace,
    row_blocks,
    source_pointer_lambda,
)
from kernelfuse.codegen.row_passes import (
    group_prologue,
    group_prologue_operands,
    reads_rows_contiguously,
    row_pass,
    two_passes,
    welford_in_fours,
)
from kernelfuse.codegen.row_writes import broadcast_store, mapped_store
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep

CACHE_MAX = 32  # elements a thread keeps in registers across a broadcasting row kernel's passes (a warp: 1024)
CACHE_MAX_THREAD_ROW = 64  # the same for a reduce-then-broadcast kernel whose thread owns its row (not measured)

REDUCE_OPS = {"sum": ("kf_sum_op", "0.0f"), "mean": ("kf_sum_op", "0.0f"), "prod": ("kf_prod_op", "1.0f"),
              "amax": ("kf_max_op", "(-INFINITY)"), "amin": ("kf_min_op", "INFINITY")}


def row_strategy(step: GenStep) -> tuple[bool, int, int, int]:
    """(rows contiguous?, threads per row, elements a thread may cache in registers, blocks per row that keep it
    on chip or 0)."""
    space = space_of(step)
    red = space.count("r")
    inner = reads_rows_contiguously(space)
    tpr = 1 if not inner or red < 32 else row_threads(red, space.count("k")) if red <= 1024 else BLOCK
    limit = CACHE_MAX_THREAD_ROW if step.mapped is not None and tpr == 1 else CACHE_MAX
    return inner, tpr, limit, row_blocks(step, red, inner, -(-red // tpr), limit)


def row_threads(red: int, rows: int) -> int:
    """Threads of a warp a contiguous row of `red` (32..1024) elements takes: about 8 elements each, a power of two
    up to 32. A warp a row of 64 (LayerNorm over 64 columns, level-2 34) left 2 elements a thread and 5 levels of
    Welford merges across the warp for them: 1.31 ms against torch.compile's 0.57 for the same pass (H200).
    Fewer than 32 only where `rows` fills whole warps: a warp's rows are then all inside or all past the end, and
    its lanes reach the shuffles together (a lane that left the loop early would leave them undefined)."""
    tpr = 4
    while tpr < 32 and tpr * 16 <= red:
        tpr *= 2
    return tpr if rows % (32 // tpr) == 0 else 32


def row_kernel(step: GenStep, ctype: str) -> str:
    k = step.kernel
    space = space_of(step)
    rows, red = space.count("k"), space.count("r")
    inner, tpr, limit, blocks = row_strategy(step)
    rows_per_block = BLOCK // tpr
    on_chip = (f" (sm_80+: {blocks} blocks per row, the row in their shared memory, statistics combined through "
               "global memory)") if blocks else ""
    lines = [f"// strategy: {'inner' if inner else 'strided'}, {tpr} thread(s) per row, {rows} rows of {red}{on_chip}",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             *_row_body(step, ctype, space, tpr, f"(INDEX)blockIdx.x * {rows_per_block} + threadIdx.x / TPR",
                        f"(INDEX)gridDim.x * {rows_per_block}", limit, 0),
             "}", ""]
    grid = f"kf_blocks({rows}LL * {tpr}, {BLOCK})"
    if not blocks:
        return "\n".join(lines) + launcher(step, ctype, grid)
    lines += [f"__global__ void __launch_bounds__({ONCHIP_THREADS}, {blocks_per_sm(red, blocks)}) {k}_onchip_kernel("
              f"{pointer_params(step, ctype)}, float* kf_work) {{",
              "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800",
              *_row_body(step, ctype, space, ONCHIP_THREADS, "", "", limit, blocks),
              "#endif", "}", ""]
    return "\n".join(lines) + onchip_launcher(step, ctype, blocks, rows, red, grid, BLOCK)


def row_workspace(step: GenStep) -> int:
    """Floats of workspace a row kernel needs: the on-chip kernel's partials and counters; else 0."""
    blocks = row_strategy(step)[3]
    return onchip_workspace(space_of(step).count("k"), blocks) if blocks else 0


def _row_body(step: GenStep, ctype: str, space: Space, tpr: int, first_row: str, row_step: str, limit: int,
              blocks: int) -> list[str]:
    """A row kernel's body: `tpr` threads per row, rows from `first_row` by `row_step`; or, with `blocks` blocks
    per row, (row, chunk) work items taken from a counter, the chunk cached in shared memory and the statistics
    combined across the row's blocks."""
    rows, red = space.count("k"), space.count("r")
    kind = step.spec.kind  # type: ignore[attr-defined]
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    if step.spec.broadcast:  # type: ignore[attr-defined]
        tensors += ["out"] + [n for n in ("weight", "bias") if n in space.strides]
    elif step.mapped is not None:
        tensors += ["out"] + [f"m{i}" for i in range(len(step.mapped.operands))]
    lines = [f"  typedef {index_type(step)} INDEX;", f"  constexpr int TPR = {tpr};", "  const int lane = threadIdx.x % TPR;"]
    if blocks:
        lines += ["  extern __shared__ __align__(16) float kf_row_cache[];  // this block's chunk of the row, read from memory once",
                  f"  constexpr INDEX CHUNK = {chunk_of(red, blocks)};",
                  f"  constexpr bool KF_VECTOR_COPIES = {str(copies_vectors(space)).lower()};",
                  f"  constexpr bool KF_ROW_CONTIGUOUS = {str(len(space.dims('r')) == 1).lower()};",
                  f"  unsigned* const kf_claim = (unsigned*)(kf_work + {3 * rows * blocks});",
                  "  unsigned* const kf_arrived = kf_claim + 1;",
                  "  for (;;) {",
                  "    const unsigned kf_item = kf_grid_claim(kf_claim);",
                  f"    if (kf_item >= {rows * blocks}u) break;",
                  f"    const INDEX row = kf_item / {blocks}, kf_rank = kf_item % {blocks};"]
    else:
        lines.append(f"  for (INDEX row = {first_row}; row < (INDEX){rows}; row += {row_step}) {{")
    lines += decompose(space, "k", "row", "row_", tensors, "    ")
    lines += value_lambda(step, space, "r", "row_")
    if blocks:
        lines += source_pointer_lambda(space)
        if group_prologue_operands(step, space):
            lines += value_at_lambda(step, space, "r", "row_", tuple(group_prologue_operands(step, space)),
                                     "value_at_g")
    lines += _kind_lines(step, kind, red, ctype, space, tpr, limit, blocks)
    lines.append("  }")
    return lines


def _kind_lines(step: GenStep, kind: str, red: int, ctype: str, space: Space, tpr: int, limit: int,
                blocks: int) -> list[str]:
    lines = [f"    constexpr INDEX RED = {red};"]
    if kind in INDEX_KINDS:  # an int64 index, not a float (kernelfuse.codegen.arg_reduce)
        return lines + arg_row_lines(kind, red, tpr)
    mapped = step.mapped is not None
    if blocks:  # the block's chunk lives in shared memory; its statistic is combined across the row's blocks
        lines += [f"    constexpr int PER = {-(-chunk_of(red, blocks) // tpr)};",
                  f"    constexpr int PER4 = {-(-chunk_of(red, blocks) // (4 * tpr))};  // groups of 4 elements"]
        cached = True
    else:
        per = -(-red // tpr)
        cached = (step.spec.broadcast or mapped) and per <= limit  # type: ignore[attr-defined]
        if cached:  # the statistics pass keeps the row in registers: the write pass reads nothing again
            lines += [f"    constexpr int PER = {per};", "    float cache[PER];"]
    first, again = ("fill", "read") if cached else (None, None)
    oc = chunk_group(space) if blocks else 0  # elements an on-chip pass takes at once
    gp = group_prologue(step, space) if oc == 4 else None
    if kind in REDUCE_OPS:
        op, identity = REDUCE_OPS[kind]
        lines.append(f"    float s = {identity};")
        lines += row_pass([f"s = {op}()(s, v);"], first, raw=mapped, onchip=oc, grouped=gp)
        lines.append(f"    s = kf_row_reduce<TPR>(s, {op}());")
        if blocks:
            lines.append(f"    {combine_across_blocks(blocks, ('s',), op)}")
        if kind == "mean":
            lines.append(f"    s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
        if not mapped:
            return lines + reduced_store(step, "s", ctype)
        lines.append("    const float y = s;  // every thread of the row: the row's value after the epilogue")
        return lines + epilogue_lines(step, "row", "    ") + mapped_store(step, ctype, space, again, oc)
    if kind in ("logsumexp", "softmax", "log_softmax"):
        lines.append("    float m = -INFINITY, s = 0.0f;")
        lines += two_passes(kind, oc, gp) if cached else row_pass(["kf_online_add(m, s, v);"])
        lines.append("    kf_row_reduce_online<TPR>(m, s);")
        if blocks:
            lines.append(f"    {{ float unused = 0.0f; {combine_across_blocks(blocks, ('m', 's', 'unused'), 'kf_online_merge3')} }}")
        if kind == "logsumexp":  # ATen replaces an infinite max by 0: the sum is then inf (or 0), log gives m back
            lines.append("    const float lse = fabsf(m) == INFINITY ? m : logf(s) + m;")
            return lines + reduced_store(step, "lse", ctype)
        lines.append("    const float logs = logf(s);" if kind == "log_softmax" else "")
        expr = "v - m - logs" if kind == "log_softmax" else "expf(v - m) / s"
        return lines + broadcast_store(step, expr, ctype, [], space, again, oc)
    # norm: mean and biased variance in one Welford pass; affine; batch norm updates its running statistics;
    # moments: the same statistics, written as (mean, 1/std) per row
    lines.append("    float n = 0.0f, mean = 0.0f, m2 = 0.0f;")
    if cached:
        lines += two_passes(kind, oc, gp)
    else:
        lines += welford_in_fours()  # the row read from memory twice: the statistics pass, then the write pass
    lines.append("    kf_row_reduce_welford<TPR>(n, mean, m2);")
    if blocks:
        lines.append(f"    {combine_across_blocks(blocks, ('n', 'mean', 'm2'), 'kf_welford_merge3')}")
    lines.append(f"    const float var = m2 * {float_literal(1.0 / red)};")
    lines.append(f"    const float rstd = {rstd(step)};")
    lines += running_lines(step, red, ctype, "    ", "lane == 0 && kf_rank == 0" if blocks else "lane == 0")
    if kind == "moments":
        return lines + [f"    {moments_store(step)}"]
    affine = [n for n in ("weight", "bias") if n in space.strides]
    expr = normalised(step, lambda n: f"row_{n} + o_{n}").replace("value(r)", "v")
    return lines + broadcast_store(step, expr, ctype, affine, space, again, oc)


def moments_store(step: GenStep) -> str:
    """The statement a moments kernel ends a row with: its mean and 1/std, side by side (lane 0)."""
    t = out_ctype(step)
    return f"if (lane == 0) {{ out[2 * row] = kf_store<{t}>(mean); out[2 * row + 1] = kf_store<{t}>(rstd); }}"


def rstd(step: GenStep) -> str:
    return f"1.0f / sqrtf(var + {float_literal(step.spec.eps)})"  # type: ignore[attr-defined]


def running_lines(step: GenStep, red: int, ctype: str, ind: str, who: str = "lane == 0") -> list[str]:
    """Batch norm's running statistics from the row's `mean` and biased `var`, as ATen updates them (momentum,
    unbiased variance), written by the one thread `who` names; nothing for a norm without them."""
    spec = step.spec
    if spec.running is None:  # type: ignore[attr-defined]
        return []
    m = float_literal(spec.momentum)  # type: ignore[attr-defined]
    keep = float_literal(1.0 - spec.momentum)  # type: ignore[attr-defined]
    unbias = float_literal(red / max(red - 1, 1))
    return [f"{ind}if ({who}) {{  // running statistics, as ATen updates them (unbiased variance)",
            f"{ind}  run_mean[row] = kf_store<{ctype}>({m} * mean + {keep} * kf_load(run_mean[row]));",
            f"{ind}  run_var[row] = kf_store<{ctype}>({m} * (var * {unbias}) + {keep} * kf_load(run_var[row]));",
            f"{ind}}}"]


def normalised(step: GenStep, offset: Callable[[str], str], value: str = "value(r)",
               operand: Callable[[str], str] | None = None) -> str:
    """The normalised element `value` given its row's `mean` and `rstd`; `offset(name)`: the affine operand's
    (`operand(name)`: its whole expression instead, a value already loaded)."""
    spec = step.spec
    load = operand or (lambda n: f"kf_load({n}[{offset(n)}])")
    expr = f"({value} - mean) * rstd"
    if spec.weight is not None:  # type: ignore[attr-defined]
        expr = f"({expr}) * {load('weight')}"
    if spec.bias is not None:  # type: ignore[attr-defined]
        expr = f"{expr} + {load('bias')}"
    return expr


def reduced_store(step: GenStep, value: str, ctype: str) -> list[str]:
    lines = ["    if (lane == 0) {", f"      const float y = {value};"]
    lines += epilogue_lines(step, "row", "      ")
    lines += [f"      out[row] = kf_store<{out_ctype(step)}>(e_result);", "    }"]
    return lines
