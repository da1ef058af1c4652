"""The write pass of a reduce-then-broadcast row kernel (kernelfuse.codegen.reduce): every element of the row
with the row's statistics applied, then the epilogue (or a broadcast consumer's program), stored at its output
offset; one element at a time, through a shared-memory tile (staged rows), or in an on-chip kernel in groups of
four."""

from __future__ import annotations

import re

from kernelfuse.capture.graph import contiguous_strides
from kernelfuse.codegen.common import invariant_operands, offset_expr, program_lines
from kernelfuse.codegen.iteration import BLOCK, Space, decompose, epilogue_lines, memory_order, out_ctype, shape_numel
from kernelfuse.codegen.onchip import chunk_pass, group_invariant, group_runs
from kernelfuse.codegen.row_passes import (
    group_prologue,
    group_prologue_operands,
    reads_rows_contiguously,
    row_invariant,
    row_pass,
)
from kernelfuse.plan.ir import GenStep


def broadcast_store(step: GenStep, expr: str, ctype: str, extra: list[str], space: Space,
                     cache: str | None, onchip: int = 0) -> list[str]:
    """Write every element of the row: `expr` (of the element `v`, the row's statistics applied), then the
    epilogue; its operands that are the same for the whole row (`row_invariant`) loaded before the pass. An
    on-chip pass writes groups of four where `writes_groups` allows (`grouped_write`)."""
    body = [ln.strip() for ln in decompose(space, "r", "r", "o_", ["out", *extra], "")]
    body.append(f"const float y = {expr};")
    hoisted = row_invariant(step, space)
    shape = tuple(step.epilogue.space)
    loads = [f"    const float e_in{j}_row = kf_load(e_in{j}_p[{offset_expr(step.epilogue.operands[j].strides, shape, '(row_out)')}]);"
             for j in hoisted]
    given = {f"in{j}": f"e_in{j}_row" for j in hoisted}
    epilogue = [ln.strip() for ln in epilogue_lines(step, "row_out + o_out", "", given)]
    element = "raw" if onchip else "v" if not step.prologue.statements else None  # the source element in hand
    if element:  # a residual of the norm's own input: no second read
        epilogue = element_in_hand(epilogue, "e_", source_operands(step), element)
    if onchip == 4 and writes_groups(step, space, [*body, *epilogue], extra, given):
        return loads + grouped_write(step, space, expr, extra, given)
    body += epilogue
    if cache is None and not onchip and stages_writes(space):
        return loads + staged_pass(body, out_ctype(step))
    return loads + stored_pass(body, "e_result", out_ctype(step), cache, False, onchip)


def writes_groups(step: GenStep, space: Space, element: list[str], affine: list[str], given: dict[str, str]) -> bool:
    """Does the on-chip write pass take groups of four (`grouped_write`)? Only where a group shares an operand
    (`group_shared`): without one, groups measured slower than single elements (H200, level-1 LogSoftmax 4.38 ->
    4.68 ms, InstanceNorm 5.27 -> 5.45). Its output must be a run of the row (`group_runs`) in the iteration's
    own order, and the element's code (`element`) must divide no floats: a group holds its four results until its
    one store, and across the IEEE division's slow-path call they spilled at the on-chip kernel's 32 registers
    (ptxas, sm_80: a mapped L1 norm)."""
    if memory_order(step) is not None or not group_runs(space, "out") or not any(
            group_shared(step, space, affine, given)):
        return False
    prologue = program_lines(step.prologue, "acc", {f"in{i}": "0" for i in range(len(step.prologue.operands))},
                             "p_", "")
    floats = [re.sub(r"\[[^\]]*\]", "", ln.split("//")[0]) for ln in [*element, *prologue]
              if ln.strip().startswith("const float")]  # offsets inside [] are integer arithmetic
    return not any("/" in ln for ln in floats)


def group_shared(step: GenStep, space: Space, affine: list[str],
                 given: dict[str, str]) -> tuple[list[str], list[str], list[int]]:
    """The operands a write pass's group of four shares: the prologue's (`in{i}`), the norm's affine ones
    (`weight`, `bias`) and the epilogue's (by number; over the output's flat index, which starts the group at a
    multiple of 4 where the output is a run of the row), those loaded once a row (`given`) left out."""
    epi = [j for j in invariant_operands(tuple(step.epilogue.space), step.epilogue.operands, 4) if f"in{j}" not in given]
    return group_prologue_operands(step, space), group_invariant(space, affine), epi


def grouped_write(step: GenStep, space: Space, expr: str, affine: list[str], given: dict[str, str]) -> list[str]:
    """The on-chip write pass in groups of four: the operands the four share (the prologue's, the affine weight
    and bias, the epilogue's over the output's flat index) loaded once a group, the four results stored in one
    16-byte store where the output is aligned. A group norm after a biased convolution loaded its three
    per-channel operands once an element (level-2 92's norm: 0.68 ms, twice its memory time)."""
    pro, shared, epi = group_shared(step, space, affine, given)
    own = [n for n in affine if n not in shared]
    shape = tuple(step.epilogue.space)
    head = decompose(space, "r", "r0", "g_", ["out", *pro, *shared], "")
    head += [f"const float h_{n} = kf_load(p_{n}_p[row_{n} + g_{n}]);" for n in pro]
    head += [f"const float h_{n} = kf_load({n}[row_{n} + g_{n}]);" for n in shared]
    head += [f"const float e_in{j}_g = kf_load(e_in{j}_p[{offset_expr(step.epilogue.operands[j].strides, shape, '(row_out + g_out)')}]);"
             for j in epi]
    head.append("float kf_res[4];")
    take = group_prologue(step, space)[1]  # the element's value, from the prologue operands loaded below
    body = [take, *(ln.strip() for ln in decompose(space, "r", "r", "o_", own, "") if own)]
    for n in shared:  # `expr` loads the affine operands at their element's offset (`normalised`)
        expr = expr.replace(f"kf_load({n}[row_{n} + o_{n}])", f"h_{n}")
    body.append(f"const float y = {expr};")
    epilogue = epilogue_lines(step, "row_out + g_out + t", "", {**given, **{f"in{j}": f"e_in{j}_g" for j in epi}})
    body += element_in_hand([ln.strip() for ln in epilogue], "e_", source_operands(step), "raw")
    body.append("kf_res[t] = e_result;")
    out_t = out_ctype(step)
    tail = ["if (KF_OUT_ALIGNED) {",
            "  *reinterpret_cast<float4*>(&out[row_out + g_out]) = make_float4(kf_res[0], kf_res[1], kf_res[2], kf_res[3]);",
            "} else {",
            f"  for (int t = 0; t < 4; ++t) out[row_out + g_out + t] = kf_store<{out_t}>(kf_res[t]);",
            "}"] if out_t == "float" else [f"for (int t = 0; t < 4; ++t) out[row_out + g_out + t] = kf_store<{out_t}>(kf_res[t]);"]
    aligned = ["    const bool KF_OUT_ALIGNED = (reinterpret_cast<size_t>(out) & 15) == 0;"] if out_t == "float" else []
    return aligned + chunk_pass(body, 4, head, tail)


def stored_pass(body: list[str], value: str, ctype: str, cache: str | None, raw: bool, onchip: int) -> list[str]:
    """The write pass: `body` computes the element's `value`, stored at its output offset (an on-chip kernel's
    one element at a time: `onchip.chunk_pass`)."""
    body = [*body, f"out[row_out + o_out] = kf_store<{ctype}>({value});"]
    return row_pass(body, cache, raw=raw, onchip=1 if onchip else 0)


def stages_writes(space: Space) -> bool:
    """Does a one-thread-per-row kernel write its rows through shared memory? Where the source's rows are strided
    (neighbouring threads own neighbouring rows, and read coalesced) but the output's are contiguous (a LayerNorm
    over the channels of an NCHW activation, written as the (N, HW, C) rows a Linear reads), a thread's own writes
    hit a new 32-byte sector each (the UNet block's three such norms took 0.18 ms each, ATen's 0.03). Every warp
    must own 32 live rows (rows a multiple of 32)."""
    reduced = space.dims("r")
    return (not reads_rows_contiguously(space) and space.count("k") % 32 == 0 and len(reduced) == 1
            and space.strides["out"][reduced[0]] == 1)


def staged_pass(body: list[str], out_t: str) -> list[str]:
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


def source_operands(step: GenStep) -> list[int]:
    """The epilogue operands that are the kernel's source element by element: the same tensor, contiguous, read at
    the output's flat index, which is the source's flat index (a contiguous source, an output of its shape)."""
    src = step.source
    if src.meta.stride != contiguous_strides(src.meta.shape) or step.out_meta.numel != src.meta.numel:
        return []
    space = step.epilogue.space
    return [i for i, o in enumerate(step.epilogue.operands)
            if o.ref == src.ref and tuple(o.strides) == contiguous_strides(space) and shape_numel(space) == src.meta.numel]


def element_in_hand(program: list[str], prefix: str, operands: list[int], element: str) -> list[str]:
    """`program` with the loads of `operands` (its `{prefix}in{i}`) replaced by `element`, the source element the
    thread already holds: the same value, not read from memory again."""
    loads = {f"const float {prefix}in{i} = ": f"const float {prefix}in{i} = {element};" for i in operands}
    return [next((new for start, new in loads.items() if ln.startswith(start)), ln) for ln in program]


def mapped_store(step: GenStep, ctype: str, space: Space, cache: str | None, onchip: int = 0) -> list[str]:
    """Write every element of the row: the broadcast consumer (`step.mapped`) of the row's value `e_result` and
    its operands; an operand that is the source itself takes the element already loaded or cached (`raw`)."""
    mapped = step.mapped
    names = [f"m{i}" for i in range(len(mapped.operands))]  # type: ignore[union-attr]
    body = [ln.strip() for ln in decompose(space, "r", "r", "o_", ["out", *names], "")]
    offsets = {f"in{i}": f"row_m{i} + o_m{i}" for i in range(len(names))}
    program = [ln.strip() for ln in program_lines(mapped, "e_result", offsets, "m_", "", ctype)]  # type: ignore[arg-type]
    sources = [i for i, o in enumerate(mapped.operands)  # type: ignore[union-attr]
               if o.ref == step.source.ref and o.strides == step.source.strides]
    body += element_in_hand(program, "m_", sources, "raw")
    return stored_pass(body, "m_result", out_ctype(step), cache, True, onchip)
