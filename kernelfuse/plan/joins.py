"""Which nodes may join a pointwise chain being grown (kernelfuse.plan.schedule): a pointwise node over the chain's
space, the private producers of its other operands, and a concatenation of pointwise branches whose value only
the chain reads (kernelfuse.plan.catselect), with its branches' private producers."""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.ops import POINTWISE_BY_ATEN
from kernelfuse.ops.anchors import RESHAPES
from kernelfuse.plan.catselect import CAT, cat_operands
from kernelfuse.plan.program import broadcasts, build_program

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def can_fuse_pointwise(graph: Graph, node: Node, space: TensorMeta, mixed: bool = False) -> tuple[bool, str]:
    """Can `node` join a pointwise chain over `space`? As many elements (a reshape keeps the flat order), the same
    float dtype, and every tensor it reads broadcasts to its own shape. A bool tensor in memory may be an operand
    (`x * mask`: loaded as 1.0f or 0.0f, ATen's promotion), beside at least one operand of the kernel's dtype.
    A comparison of such values (a bool result) may join as well, and a where/masked_fill may read one as its
    condition: inside a kernel the condition is a 1.0f/0.0f float that is never stored (the chain checks that it
    is computed inside, `conditions_inside`). `mixed`: a chain of a pointwise kernel of its own may mix float
    dtypes (a bf16 Linear output added to an fp32 residual, autocast's casts): each operand is loaded from its
    own type and each value rounded to its own (kernelfuse.codegen.common.program_lines)."""
    if node.op not in POINTWISE_BY_ATEN and node.op not in RESHAPES:
        return False, "not a pointwise op of the table"
    if node.meta is None or not (node.meta.dtype in FLOAT_DTYPES or is_comparison(node)):
        return False, "not a floating-point tensor"
    if node.meta.numel != space.numel or (node.meta.dtype != space.dtype and not is_comparison(node)
                                          and not mixed):
        return False, f"size or dtype differs from the kernel's {space}"
    if node.op in RESHAPES:
        return (True, "") if len(node.refs) == 1 else (False, "reshape of a computed shape")
    row = POINTWISE_BY_ATEN[node.op]
    if row.keywords is not None and tuple(sorted(node.keywords)) != row.keywords:
        return False, f"called with {sorted(node.keywords)}, the kernel takes {list(row.keywords)}"
    conditions = condition_refs(node)
    for ref in node.refs:
        meta = graph[ref].meta
        in_kernel_bool = ref in conditions and is_comparison(graph[ref])
        promoted = meta is not None and meta.dtype == torch.bool and ref not in conditions  # loaded as 1.0f/0.0f
        other = meta is not None and meta.dtype != space.dtype and not (mixed and meta.dtype in FLOAT_DTYPES)
        if meta is None or (other and not in_kernel_bool and not promoted):
            return False, f"operand %{ref.name} has another dtype"
        if not broadcasts(meta.shape, node.meta.shape):
            return False, f"operand %{ref.name} does not broadcast to the output"
    floats = [graph[r].meta.dtype for r in node.refs if graph[r].meta is not None]
    if not any(d == space.dtype or (mixed and d in FLOAT_DTYPES) for d in floats):
        return False, "no operand of the kernel's dtype (a bool tensor in memory is an operand, never the source)"
    return True, ""


def is_comparison(node: Node) -> bool:
    row = POINTWISE_BY_ATEN.get(node.op)
    return row is not None and row.result == "bool" and node.meta is not None and node.meta.dtype == torch.bool


def condition_refs(node: Node) -> set[Ref]:
    """The operands `node` reads as a bool condition (where's first, masked_fill's mask)."""
    row = POINTWISE_BY_ATEN.get(node.op)
    if row is None:
        return set()
    return {node.args[i] for i in row.bool_args if i < len(node.args) and isinstance(node.args[i], Ref)}


def conditions_inside(node: Node, inside: set[str]) -> bool:
    """Every bool condition `node` reads is computed in the kernel (a bool tensor in memory would be read as
    floats)."""
    return all(ref.name in inside for ref in condition_refs(node))


def private_producers(graph: Graph, node: Node, inside: set[str], space: TensorMeta, used: set[str],
                      mixed: bool = False, cats: bool = False) -> list[Node]:
    """The pointwise nodes, in graph order, that compute `node`'s other operands over the same space and are read
    by nothing else: the chain pulls them in (x * f(x): the f(x) branch joins the kernel that multiplies, instead
    of a kernel of its own whose output makes a round trip through memory). `cats`: a concatenation so read joins
    too, with its branches (`cat_group`)."""
    pulled: list[Node] = []
    taken = set(inside) | {node.name}

    def pull(n: Node) -> None:
        for ref in n.refs:
            p = graph[ref]
            if p.name in taken or p.name in used or graph.is_output(p.name) or \
                    any(u.name not in taken for u in graph.users(p.name)):
                continue
            if cats and p.op == CAT:
                group = cat_group(graph, p, space, used | taken, mixed)
                if group is not None:
                    taken.update([p.name, *(m.name for m in group)])
                    pulled.extend([*group, p])
                continue
            if p.op not in POINTWISE_BY_ATEN:
                continue  # a reshape stays a free view outside the kernel
            if can_fuse_pointwise(graph, p, space, mixed)[0]:
                taken.add(p.name)
                pull(p)
                pulled.append(p)

    pull(node)
    return sorted(pulled, key=lambda n: graph.position(n.name))


def cat_group(graph: Graph, cat: Node, space: TensorMeta, used: set[str], mixed: bool = False) -> list[Node] | None:
    """The branch members of a concatenation that may join a chain over `space` (as many elements, its dtype
    unless `mixed`), in graph order: for each operand, the pointwise nodes of the branch's shape computing it that
    nothing else reads (an operand read twice, or by a node outside, is read from memory through its window).
    None where the concatenation cannot join: see cat_operands; a bool condition read from memory; an operand
    whose strides cannot be read so."""
    parsed = cat_operands(graph, cat)
    if parsed is None or cat.name in used or cat.meta.dtype not in FLOAT_DTYPES or cat.meta.numel != space.numel \
            or (cat.meta.dtype != space.dtype and not mixed):
        return None
    refs = parsed[1]
    group: list[Node] = []
    for ref in refs:
        members = _branch(graph, graph[ref], cat, used, mixed) if refs.count(ref) == 1 else []
        names = {m.name for m in members}
        if not all(conditions_inside(m, names) for m in members):
            return None
        group += members
    group.sort(key=lambda n: graph.position(n.name))
    if build_program(graph, [*group, cat], cat.meta, cat.meta.shape)[0] is None:
        return None
    return group


def _branch(graph: Graph, head: Node, cat: Node, used: set[str], mixed: bool) -> list[Node]:
    """The pointwise nodes computing a concatenation's operand `head` over its branch's shape that nothing but the
    branch reads (`head` itself first, if it is one)."""
    branch = TensorMeta(head.meta.shape, cat.meta.dtype, contiguous_strides(head.meta.shape))  # type: ignore[union-attr]
    taken, members = {cat.name}, []

    def pull(n: Node) -> None:
        if n.name in taken or n.name in used or n.op not in POINTWISE_BY_ATEN or graph.is_output(n.name) \
                or n.meta is None or n.meta.shape != branch.shape \
                or any(u.name not in taken for u in graph.users(n.name)) \
                or not can_fuse_pointwise(graph, n, branch, mixed)[0]:
            return
        taken.add(n.name)
        members.append(n)
        for ref in n.refs:
            pull(graph[ref])

    pull(head)
    return members


def without_last(members: list[Node]) -> list[Node]:
    """The chain less its last member; less a concatenation's branch members too where that is one (they are
    computed only for it)."""
    last = members[-1]
    if last.op != CAT:
        return members[:-1]
    inside = {m.name: m for m in members[:-1]}
    branch, stack = set(), [r.name for r in last.refs]
    while stack:
        name = stack.pop()
        if name in inside and name not in branch:
            branch.add(name)
            stack.extend(r.name for r in inside[name].refs)
    return [m for m in members[:-1] if m.name not in branch]
