"""A row kernel thread's passes over its elements of a row (kernelfuse.codegen.reduce): read from memory, from
registers, or from an on-chip chunk in shared memory (kernelfuse.codegen.onchip), whose passes take groups of
four elements and load the operands the four share once."""

from __future__ import annotations

from kernelfuse.capture.graph import contiguous_strides
from kernelfuse.codegen.common import invariant_operands
from kernelfuse.codegen.iteration import Space, decompose, memory_order
from kernelfuse.codegen.onchip import chunk_copy, chunk_group, chunk_pass, group_invariant
from kernelfuse.plan.ir import GenStep


def reads_rows_contiguously(space: Space) -> bool:
    """Is the source's unit-stride dim a reduced one? Then a row's elements lie next to each other and the `inner`
    strategy coalesces (a channels-last source reduced over channels: its innermost logical dim is kept)."""
    if not space.dims("r"):
        return False
    src = space.strides["src"]
    unit = [d for d in range(len(space.sizes)) if src[d] == 1]
    return space.classes[unit[-1] if unit else -1] == "r"


def row_pass(body: list[str], cache: str | None = None, raw: bool = False, onchip: int = 0,
             grouped: tuple[list[str], str] | None = None) -> list[str]:
    """A thread's pass over its elements of the row, `v` the element's value. `cache` None: each pass reads (and
    recomputes the prologue); "fill": this pass reads and keeps the thread's elements (PER of them) in registers,
    or in an on-chip kernel in the block's shared memory; "read": this pass takes them from there. `raw`: the pass
    also names the source element `raw`, and the cache keeps that (a broadcast consumer reads the source, not the
    prologue's value). `onchip`: the elements a thread takes at once in an on-chip kernel's pass (0: not one);
    `grouped`: a group's head and the statement that takes its element's value (`group_prologue`)."""
    if onchip:  # the chunk is copied to shared memory first; both passes read the source values from there
        slot = "kf_row_cache[j * TPR + lane]"
        head, take = grouped or ([], "const float v = value_at(r, raw);")
        if onchip == 1:
            take = f"const float raw = {slot};\nconst float v = value_at(r, raw);"
        passes = chunk_pass([take, *body], onchip, head)
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


def group_prologue_operands(step: GenStep, space: Space) -> list[str]:
    """The prologue operands an on-chip pass's group loads once for its four elements (`group_invariant`)."""
    if chunk_group(space) != 4:
        return []
    return group_invariant(space, [f"in{i}" for i in range(len(step.prologue.operands))])


def group_prologue(step: GenStep, space: Space) -> tuple[list[str], str]:
    """A group's head, which loads the prologue operands its four elements share (`h_in{i}`), and the statement
    that takes an element's value `v` through `value_at_g` with them (or `value_at` where none is shared)."""
    names = group_prologue_operands(step, space)
    if not names:
        return [], "const float v = value_at(r, raw);"
    head = decompose(space, "r", "r0", "g_", names, "")
    head += [f"const float h_{n} = kf_load(p_{n}_p[row_{n} + g_{n}]);" for n in names]
    return head, f"const float v = value_at_g(r, raw{''.join(f', h_{n}' for n in names)});"


def row_invariant(step: GenStep, space: Space) -> tuple[int, ...]:
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


def two_passes(kind: str, onchip: int, grouped: tuple[list[str], str] | None = None) -> list[str]:
    """A thread's statistics of its elements kept on chip (an on-chip chunk in shared memory, or the row in
    registers), in two passes over them: the max, then the sum of exp(v - max) (softmax kinds); the sum, then the
    squared deviations from the thread's mean (norms). The one-pass updates (a rescaled sum at each new max;
    Welford's division per element) cost more instructions than the memory allows: the on-chip LogSoftmax issued
    on 57% of cycles at 58% of DRAM bandwidth (ncu, H100), BERT's add + LayerNorm (rows of 768 in registers) ran at
    a third of Inductor's bandwidth (2 H200s). The per-thread results merge across threads and blocks as the
    one-pass ones do."""
    again = None if onchip else "read"  # shared memory is read by both passes; registers are filled, then read
    if kind == "norm":
        return [*row_pass(["n += 1.0f;", "mean += v;"], "fill", onchip=onchip, grouped=grouped),
                "    mean = n > 0.0f ? mean / n : 0.0f;",
                *row_pass(["const float d = v - mean;", "m2 += d * d;"], again, onchip=onchip, grouped=grouped)]
    return [*row_pass(["m = kf_max_op()(m, v);"], "fill", onchip=onchip, grouped=grouped),
            *row_pass(["const float e = expf(v - m);", "s += (v == -INFINITY) ? 0.0f : e;"], again, onchip=onchip,
                   grouped=grouped)]


def welford_in_fours() -> list[str]:
    """A thread's Welford statistics of its elements read once each (not kept): four at a time merged by Chan's
    formula (`kf_welford_add4`, one division a group), then the rest one by one: the moments kernels' pass and a
    norm's statistics pass where its row does not stay in registers. A division per element made level-2 92's
    statistics kernel issue-bound (520 MB at 2.1 TB/s on an H200)."""
    return ["    INDEX r = lane;",
            "    for (; r + 3 * (INDEX)TPR < (INDEX)RED; r += 4 * (INDEX)TPR) {",
            "      kf_welford_add4(n, mean, m2, value(r), value(r + TPR), value(r + 2 * (INDEX)TPR),"
            " value(r + 3 * (INDEX)TPR));",
            "    }",
            "    for (; r < (INDEX)RED; r += TPR) {",
            "      const float v = value(r);",
            "      kf_welford_add(n, mean, m2, v);",
            "    }"]

