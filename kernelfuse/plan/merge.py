"""Anchor epilogues that move into the reduction kernel reading them: the anchor writes its raw output once, and
the reduction's prologue applies the epilogue as it reads (one pass over the output, not two)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.ops.anchors import RESHAPES
from kernelfuse.plan.ir import Epilogue, FusedStep, GenStep, Operand, Program, Statement, Step
from kernelfuse.plan.layout import channels_last_strides
from kernelfuse.plan.program import space_strides


def merge_into_reductions(graph: Graph, by_out: dict[str, Step]) -> None:
    """An anchor epilogue whose value only a reduction kernel reads (as its source, and maybe in its epilogue:
    `recomputed_in_epilogue`) joins that kernel's prologue: in place (NCHW), or straight from a channels-last
    convolution's output, which the reduction then reads through its strides. A value several generated kernels
    read, each as its source only, a reduction among them (a norm's statistics and the kernel its normalisation
    moved into, kernelfuse.rewrite.norms), joins each of their prologues: recomputed per kernel, never stored (and
    a channels-last convolution's output is read by each through its strides)."""
    gens: dict[str, list[GenStep]] = {}  # the reduction kernels by source
    readers: dict[str, list[GenStep]] = {}  # every generated kernel by source
    for s in by_out.values():
        if isinstance(s, GenStep):
            readers.setdefault(s.source.ref.name, []).append(s)
            if s.spec is not None:
                gens.setdefault(s.source.ref.name, []).append(s)
    through = _reshaped_sources(graph, {name: found[0] for name, found in gens.items() if len(found) == 1})
    for name, step in list(by_out.items()):
        if not isinstance(step, FusedStep) or step.anchor.epilogue_inside or not (
                step.inplace and step.epilogue.statements or step.anchor.layout == "nhwc"):
            continue
        if graph.is_output(name):
            continue
        several = readers.get(name, [])
        if len(several) > 1 and name in gens:
            joined = [_joined(graph, step, gen, None) for gen in several] \
                if _read_as_sources_only(graph, several, name) else []
            if joined and all(j is not None for j in joined):
                acc_name, anchor_only = _anchor_only(graph, step)
                del by_out[name]
                by_out[acc_name] = anchor_only
                by_out.update({j.out: j for j in joined})  # type: ignore[union-attr]
            continue
        gen, reshape = (gens[name][0], None) if name in gens else through.get(name, (None, None))
        if reshape is not None and not step.inplace:
            continue  # a channels-last source regrouped: its rows' elements lie C apart, one thread per long row
        if gen is None:
            continue
        if len(graph.users(name)) != 1:  # its norm's residual, say: recomputed in the epilogue, never stored
            gen = recomputed_in_epilogue(graph, step, gen, name) if reshape is None else None
            if gen is None:
                continue
        merged = _joined(graph, step, gen, reshape)
        if merged is None:
            continue
        acc_name, anchor_only = _anchor_only(graph, step)
        del by_out[name]
        by_out[acc_name] = anchor_only
        by_out[gen.out] = merged


def _read_as_sources_only(graph: Graph, gens: list[GenStep], name: str) -> bool:
    """Is every reader of `name` inside one of `gens`, each reading it as its source only (no operand of theirs
    is `name`)?"""
    inside = {n for gen in gens for n in gen.replaces}
    programs = [p for gen in gens for p in (gen.prologue, gen.epilogue, gen.mapped) if p is not None]
    return all(u.name in inside for u in graph.users(name)) and \
        not any(o.ref.name == name for p in programs for o in p.operands)


def _anchor_only(graph: Graph, step: FusedStep) -> tuple[str, FusedStep]:
    """The anchor without its epilogue, writing its raw output (in its own layout), and that output's name."""
    acc_name = step.replaces[1] if step.anchor.fused_relu else step.replaces[0]
    acc_meta = graph[acc_name].meta
    if step.anchor.layout == "nhwc":
        acc_meta = replace(acc_meta, stride=channels_last_strides(acc_meta.shape))
    return acc_name, replace(step, epilogue=Epilogue((), (), acc_meta), replaces=step.replaces[
        :len(step.replaces) - len(step.epilogue.statements)], out=acc_name, keeps_layout=step.anchor.layout == "nhwc")


def _joined(graph: Graph, step: FusedStep, gen: GenStep, reshape: Node | None) -> GenStep | None:
    """`gen` reading the anchor's raw output, the anchor's epilogue statements first in its prologue (through
    `reshape`, a same-order regrouping, where its source is one); None where an operand cannot follow its space."""
    acc_name, anchor_only = _anchor_only(graph, step)
    acc_meta = anchor_only.epilogue.out
    source_strides = space_strides(acc_meta, acc_meta.shape, gen.prologue.space)
    operands = [space_strides(o.meta, step.epilogue.out.shape, gen.prologue.space) for o in step.epilogue.operands]
    if source_strides is None or any(s is None for s in operands):
        return None
    first = [Operand(o.ref, o.meta, s) for o, s in zip(step.epilogue.operands, operands, strict=True)]  # type: ignore[arg-type]
    shift = len(first)
    regroup = () if reshape is None else (  # same flat order: a rename inside the kernel
        Statement(reshape.name, "reshape", reshape.op, (step.epilogue.result,), (gen.prologue.space,)),)
    renamed = {"acc": reshape.name if reshape is not None else step.epilogue.result}
    renamed.update({f"in{i}": f"in{i + shift}" for i in range(len(gen.prologue.operands))})
    later = tuple(replace(st, args=tuple(renamed.get(a, a) if isinstance(a, str) else a for a in st.args))
                  for st in gen.prologue.statements)
    prologue = Program(step.epilogue.statements + regroup + later, tuple(first) + gen.prologue.operands,
                       gen.prologue.space)
    return replace(gen, source=Operand(Ref(acc_name), acc_meta, source_strides), prologue=prologue,
                   replaces=tuple(s.name for s in step.epilogue.statements + regroup) + gen.replaces)


def _reshaped_sources(graph: Graph, gens: dict[str, GenStep]) -> dict[str, tuple[GenStep, Node]]:
    """Reduction kernels whose source is a reshape (same flat order) of a value only that reshape reads, keyed by
    that value: an NCHW anchor's epilogue can join them through the reshape (a softmax over
    `conv(x).view(n, c, -1)`: the epilogue runs in the softmax's prologue, not in a pass of its own)."""
    found = {}
    for source, gen in gens.items():
        node = graph[source]
        refs = node.refs
        if node.op in RESHAPES and len(refs) == 1 and len(graph.users(source)) == 1 and not graph.is_output(source):
            found[refs[0].name] = (gen, node)
    return found


def recomputed_in_epilogue(graph: Graph, step: FusedStep, gen: GenStep, name: str) -> GenStep | None:
    """`gen` (the reduction kernel whose source is the anchor epilogue's value `name`), with its epilogue's other
    reads of `name` (a norm's residual: GroupNorm(x) + x) recomputed from the anchor's raw output and the anchor
    epilogue's operands, by the anchor epilogue's own statements (the same values): once the epilogue joins the
    reduction's prologue, `name` is never stored. None where `name` has readers outside the kernel or in its
    prologue, or an operand cannot follow the epilogue's space; and outside fp32, where the epilogue would round
    the recomputed value otherwise than the anchor's epilogue did."""
    epi = gen.epilogue
    if {graph[name].meta.dtype, gen.out_meta.dtype, step.anchor.node.meta.dtype} != {torch.float32}:
        return None
    reads = [i for i, o in enumerate(epi.operands) if o.ref.name == name]
    inside = set(gen.replaces)
    if not reads or not step.epilogue.statements or any(u.name not in inside for u in graph.users(name)) \
            or any(o.ref.name == name for o in gen.prologue.operands) \
            or (gen.mapped is not None and any(o.ref.name == name for o in gen.mapped.operands)):
        return None
    acc_name = step.replaces[1] if step.anchor.fused_relu else step.replaces[0]
    acc_meta = graph[acc_name].meta
    if step.anchor.layout == "nhwc":
        acc_meta = replace(acc_meta, stride=channels_last_strides(acc_meta.shape))
    shape = step.epilogue.out.shape
    raw = space_strides(acc_meta, shape, epi.space)
    extra = [space_strides(o.meta, shape, epi.space) for o in step.epilogue.operands]
    aligned = space_strides(graph[name].meta, shape, epi.space)  # each read is of the element being written
    if raw is None or any(s is None for s in extra) or aligned is None \
            or any(tuple(epi.operands[i].strides) != tuple(aligned) for i in reads):
        return None
    kept = [i for i in range(len(epi.operands)) if i not in reads]
    base = len(kept) + 1  # the raw output is operand len(kept), the anchor epilogue's own operands follow it
    renamed = {f"in{i}": f"in{j}" for j, i in enumerate(kept)}
    renamed.update({f"in{i}": step.epilogue.result for i in reads})
    anchor_names = {"acc": f"in{len(kept)}", **{f"in{j}": f"in{base + j}" for j in range(len(extra))}}
    again = tuple(replace(st, args=tuple(anchor_names.get(a, a) if isinstance(a, str) else a for a in st.args))
                  for st in step.epilogue.statements)
    later = tuple(replace(st, args=tuple(renamed.get(a, a) if isinstance(a, str) else a for a in st.args))
                  for st in epi.statements)
    operands = (*(epi.operands[i] for i in kept), Operand(Ref(acc_name), acc_meta, raw),
                *(Operand(o.ref, o.meta, s) for o, s in zip(step.epilogue.operands, extra, strict=True)))
    return replace(gen, epilogue=Program(again + later, operands, epi.space))
