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
passes per thread over what it keeps, cheaper in instructions (`_two_passes`). Passes re-read the row and recompute
the prologue instead of storing it. Numerics follow ATen: float accumulation, NaN-propagating max/min,
logsumexp's infinite max replaced by 0, softmax as exp(x - max) / sum, batch norm's running statistics with the
unbiased variance.
"""

from __future__ import annotations

from collections.abc import Callable

from kernelfuse.capture.graph import contiguous_strides
from kernelfuse.codegen.arg_reduce import INDEX_KINDS, arg_row_lines
from kernelfuse.codegen.common import invariant_operands, offset_expr, program_lines
from kernelfuse.codegen.iteration import (
    BLOCK,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    launcher,
    memory_order,
    out_ctype,
    pointer_params,
    shape_numel,
    space_of,
    value_lambda,
)
from kernelfuse.codegen.onchip import (
    ONCHIP_THREADS,
    blocks_per_sm,
    chunk_copy,
    chunk_group,
    chunk_of,
    chunk_pass,
    combine_across_blocks,
    copies_vectors,
    onchip_launcher,
    onchip_workspace,
    row_blocks,
    source_pointer_lambda,
)
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep

CACHE_MAX = 32  # elements a thread keeps in registers across a broadcasting row kernel's passes (a warp: 1024)
CACHE_MAX_THREAD_ROW = 64  # the same for a reduce-then-broadcast kernel whose thread owns its row (not measured)

REDUCE_OPS = {"sum": ("kf_sum_op", "0.0f"), "mean": ("kf_sum_op", "0.0f"), "prod": ("kf_prod_op", "1.0f"),
              "amax": ("kf_max_op", "(-INFINITY)"), "amin": ("kf_min_op", "INFINITY")}


def reads_rows_contiguously(space: Space) -> bool:
    """Is the source's unit-stride dim a reduced one? Then a row's elements lie next to each other and the `inner`
    strategy coalesces (a channels-last source reduced over channels: its innermost logical dim is kept)."""
    if not space.dims("r"):
        return False
    src = space.strides["src"]
    unit = [d for d in range(len(space.sizes)) if src[d] == 1]
    return space.classes[unit[-1] if unit else -1] == "r"


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
    lines += _kind_lines(step, kind, red, ctype, space, tpr, limit, blocks)
    lines.append("  }")
    return lines


def _loop(body: list[str], cache: str | None = None, raw: bool = False, onchip: int = 0) -> list[str]:
    """A thread's pass over its elements of the row, `v` the element's value. `cache` None: each pass reads (and
    recomputes the prologue); "fill": this pass reads and keeps the thread's elements (PER of them) in registers,
    or in an on-chip kernel in the block's shared memory; "read": this pass takes them from there. `raw`: the pass
    also names the source element `raw`, and the cache keeps that (a broadcast consumer reads the source, not the
    prologue's value). `onchip`: the elements a thread takes at once in an on-chip kernel's pass (0: not one)."""
    if onchip:  # the chunk is copied to shared memory first; both passes read the source values from there
        slot = "kf_row_cache[j * TPR + lane]"
        take = "const float v = value_at(r, raw);" if onchip == 4 else f"const float raw = {slot};\nconst float v = value_at(r, raw);"
        passes = chunk_pass([take, *body], onchip)
        if cache == "fill":
            passes = chunk_copy(slot, chunk_pass([f"kf_cp_async4(&{slot}, source_ptr(r));"]), onchip == 4) + passes
        return passes
    slot = "cache[j]"
    if raw:
        take = {None: "const float raw = source(r);\nconst float v = value_at(r, raw);",
                "fill": f"const float raw = source(r);\n{slot} = raw;\nconst float v = value_at(r, raw);",
                "read": f"const float raw = {slot};"}[cache]
    else:
        take = {None: "const float v = value(r);", "fill": f"const float v = value(r);\n{slot} = v;",
                "read": f"const float v = {slot};"}[cache]
    if cache is None:
        return ["    for (INDEX r = lane; r < (INDEX)RED; r += TPR) {", *[f"      {t}" for t in take.split("\n")],
                *[f"      {b}" for b in body], "    }"]
    return ["#pragma unroll", "    for (int j = 0; j < PER; ++j) {", "      const INDEX r = lane + (INDEX)j * TPR;",
            "      if (r < (INDEX)RED) {", *[f"        {t}" for t in take.split("\n")],
            *[f"        {b}" for b in body], "      }", "    }"]


def _row_invariant(step: GenStep, space: Space) -> tuple[int, ...]:
    """The epilogue operands that are the same for every element of a row, loaded once a row instead of once an
    element (a per-channel scale after a softmax over each channel's plane: level-2 38). The row must be one run of
    the output starting at a multiple of its length; the operand is then broadcast over the output's trailing dims
    that such runs lie in (`invariant_operands`)."""
    red = space.count("r")
    out = space.strides["out"]
    reduced = space.dims("r")
    if memory_order(step) is not None or [out[d] for d in reduced] != list(
            contiguous_strides(tuple(space.sizes[d] for d in reduced))) or any(out[d] % red for d in space.dims("k")):
        return ()
    return invariant_operands(tuple(step.epilogue.space), step.epilogue.operands, red)


def _two_passes(kind: str, onchip: int) -> list[str]:
    """A thread's statistics of its elements kept on chip (an on-chip chunk in shared memory, or the row in
    registers), in two passes over them: the max, then the sum of exp(v - max) (softmax kinds); the sum, then the
    squared deviations from the thread's mean (norms). The one-pass updates (a rescaled sum at each new max;
    Welford's division per element) cost more instructions than the memory allows: the on-chip LogSoftmax issued
    on 57% of cycles at 58% of DRAM bandwidth (ncu, H100), BERT's add + LayerNorm (rows of 768 in registers) ran at
    a third of Inductor's bandwidth (2 H200s). The per-thread results merge across threads and blocks as the
    one-pass ones do."""
    again = None if onchip else "read"  # shared memory is read by both passes; registers are filled, then read
    if kind == "norm":
        return [*_loop(["n += 1.0f;", "mean += v;"], "fill", onchip=onchip),
                "    mean = n > 0.0f ? mean / n : 0.0f;",
                *_loop(["const float d = v - mean;", "m2 += d * d;"], again, onchip=onchip)]
    return [*_loop(["m = kf_max_op()(m, v);"], "fill", onchip=onchip),
            *_loop(["const float e = expf(v - m);", "s += (v == -INFINITY) ? 0.0f : e;"], again, onchip=onchip)]


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
    if kind in REDUCE_OPS:
        op, identity = REDUCE_OPS[kind]
        lines.append(f"    float s = {identity};")
        lines += _loop([f"s = {op}()(s, v);"], first, raw=mapped, onchip=oc)
        lines.append(f"    s = kf_row_reduce<TPR>(s, {op}());")
        if blocks:
            lines.append(f"    {combine_across_blocks(blocks, ('s',), op)}")
        if kind == "mean":
            lines.append(f"    s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
        if not mapped:
            return lines + reduced_store(step, "s", ctype)
        lines.append("    const float y = s;  // every thread of the row: the row's value after the epilogue")
        return lines + epilogue_lines(step, "row", "    ") + _mapped_store(step, ctype, space, again, oc)
    if kind in ("logsumexp", "softmax", "log_softmax"):
        lines.append("    float m = -INFINITY, s = 0.0f;")
        lines += _two_passes(kind, oc) if cached else _loop(["kf_online_add(m, s, v);"])
        lines.append("    kf_row_reduce_online<TPR>(m, s);")
        if blocks:
            lines.append(f"    {{ float unused = 0.0f; {combine_across_blocks(blocks, ('m', 's', 'unused'), 'kf_online_merge3')} }}")
        if kind == "logsumexp":  # ATen replaces an infinite max by 0: the sum is then inf (or 0), log gives m back
            lines.append("    const float lse = fabsf(m) == INFINITY ? m : logf(s) + m;")
            return lines + reduced_store(step, "lse", ctype)
        lines.append("    const float logs = logf(s);" if kind == "log_softmax" else "")
        expr = "v - m - logs" if kind == "log_softmax" else "expf(v - m) / s"
        return lines + _broadcast_store(step, expr, ctype, [], space, again, oc)
    # norm: mean and biased variance in one Welford pass; affine; batch norm updates its running statistics
    lines.append("    float n = 0.0f, mean = 0.0f, m2 = 0.0f;")
    lines += _two_passes(kind, oc) if cached else _loop(["kf_welford_add(n, mean, m2, v);"])
    lines.append("    kf_row_reduce_welford<TPR>(n, mean, m2);")
    if blocks:
        lines.append(f"    {combine_across_blocks(blocks, ('n', 'mean', 'm2'), 'kf_welford_merge3')}")
    lines.append(f"    const float var = m2 * {float_literal(1.0 / red)};")
    lines.append(f"    const float rstd = {rstd(step)};")
    lines += running_lines(step, red, ctype, "    ", "lane == 0 && kf_rank == 0" if blocks else "lane == 0")
    affine = [n for n in ("weight", "bias") if n in space.strides]
    expr = normalised(step, lambda n: f"row_{n} + o_{n}").replace("value(r)", "v")
    return lines + _broadcast_store(step, expr, ctype, affine, space, again, oc)


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


def _broadcast_store(step: GenStep, expr: str, ctype: str, extra: list[str], space: Space,
                     cache: str | None, onchip: int = 0) -> list[str]:
    """Write every element of the row: `expr` (of the element `v`, the row's statistics applied), then the
    epilogue; its operands that are the same for the whole row (`_row_invariant`) loaded before the pass."""
    body = [ln.strip() for ln in decompose(space, "r", "r", "o_", ["out", *extra], "")]
    body.append(f"const float y = {expr};")
    hoisted = _row_invariant(step, space)
    shape = tuple(step.epilogue.space)
    loads = [f"    const float e_in{j}_row = kf_load(e_in{j}_p[{offset_expr(step.epilogue.operands[j].strides, shape, '(row_out)')}]);"
             for j in hoisted]
    epilogue = [ln.strip() for ln in epilogue_lines(step, "row_out + o_out", "", {f"in{j}": f"e_in{j}_row" for j in hoisted})]
    element = "raw" if onchip else "v" if not step.prologue.statements else None  # the source element in hand
    if element:  # a residual of the norm's own input: no second read
        epilogue = _element_in_hand(epilogue, "e_", _source_operands(step), element)
    body += epilogue
    if cache is None and not onchip and stages_writes(space):
        return loads + _staged_loop(body, out_ctype(step))
    return loads + _stored(body, "e_result", out_ctype(step), cache, False, onchip)


def _stored(body: list[str], value: str, ctype: str, cache: str | None, raw: bool, onchip: int) -> list[str]:
    """The write pass: `body` computes the element's `value`, stored at its output offset (an on-chip kernel's
    one element at a time: `onchip.chunk_pass`)."""
    body = [*body, f"out[row_out + o_out] = kf_store<{ctype}>({value});"]
    return _loop(body, cache, raw=raw, onchip=1 if onchip else 0)


def stages_writes(space: Space) -> bool:
    """Does a one-thread-per-row kernel write its rows through shared memory? Where the source's rows are strided
    (neighbouring threads own neighbouring rows, and read coalesced) but the output's are contiguous (a LayerNorm
    over the channels of an NCHW activation, written as the (N, HW, C) rows a Linear reads), a thread's own writes
    hit a new 32-byte sector each (the UNet block's three such norms took 0.18 ms each, ATen's 0.03). Every warp
    must own 32 live rows (rows a multiple of 32)."""
    reduced = space.dims("r")
    return (not reads_rows_contiguously(space) and space.count("k") % 32 == 0 and len(reduced) == 1
            and space.strides["out"][reduced[0]] == 1)


def _staged_loop(body: list[str], out_t: str) -> list[str]:
    """The write pass of a staged row kernel (stages_writes): a warp's 32 rows computed 32 elements at a time into
    a shared tile, then written row by row, the lanes along the row (one 32-element run per store)."""
    return [f"    __shared__ float kf_tile[{BLOCK // 32}][32][33];  // a warp's 32 rows x 32 elements (padded: no bank conflicts)",
            f"    __shared__ INDEX kf_tile_out[{BLOCK // 32}][32];  // each row's output offset",
            "    const int kf_w = threadIdx.x / 32, kf_l = threadIdx.x % 32;",
            "    kf_tile_out[kf_w][kf_l] = row_out;",
            "    for (INDEX c0 = 0; c0 < (INDEX)RED; c0 += 32) {",
            "      __syncwarp();",
            "      for (int kf_j = 0; kf_j < 32 && c0 + kf_j < (INDEX)RED; ++kf_j) {",
            "        const INDEX r = c0 + kf_j;",
            "        const float v = value(r);",
            *[f"        {b}" for b in body],
            "        kf_tile[kf_w][kf_l][kf_j] = e_result;",
            "      }",
            "      __syncwarp();",
            "      if (c0 + kf_l < (INDEX)RED)",
            "        for (int kf_j = 0; kf_j < 32; ++kf_j)",
            f"          out[kf_tile_out[kf_w][kf_j] + c0 + kf_l] = kf_store<{out_t}>(kf_tile[kf_w][kf_j][kf_l]);",
            "    }"]


def _source_operands(step: GenStep) -> list[int]:
    """The epilogue operands that are the kernel's source element by element: the same tensor, contiguous, read at
    the output's flat index, which is the source's flat index (a contiguous source, an output of its shape)."""
    src = step.source
    if src.meta.stride != contiguous_strides(src.meta.shape) or step.out_meta.numel != src.meta.numel:
        return []
    space = step.epilogue.space
    return [i for i, o in enumerate(step.epilogue.operands)
            if o.ref == src.ref and tuple(o.strides) == contiguous_strides(space) and shape_numel(space) == src.meta.numel]


def _element_in_hand(program: list[str], prefix: str, operands: list[int], element: str) -> list[str]:
    """`program` with the loads of `operands` (its `{prefix}in{i}`) replaced by `element`, the source element the
    thread already holds: the same value, not read from memory again."""
    loads = {f"const float {prefix}in{i} = ": f"const float {prefix}in{i} = {element};" for i in operands}
    return [next((new for start, new in loads.items() if ln.startswith(start)), ln) for ln in program]


def _mapped_store(step: GenStep, ctype: str, space: Space, cache: str | None, onchip: int = 0) -> list[str]:
    """Write every element of the row: the broadcast consumer (`step.mapped`) of the row's value `e_result` and
    its operands; an operand that is the source itself takes the element already loaded or cached (`raw`)."""
    mapped = step.mapped
    names = [f"m{i}" for i in range(len(mapped.operands))]  # type: ignore[union-attr]
    body = [ln.strip() for ln in decompose(space, "r", "r", "o_", ["out", *names], "")]
    offsets = {f"in{i}": f"row_m{i} + o_m{i}" for i in range(len(names))}
    program = [ln.strip() for ln in program_lines(mapped, "e_result", offsets, "m_", "", ctype)]  # type: ignore[arg-type]
    sources = [i for i, o in enumerate(mapped.operands)  # type: ignore[union-attr]
               if o.ref == step.source.ref and o.strides == step.source.strides]
    body += _element_in_hand(program, "m_", sources, "raw")
    return _stored(body, "m_result", out_ctype(step), cache, True, onchip)
