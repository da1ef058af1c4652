"""A generated kernel's members as a Program (kernelfuse.plan.ir): their statements in order, the value entering
the kernel (its source), and every other tensor read as an operand with its strides mapped onto the kernel's
iteration space. The scheduler (kernelfuse.plan.schedule) decides the members; this module only writes them down."""

from __future__ import annotations

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.ops import POINTWISE_BY_ATEN
from kernelfuse.ops.anchors import RESHAPES
from kernelfuse.plan.catselect import CAT, SELECT, branch_windows, cat_windows
from kernelfuse.plan.ir import EArg, Operand, Program, Statement, Window


def build_program(graph: Graph, members: list[Node], meta: TensorMeta, space: tuple[int, ...],
             acc: str | None = None) -> tuple[Operand | None, Program]:
    """Statements for `members` over `space`; the first tensor the first member reads from outside is the source
    (`acc`) unless `acc` names the value entering the program. Operand strides are mapped onto `space`, or for a
    read inside a concatenation's branch onto the concatenation's shape through a window (where that is not the
    space, a reshape after it, the program's flat index must be the concatenation's: the output is contiguous)."""
    names: dict[str, str] = {acc: "acc"} if acc else {}
    read: dict[tuple[str, Window], str] = {}  # the windowed reads
    operands: list[Operand] = []
    shape = meta.shape
    source: list[Operand] = []
    windows = branch_windows(graph, members)
    selects = any(m.op == CAT for m in members)
    # a select over the kernel's own space is addressed through it (kernelfuse.codegen.iteration.windows_in_space),
    # so the output may keep a permuted layout; one reshaped after it reads the flat index, row-major
    over_space = all(tuple(m.meta.shape) == tuple(space) for m in members if m.op == CAT)
    ok = windows is not None and (not selects or over_space or meta.stride == contiguous_strides(meta.shape))
    windows = windows or {}
    inside = {m.name for m in members}
    preferred = None if acc else _full_size_source(graph, members, meta, set(windows))

    def value(arg: object, window: Window | None = None) -> EArg:
        nonlocal ok
        if not isinstance(arg, Ref):
            return float(arg)  # type: ignore[arg-type]
        if arg.name in names and (window is None or arg.name in windows):
            return names[arg.name]
        if window is not None and (arg.name in inside or arg.name == acc):  # a value of the kernel outside the branch
            ok = False
        if window is not None and (arg.name, window) in read:
            return read[(arg.name, window)]
        node = graph[arg]
        if window is not None:
            branch = window.branch_shape
            strides = broadcast_strides(node.meta, TensorMeta(branch, node.meta.dtype, contiguous_strides(branch)))
        else:
            strides = space_strides(node.meta, shape, space)
        if strides is None:
            ok = False
            strides = (0,) * len(space)
        operand = Operand(arg, node.meta, strides, window)
        # a bool mask is read as an operand; a windowed read is the source only where no plain one is full-size
        if not source and acc is None and node.meta.dtype != torch.bool \
                and (arg.name == preferred if preferred else True) and (window is None or preferred is None):
            source.append(operand)
            name = "acc"
        else:
            name = f"in{len(operands)}"
            operands.append(operand)
        if window is None:
            names[arg.name] = name
        else:
            read[(arg.name, window)] = name
        return name

    statements = []
    for node in members:
        shape = node.meta.shape
        if node.op == CAT:  # each branch's value where the element lies in it
            parts = cat_windows(graph, node)
            params = (parts[0][1].dim, tuple(w.size for _, w in parts), tuple(shape))
            args = tuple(value(ref, window) for ref, window in parts)
            statements.append(Statement(node.name, SELECT, node.op, args, params, node.meta.dtype))
            names[node.name] = node.name
            continue
        if node.op in RESHAPES:  # the same elements in the same order: a new shape, the same flat index
            statements.append(Statement(node.name, "reshape", node.op, (value(node.args[0]),), (shape,)))
            names[node.name] = node.name
            continue
        row = POINTWISE_BY_ATEN[node.op]  # inside a branch, every tensor is read through the branch's window
        args = tuple(value(a, windows.get(node.name)) for a in _read_args(node))
        params = tuple(constant_arg(node, pos, default) for pos, default in row.params)
        statements.append(Statement(node.name, row.ir, row.aten, args, params, node.meta.dtype))
        names[node.name] = node.name
    src = source[0] if source else None
    if not ok:
        return None, Program((), (), space)
    if src is None and acc is None:
        return None, Program((), (), space)
    return src, Program(tuple(statements), tuple(operands), space)


def _read_args(node: Node) -> tuple[object, ...]:
    """The values a program member reads, in the order build_program meets them: a reshape's source, else the
    table row's operands (0.0 for one the call left out)."""
    if node.op in RESHAPES:
        return (node.args[0],)
    return tuple(node.args[i] if i < len(node.args) else 0.0 for i in POINTWISE_BY_ATEN[node.op].operands)


def _full_size_source(graph: Graph, members: list[Node], meta: TensorMeta, branches: set[str]) -> str | None:
    """The tensor a pointwise kernel reads as its source: the first one it reads from outside that has every
    element of the output (`A.unsqueeze(1) * B`: B, not the broadcast A), so that the source and the output share
    their strides and the kernel moves 16 bytes per access; None (the first one read) where none does. Which
    tensor is the source changes no arithmetic: the statements name their arguments. Reads inside a
    concatenation (`branches`: its branch members) are through windows, never full-size."""
    inside = {m.name for m in members}
    for node in members:
        if node.op == CAT or node.name in branches:
            continue
        for arg in _read_args(node):
            if isinstance(arg, Ref) and arg.name not in inside:
                m = graph[arg].meta
                if m is not None and m.dtype != torch.bool and m.shape == meta.shape and m.stride == meta.stride:
                    return arg.name
    return None


def space_strides(meta: TensorMeta, shape: tuple[int, ...], space: tuple[int, ...]) -> tuple[int, ...] | None:
    """The element strides of a tensor broadcast to `shape`, viewed as `space` (a regrouping of `shape`), or None
    when that view does not exist (its layout cannot follow the regrouping)."""
    strides = broadcast_strides(meta, TensorMeta(tuple(shape), meta.dtype, tuple(shape)))
    if tuple(shape) == tuple(space):
        return strides
    probe = torch.empty_strided(shape, strides, device="meta")
    try:
        return tuple(probe.view(space).stride())
    except RuntimeError:
        return None


def broadcast_strides(meta: TensorMeta, out: TensorMeta) -> tuple[int, ...]:
    """The operand's element stride along each output dimension; 0 where it broadcasts."""
    offset = len(out.shape) - len(meta.shape)
    strides = []
    for d in range(len(out.shape)):
        k = d - offset
        if k < 0 or (meta.shape[k] == 1 and out.shape[d] != 1):
            strides.append(0)
        else:
            strides.append(meta.stride[k])
    return tuple(strides)


def broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    if len(shape) > len(out):
        return False
    offset = len(out) - len(shape)
    return all(d in (1, out[i + offset]) for i, d in enumerate(shape))


def constant_arg(node: Node, pos: int | str, default: object) -> object:
    """A constant argument by keyword name or by position; an omitted or None (optional) one is the default."""
    if isinstance(pos, str):
        got = node.keywords.get(pos, default)
        return default if got is None else got
    plain = node.positional
    got = plain[pos] if pos < len(plain) else default
    return default if got is None else got
