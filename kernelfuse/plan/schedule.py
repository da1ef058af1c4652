"""The scheduler for generated kernels: partition the nodes no library anchor took into GenSteps.

A GenStep is `prologue (pointwise over the input's space) -> at most one reduction -> epilogue (pointwise over
the output)`. Walking the graph in order, a pointwise or reduction node seeds a kernel; pointwise nodes that read a
value inside it join while the shapes agree; a chain whose only reader is a reduction becomes that reduction's
prologue. A value needed outside the kernel (another reader, a graph output) ends the chain before it, so every
intermediate stays in registers. Each refusal has a reason (`can_fuse -> (ok, reason)`), shown in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.ops import POINTWISE_BY_ATEN
from kernelfuse.ops.anchors import RESHAPES
from kernelfuse.ops.reductions import HALF_DTYPES, ReduceSpec
from kernelfuse.ops.scans import GENERATED_BY_ATEN
from kernelfuse.plan.catselect import CAT
from kernelfuse.plan.ir import GenStep, Operand, Program
from kernelfuse.plan.joins import (
    FLOAT_DTYPES,
    can_fuse_pointwise,
    cat_group,
    conditions_inside,
    is_comparison,
    private_producers,
    without_last,
)
from kernelfuse.plan.program import build_program

CASTS = frozenset({"_to_copy.default"})


@dataclass
class _Chain:
    """A pointwise chain being grown: its members in order and the names of the values it computes."""

    members: list[Node]
    inside: set[str]


def schedule(graph: Graph, taken: set[str], first_kernel: int, max_kernels: int | None = None
             ) -> tuple[list[GenStep], dict[str, str]]:
    """GenSteps for the nodes not in `taken`, and the refusal reason for each node that stays a torch call."""
    steps: list[GenStep] = []
    reasons: dict[str, str] = {}
    used = set(taken)
    # a concatenation's branches are computed by the kernel that selects from it (a `neg` read only by rotary's cat
    # seeds no kernel of its own): the concatenation comes later in graph order and pulls them in
    branches = {m.name for n in graph.nodes if n.op == CAT for m in cat_group(graph, n, n.meta, used, True) or ()}
    for node in graph.nodes:
        if node.name in used or node.op in ("input", "param", "buffer"):
            continue
        if max_kernels is not None and len(steps) >= max_kernels:
            if node.op in POINTWISE_BY_ATEN or node.op in GENERATED_BY_ATEN:
                reasons.setdefault(node.name, "fusion cap (--max-fusions) reached")
            continue
        if node.name in branches:
            continue
        step = _kernel_from(graph, node, used, f"k{first_kernel + len(steps)}", reasons)
        if step is not None:
            steps.append(step)
            used.update(step.replaces)
    return steps, reasons


def _kernel_from(graph: Graph, seed: Node, used: set[str], kernel: str, reasons: dict[str, str]) -> GenStep | None:
    if seed.op in GENERATED_BY_ATEN:
        return _reduction_kernel(graph, seed, None, used, kernel, reasons)
    if seed.op == CAT:
        return _selecting_kernel(graph, seed, used, kernel)
    ok, why = can_fuse_pointwise(graph, seed, seed.meta, mixed=True) if seed.op in POINTWISE_BY_ATEN else (False, "")
    if ok and is_comparison(seed):
        ok, why = False, "a comparison's bool result is fused only into the where/masked_fill that reads it"
    producers = private_producers(graph, seed, set(), seed.meta, used, mixed=True) if ok else []
    if ok and not conditions_inside(seed, {p.name for p in producers}):
        ok, why = False, "its condition is a bool tensor computed elsewhere"
    if not ok:
        if why:
            reasons[seed.name] = why
        return None
    with_cats = _selecting_kernel(graph, seed, used, kernel)
    if with_cats is not None:
        return with_cats
    chain = _grow(graph, [*producers, seed], seed.meta, used, mixed=True)
    if is_comparison(chain.members[-1]):
        reasons[seed.name] = "the chain would end in a stored bool"
        return None
    # a weight's cast under autocast, an activation's before a GEMM: nothing to fuse it with
    if all(m.op in CASTS or m.op in RESHAPES for m in chain.members):
        widened = _widening_into_row_kernel(graph, chain, used, kernel, reasons)
        if widened is None:
            reasons[seed.name] = "a cast alone: torch's copy is the same single pass (no kernel to build)"
        return widened
    if _prologue_of(graph, chain, used):
        step = _reduction_kernel(graph, graph.users(chain.members[-1].name)[0], chain, used, kernel, reasons)
        if step is not None:
            return step
    return _pointwise_kernel(graph, _buildable(graph, chain), kernel)


def _prologue_of(graph: Graph, chain: _Chain, used: set[str]) -> bool:
    """Is the chain's value read only by a reduction that may take the chain as its prologue?"""
    last = chain.members[-1]
    readers = graph.users(last.name)
    return len(readers) == 1 and readers[0].op in GENERATED_BY_ATEN and not graph.is_output(last.name) \
        and not _mixes_dtypes(graph, chain) \
        and readers[0].name not in used and bool(readers[0].args) and readers[0].args[0] == Ref(last.name)


def _selecting_kernel(graph: Graph, seed: Node, used: set[str], kernel: str) -> GenStep | None:
    """The flat kernel of a chain that computes a concatenation of pointwise branches and selects from it
    (kernelfuse.plan.catselect), grown from the concatenation itself or from a pointwise seed whose private
    producers hold one. None where the chain holds none in the end, or where one adds nothing (a concatenation of
    tensors in memory alone, or only with the pointwise prologue of a reduction, which reads it from memory as
    well): the seed is then planned as before."""
    group = cat_group(graph, seed, seed.meta, used, mixed=True) if seed.op == CAT else []
    if group is None or not any(n.op == CAT and n.name not in used for n in graph.nodes):
        return None
    members = [*group, seed] if seed.op == CAT else \
        [*private_producers(graph, seed, set(), seed.meta, used, mixed=True, cats=True), seed]
    chain = _grow(graph, members, seed.meta, used, mixed=True, cats=True)
    cats = [m for m in chain.members if m.op == CAT]
    if not cats or is_comparison(chain.members[-1]) or (not group and _prologue_of(graph, chain, used)):
        return None
    built = _buildable(graph, chain)
    kept = [m for m in built.members if m.op == CAT]
    if len(kept) != len(cats) or not any(m.op in POINTWISE_BY_ATEN for m in built.members):
        return None
    return _pointwise_kernel(graph, built, kernel)


def _widening_into_row_kernel(graph: Graph, chain: _Chain, used: set[str], kernel: str,
                              reasons: dict[str, str]) -> GenStep | None:
    """The kernel of the norm or softmax that alone reads a widening cast (autocast's bf16 -> fp32 before a
    LayerNorm or softmax), with the cast as its prologue: it reads the half-precision source and computes in
    fp32. The widened value is exact, so the kernel's values are those of the cast followed by the op. None where
    the chain is not one such cast or its reader cannot take it."""
    (cast,) = chain.members if len(chain.members) == 1 else (None,)
    if cast is None or cast.op not in CASTS or cast.meta is None or cast.meta.dtype != torch.float32:
        return None
    src = graph[cast.args[0]].meta if isinstance(cast.args[0], Ref) else None
    readers = graph.users(cast.name)
    if src is None or src.dtype not in HALF_DTYPES or len(readers) != 1 or graph.is_output(cast.name):
        return None
    reader = readers[0]
    row = GENERATED_BY_ATEN.get(reader.op)
    if row is None or reader.name in used or not reader.args or reader.args[0] != Ref(cast.name):
        return None
    spec = row.parse(graph, reader)
    if isinstance(spec, str) or spec.kind not in CAST_KINDS or spec.window is not None:
        return None
    return _reduction_kernel(graph, reader, chain, used, kernel, reasons)


def _buildable(graph: Graph, chain: _Chain) -> _Chain:
    """The chain cut back until its operands follow its output's flat order. It may have grown through a reshape
    that regroups a value whose strides cannot be regrouped (a transposed input, a clone, a flatten): the members
    cut off are left to later kernels."""
    members = list(chain.members)
    while len(members) > 1:
        trimmed = _trim_reshapes(graph, members)
        if build_program(graph, trimmed, trimmed[-1].meta, trimmed[-1].meta.shape)[0] is not None:
            break
        members = without_last(trimmed)
    return _Chain(members, {m.name for m in members})


def _grow(graph: Graph, members: list[Node], space: TensorMeta, used: set[str], mixed: bool = False,
          cats: bool = False) -> _Chain:
    """Extend a chain with later pointwise nodes reading it; then shrink until only its last value escapes.
    `mixed`: float dtypes may mix (a pointwise kernel of its own, see can_fuse_pointwise); `cats`: a concatenation
    of pointwise branches may be pulled in (a flat pointwise kernel of its own, kernelfuse.plan.catselect)."""
    inside = {m.name for m in members}
    start = graph.position(members[-1].name)
    for node in graph.nodes[start + 1:]:
        if node.name in used or node.name in inside or not any(r.name in inside for r in node.refs):
            continue
        if can_fuse_pointwise(graph, node, space, mixed)[0]:
            producers = private_producers(graph, node, inside, space, used, mixed, cats)
            if not conditions_inside(node, inside | {p.name for p in producers}):
                continue
            for producer in producers:
                members.append(producer)
                inside.add(producer.name)
            members.append(node)
            inside.add(node.name)
    # in graph order: a producer pulled in for a later node may be what an earlier member read (x > m joined the
    # chain reading m from outside, then where(x > m, m, x) pulled m in; m must be computed before x > m)
    members.sort(key=lambda n: graph.position(n.name))
    while len(members) > 1 and (_escaping(graph, members, inside) or is_comparison(members[-1])):
        members = without_last(members)
        inside = {m.name for m in members}
    return _Chain(members, inside)


def _mixes_dtypes(graph: Graph, chain: _Chain) -> bool:
    """Does the chain compute or read more than one float dtype? Only a pointwise kernel of its own takes such a
    chain; a reduction's prologue keeps one dtype."""
    dtypes = {m.meta.dtype for m in chain.members if m.meta is not None} | \
        {graph[r].meta.dtype for m in chain.members for r in m.refs if graph[r].meta is not None}
    return len(dtypes & set(FLOAT_DTYPES)) > 1


def _escaping(graph: Graph, members: list[Node], inside: set[str]) -> bool:
    """Does a value other than the chain's last one have a reader outside the chain (or leave the graph)?"""
    return any(
        graph.is_output(m.name) or any(u.name not in inside for u in graph.users(m.name))
        for m in members[:-1]
    )


def _reduction_kernel(graph: Graph, node: Node, prologue: _Chain | None, used: set[str], kernel: str,
                      reasons: dict[str, str]) -> GenStep | None:
    spec = GENERATED_BY_ATEN[node.op].parse(graph, node)
    if isinstance(spec, str):
        reasons[node.name] = spec
        return None
    value, extra = _result_value(graph, node, spec)
    if value is None:
        reasons[node.name] = extra  # type: ignore[assignment]
        return None
    out_meta = graph[value].meta
    src_meta = graph[spec.source].meta
    replaces = [*(m.name for m in prologue.members)] if prologue else []
    if prologue is not None:
        source, program = build_program(graph, prologue.members, src_meta, spec.space)
        if source is None:
            reasons[node.name] = "prologue operands cannot follow the reduction's iteration space"
            return _reduction_kernel(graph, node, None, used, kernel, reasons)
    else:
        source = Operand(spec.source, src_meta, spec.source_strides)
        program = Program((), (), spec.space)
    replaces += [node.name, *extra]
    if spec.result is not None:  # a scan's absorbed flip precedes it: the chain reads in graph order
        replaces.sort(key=graph.position)
    # an index result (argmax's int64) takes no epilogue: the float programs cannot hold it, its readers stay
    # torch calls or start kernels of their own (argmin(x, 1).float() * 2: the mul reads the float copy)
    # nor does moments' (mean, 1/std) pairs: their readers take them apart by views
    epi_chain = _grow(graph, [graph[value]], out_meta, used | set(replaces)) \
        if graph.users(value) and out_meta.dtype in FLOAT_DTYPES and spec.kind != "moments" else None
    # the chain in graph order: a producer it pulled in for a later member (floor(s1) in floor(s1) - softmax(x),
    # grown from softmax(x)) may precede the reduction itself, which is not one of its epilogue's statements
    epi_members = [m for m in epi_chain.members if m.name != value] if epi_chain else []
    if epi_members and (graph.is_output(value) or len(graph.users(value)) > 1):
        epi_members = []  # the reduction's value is needed as it is elsewhere
    epi_members, epilogue = _epilogue(graph, epi_members, out_meta, value)
    out = epi_members[-1].name if epi_members else value
    cast = _trailing_cast(graph, spec, out, used | set(replaces) | {m.name for m in epi_members})
    if cast is not None:  # the kernel writes the cast's dtype: one pass over the output fewer
        epi_members = [*epi_members, cast]
        _, epilogue = build_program(graph, epi_members, out_meta, out_meta.shape, acc=value)
        out = cast.name
    replaces += [m.name for m in epi_members]
    reads_as = src_meta.dtype if source.meta.dtype != src_meta.dtype else None  # a widening cast's prologue
    mapped = _broadcast_consumer(graph, spec, value, out, src_meta, used | set(replaces))
    if mapped is not None:  # the row's value is read back by every element of the row: one kernel, not two
        members, consumer = mapped
        replaces += [m.name for m in members]
        return GenStep(kernel, source, program, node, spec, epilogue, members[-1].meta, tuple(replaces),
                       members[-1].name, mapped=consumer, reads_as=reads_as)
    return GenStep(kernel, source, program, node, spec, epilogue, graph[out].meta, tuple(replaces), out,
                   reads_as=reads_as)


CAST_KINDS = ("norm", "softmax", "log_softmax")  # row kernels whose output may be stored in another float dtype


def _trailing_cast(graph: Graph, spec: ReduceSpec, value: str, claimed: set[str]) -> Node | None:
    """The cast to another float dtype that is the only reader of a norm's or softmax's output (autocast casts a
    LayerNorm's fp32 output to bf16 before each Linear), or None. The kernel computes in the source's dtype and
    rounds once to the cast's where it stores (kernelfuse.codegen.iteration.out_ctype)."""
    return _sole_cast(graph, value, claimed) if spec.kind in CAST_KINDS else None


def _sole_cast(graph: Graph, value: str, claimed: set[str]) -> Node | None:
    """The cast to another float dtype that is the only reader of `value`, where a kernel may store it itself."""
    users = graph.users(value)
    if graph.is_output(value) or len(users) != 1:
        return None
    cast = users[0]
    if cast.name in claimed or cast.op != "_to_copy.default" or cast.meta is None \
            or cast.meta.dtype not in FLOAT_DTYPES or cast.meta.dtype == graph[value].meta.dtype:
        return None
    return cast if can_fuse_pointwise(graph, cast, graph[value].meta, mixed=True)[0] else None


def _epilogue(graph: Graph, members: list[Node], out_meta: TensorMeta, value: str) -> tuple[list[Node], Program]:
    """The longest prefix of a reduction's epilogue chain whose operands follow the reduction's output space, and
    its program. A reshape in the chain may regroup that space so that an operand cannot follow it (a norm over
    (1, 8, 5) viewed as (4, 2, 5) and divided by a (4, 1, 1) tensor): the members cut off are left to later
    kernels, never claimed by a kernel that does not compute them."""
    while True:
        _, program = build_program(graph, members, out_meta, out_meta.shape, acc=value)
        if not members or program.statements:
            return members, program
        members = _trim_reshapes(graph, [graph[value], *members[:-1]])[1:]


MAPPED_KINDS = ("sum", "mean", "amax", "amin")  # plain reductions whose value a broadcast consumer may read
MAPPED_MIN_ROWS = 1024  # fewer, longer rows are split across blocks (kernelfuse.codegen.split) and stay two kernels
# Longer rows cannot stay on chip (up to 128 blocks with 48 KB of row each, kernelfuse.codegen.onchip): the one
# kernel would read each row twice, and measured slower than the reduction and a pointwise kernel (level-1
# L1Norm's rows of 65535 before rows were kept on chip: 0.92x eager in one kernel against 1.75x in two).
MAPPED_MAX_ROW = 128 * 48 * 1024 // 4


def _broadcast_consumer(graph: Graph, spec: ReduceSpec, reduced: str, value: str, src_meta: TensorMeta,
                        used: set[str]) -> tuple[list[Node], Program] | None:
    """The pointwise chain over the reduction's source space that reads the row's value `value` (the reduction's
    result `reduced` after the epilogue) as its only reader (RMSNorm's `x / sqrt(mean(x * x) + eps)`, L1/L2
    norms), with the program computing it from that value (`acc`) and its other operands; None when there is
    none. The value must keep the reduction's keepdim shape (the source's, reduced dims 1): the kernel hands each
    element its own row's value, which a reshape after the reduction would reassign."""
    if spec.kind not in MAPPED_KINDS or spec.out_index is not None or spec.rows < MAPPED_MIN_ROWS:
        return None
    if src_meta.numel // spec.rows > MAPPED_MAX_ROW:
        return None
    readers = graph.users(value)
    row_shape = graph[reduced].meta.shape
    keepdim = len(row_shape) == len(src_meta.shape) and all(
        r in (1, s) for r, s in zip(row_shape, src_meta.shape, strict=True))
    if len(readers) != 1 or graph.is_output(value) or not keepdim or graph[value].meta.shape != row_shape:
        return None
    consumer = readers[0]
    if consumer.name in used or consumer.meta is None or consumer.meta.shape != src_meta.shape:
        return None
    if not can_fuse_pointwise(graph, consumer, consumer.meta)[0]:
        return None
    members = _trim_reshapes(graph, _grow(graph, [consumer], consumer.meta, used).members)
    cast = _sole_cast(graph, members[-1].name, used | {m.name for m in members})
    if cast is not None:  # autocast's cast of an RMSNorm's output to bf16 before a Linear: stored as bf16
        members = [*members, cast]
    _, program = build_program(graph, members, consumer.meta, spec.space, acc=value)
    return (members, program) if program.statements else None  # none: an operand cannot follow the space


def _result_value(graph: Graph, node: Node, spec: ReduceSpec) -> tuple[str | None, list[str] | str]:
    """The node carrying the reduction's value, and the getitems the kernel absorbs (all others must be unused)."""
    if spec.result is not None:  # a scan's reverse or exclusive form: the kernel writes the flip back or the cat
        return spec.result, [*spec.absorbs, spec.result]
    if spec.out_index is None:
        return node.name, []
    value, extra = None, []
    for user in graph.users(node.name):
        if user.op != "getitem":
            return None, "multi-output op read without getitem"
        index = user.args[1]
        if index == spec.out_index:
            value = user.name
        elif graph.users(user.name) or graph.is_output(user.name):
            return None, f"its output {index} (statistics or indices) is used"
        extra.append(user.name)
    if value is None:
        return None, "its value is unused"
    return value, extra


def _pointwise_kernel(graph: Graph, chain: _Chain, kernel: str) -> GenStep:
    members = _trim_reshapes(graph, chain.members)
    out_meta = members[-1].meta
    source, program = build_program(graph, members, out_meta, out_meta.shape)
    if source is None:  # the chain's own space: every operand should broadcast to it
        raise ValueError(f"pointwise kernel {kernel}: an operand of {members[-1].name} does not broadcast to its "
                         f"own shape {out_meta.shape}")
    return GenStep(kernel, source, program, None, None, Program((), (), out_meta.shape), out_meta,
                   tuple(m.name for m in members), members[-1].name)


def _trim_reshapes(graph: Graph, members: list[Node]) -> list[Node]:
    """A kernel does not end with a reshape: those stay free views outside it. A trimmed view may read a value
    inside the chain (x / w -> log2 with a view of x / w read by a matmul): that value escapes now, so the chain
    shrinks until only its last value does, or the view's reader would find nothing stored."""
    inside = {m.name for m in members}
    while len(members) > 1 and (members[-1].op in RESHAPES or _escaping(graph, members, inside)):
        members = without_last(members)
        inside = {m.name for m in members}
    return members
