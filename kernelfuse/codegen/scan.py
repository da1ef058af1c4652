"""Scan kernels (cumsum, cumprod, cummax/cummin values, logcumsumexp; reverse and exclusive forms) for generated
kernels, the prologue applied to each element read and the epilogue to each element written.

Two strategies, chosen from the merged space (as the row reductions choose theirs):
- `tile` (the source's innermost dim is scanned): a block per row walks it in tiles of TILE elements, read and
  written coalesced through shared memory; each thread scans ITEMS neighbours in registers, the warp scans the
  threads' totals with shuffles, the block combines its warps' totals in a fixed order, and a running carry joins
  the tiles. One read and one write of the row: bandwidth-bound.
- `column` (the scanned dim is strided): a thread per row scans it sequentially; neighbouring threads own
  neighbouring rows, so each step's loads coalesce across the warp. This is ATen's own order for such scans.

Accumulation is in float: a sum of n terms errs by about sqrt(n) * eps * sum|x| in either strategy (eager's CUDA
scan is a tree within a block and a carry between blocks too; tests/test_scan.py bounds ours against float64).
"""

from __future__ import annotations

from kernelfuse.codegen.iteration import (
    BLOCK,
    decompose,
    epilogue_lines,
    index_type,
    launcher,
    out_ctype,
    pointer_params,
    space_of,
    value_lambda,
)
from kernelfuse.codegen.row_passes import reads_rows_contiguously
from kernelfuse.ops.scans import SCAN_COMBINE
from kernelfuse.plan.ir import GenStep

ITEMS = 4  # elements a thread scans in registers per tile
TILE = ITEMS * BLOCK
WARPS = BLOCK // 32


def scan_strategy(step: GenStep) -> str:
    """`tile` where the scanned dim is the source's contiguous one, else `column`."""
    return "tile" if reads_rows_contiguously(space_of(step)) else "column"


def scan_kernel(step: GenStep, ctype: str) -> str:
    """The scan kernel and its launcher: rows from the kept dims, each scanned along the reduced dim (from its
    end for a reverse scan; the identity first for an exclusive one), prologue on every element read."""
    spec = step.spec
    space = space_of(step)
    rows, length = space.count("k"), space.count("r")
    (rdim,) = space.dims("r")
    out_stride = space.strides["out"][rdim]
    op, ident = SCAN_COMBINE[spec.kind]  # type: ignore[attr-defined]
    strategy = scan_strategy(step)
    form = ("reverse " if spec.reverse else "") + ("exclusive " if spec.exclusive else "")  # type: ignore[attr-defined]
    position = f"({length - 1} - (i))" if spec.reverse else "(i)"  # type: ignore[attr-defined]
    k = step.kernel
    lines = [f"// {form}{spec.kind} scan: {rows} rows of {length}, strategy {strategy}",  # type: ignore[attr-defined]
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_type(step)} INDEX;",
             f"  const {op} op{{}};",
             f"  const float IDENT = {ident};",
             f"#define KF_POS(i) {position}"]
    first, step_rows = ("(INDEX)blockIdx.x", "(INDEX)gridDim.x") if strategy == "tile" else \
        (f"(INDEX)blockIdx.x * {BLOCK} + threadIdx.x", f"(INDEX)gridDim.x * {BLOCK}")
    if strategy == "tile":
        lines += [f"  __shared__ float tile[{TILE + TILE // 32}];  // one pad slot per 32: no bank conflicts",
                  f"  __shared__ float warp_total[{WARPS}];",
                  "  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;"]
    lines.append(f"  for (INDEX row = {first}; row < (INDEX){rows}; row += {step_rows}) {{")
    lines += decompose(space, "k", "row", "b_", ["src", "out", *(f"in{i}" for i in range(len(step.prologue.operands)))],
                       "    ")
    lines += value_lambda(step, space, "r", "b_")
    lines += ["    auto store = [&](INDEX p, float y) {",
              *epilogue_lines(step, f"b_out + p * {out_stride}", "      "),
              f"      out[b_out + p * {out_stride}] = kf_store<{out_ctype(step)}>(e_result);",
              "    };",
              "    float carry = IDENT;"]
    lines += _tile_body(length, spec.exclusive) if strategy == "tile" else _column_body(length, spec.exclusive)  # type: ignore[attr-defined]
    lines += ["  }", "#undef KF_POS", "}", ""]
    grid = f"kf_blocks({rows}LL * {BLOCK}, {BLOCK})" if strategy == "tile" else f"kf_blocks({rows}LL, {BLOCK})"
    return "\n".join(lines) + launcher(step, ctype, grid)


def _column_body(length: int, exclusive: bool) -> list[str]:
    out = "carry" if exclusive else "next"
    return [f"    for (INDEX i = 0; i < (INDEX){length}; ++i) {{",
            "      const INDEX p = KF_POS(i);",
            "      const float next = op(carry, value(p));",
            f"      store(p, {out});",
            "      carry = next;",
            "    }"]


def _tile_body(length: int, exclusive: bool) -> list[str]:
    """One tile: its elements (loaded coalesced during the previous tile) into shared memory, the next tile's
    loads issued, each thread's ITEMS scanned in registers, the warp's inclusive scan of the thread totals, the
    warps' totals combined in order with the carry, a coalesced store."""
    result = "(j == 0 ? prefix : op(prefix, v[j - 1]))" if exclusive else "op(prefix, v[j])"
    def load(first: str, ind: str) -> list[str]:
        return ["#pragma unroll",
                f"{ind}for (int j = 0; j < {ITEMS}; ++j) {{",
                f"{ind}  const int q = j * {BLOCK} + t;",
                f"{ind}  const INDEX i = {first} + q;",
                f"{ind}  next[j] = i < (INDEX){length} ? value(KF_POS(i)) : IDENT;",
                f"{ind}}}"]

    return [
        f"    float next[{ITEMS}];  // the next tile's elements, loaded while this one is scanned",
        *load("0", "    "),
        f"    for (INDEX start = 0; start < (INDEX){length}; start += {TILE}) {{",
        "#pragma unroll",
        f"      for (int j = 0; j < {ITEMS}; ++j) {{",
        f"        const int q = j * {BLOCK} + t;",
        "        tile[q + q / 32] = next[j];",
        "      }",
        "      __syncthreads();",
        *load(f"start + {TILE}", "      "),
        f"      float v[{ITEMS}];",
        "#pragma unroll",
        f"      for (int j = 0; j < {ITEMS}; ++j) {{",
        f"        const int q = t * {ITEMS} + j;",
        "        v[j] = tile[q + q / 32];",
        "        if (j > 0) v[j] = op(v[j - 1], v[j]);",
        "      }",
        f"      float x = v[{ITEMS - 1}];  // the warp's inclusive scan of the threads' totals",
        "#pragma unroll",
        "      for (int o = 1; o < 32; o <<= 1) {",
        "        const float y = __shfl_up_sync(0xffffffffu, x, o);",
        "        if (lane >= o) x = op(y, x);",
        "      }",
        "      float before = __shfl_up_sync(0xffffffffu, x, 1);",
        "      if (lane == 0) before = IDENT;",
        "      if (lane == 31) warp_total[warp] = x;",
        "      __syncthreads();",
        "      float prefix = carry;  // the carry, then the earlier warps' totals in order",
        f"      for (int u = 0; u < {WARPS}; ++u) {{",
        "        if (u == warp) prefix = op(prefix, before);",
        "        carry = op(carry, warp_total[u]);",
        "        if (u < warp) prefix = op(prefix, warp_total[u]);",
        "      }",
        "#pragma unroll",
        f"      for (int j = 0; j < {ITEMS}; ++j) {{",
        f"        const int q = t * {ITEMS} + j;",
        f"        tile[q + q / 32] = {result};",
        "      }",
        "      __syncthreads();",
        "#pragma unroll",
        f"      for (int j = 0; j < {ITEMS}; ++j) {{",
        f"        const int q = j * {BLOCK} + t;",
        "        const INDEX i = start + q;",
        f"        if (i < (INDEX){length}) store(KF_POS(i), tile[q + q / 32]);",
        "      }",
        "    }"]
