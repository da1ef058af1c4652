"""A pointwise kernel between two layouts (channels-last <-> NCHW, a transpose) through shared-memory tiles.

The flat kernel reads its source element by element in the output's order: where the source runs along another
dim than the output, each warp's 32 loads fall on 32 different lines (the channels-last graph's last copy back
to NCHW, 0.9 GB on level-3 14: 0.84 ms on an H200, 1.07 TB/s). Here a block takes a TILE x TILE tile of the two
innermost dims: it reads the tile along the source's contiguous dim, writes it along the output's, each access
a warp's 32 consecutive elements; the prologue and epilogue run on the output side, as the flat kernel's do.
"""

from __future__ import annotations

from kernelfuse.codegen.iteration import Space

TILE = 32
ROWS = 8  # a block is TILE x ROWS threads: each takes TILE / ROWS elements of the tile per phase
GRID_LIMIT = 65535  # gridDim.y and gridDim.z


def tiled_layout_change(space: Space) -> bool:
    """Does the merged space (in the output's memory order: `out` is contiguous over it) have the source
    contiguous along its second-innermost dim instead of its innermost, with at most one outer dim, and tiles
    enough to fill a block?"""
    sizes, src = space.sizes, space.strides["src"]
    if len(sizes) not in (2, 3) or src[-2] != 1 or src[-1] == 1 or min(sizes[-2:]) < ROWS:
        return False
    outer = sizes[0] if len(sizes) == 3 else 1
    return outer <= GRID_LIMIT and -(-sizes[-2] // TILE) <= GRID_LIMIT


def tiled_loop(space: Space, ctype: str) -> list[str]:
    """The kernel body after the `element` lambda: load a tile along the source's contiguous dim (a), store it
    along the output's (b)."""
    sizes, src = space.sizes, space.strides["src"]
    a_size, b_size = sizes[-2], sizes[-1]
    outer = f"(INDEX)blockIdx.z * {src[0]} + " if len(sizes) == 3 else ""
    first = f"((INDEX)blockIdx.z * {a_size} + a) * {b_size} + b" if len(sizes) == 3 else f"a * {b_size} + b"
    return [f"    __shared__ float tile[{TILE}][{TILE + 1}];  // [b][a]: both phases conflict-free",
            f"    const INDEX a0 = (INDEX)blockIdx.y * {TILE}, b0 = (INDEX)blockIdx.x * {TILE};",
            f"    for (int j = threadIdx.y; j < {TILE}; j += {ROWS}) {{  // a warp reads {TILE} consecutive a",
            "      const INDEX a = a0 + threadIdx.x, b = b0 + j;",
            f"      if (a < {a_size} && b < {b_size}) tile[j][threadIdx.x] = kf_load(src[{outer}a + b * {src[-1]}]);",
            "    }",
            "    __syncthreads();",
            f"    for (int j = threadIdx.y; j < {TILE}; j += {ROWS}) {{  // and writes {TILE} consecutive b",
            "      const INDEX a = a0 + j, b = b0 + threadIdx.x;",
            f"      if (a < {a_size} && b < {b_size}) {{",
            f"        const INDEX i = {first};",
            f"        out[i] = kf_store<{ctype}>(element(i, tile[threadIdx.x][j]));",
            "      }",
            "    }"]


def tiled_launch(space: Space) -> tuple[str, str]:
    """The launch of `tiled_loop`'s kernel, a block per tile (and per outer index): the grid's declaration, and
    the launch configuration that names it."""
    sizes = space.sizes
    outer = sizes[0] if len(sizes) == 3 else 1
    grid = f"dim3 grid({-(-sizes[-1] // TILE)}, {-(-sizes[-2] // TILE)}, {outer}), block({TILE}, {ROWS}); "
    return grid, "<<<grid, block, 0, stream>>>"
