"""Build Plans from a Graph: each library anchor takes the pointwise ops behind it as a fused epilogue.

Fusion is greedy and conservative: a pointwise node joins an anchor's epilogue when its output has the anchor's
shape and dtype, and every tensor it reads is either already in the epilogue or computed before it (a bias, an
input, a parameter). An epilogue member whose value is needed outside the epilogue (another user, a graph
output) ends the epilogue before it. Every refusal keeps the node as a torch call with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta, contiguous_strides
from kernelfuse.ops import ANCHOR_OPS, POINTWISE_BY_ATEN, VIEW_OPS
from kernelfuse.ops.anchors import family_of
from kernelfuse.plan.ir import Anchor, EArg, Epilogue, FusedStep, Operand, Plan, Statement, Step, TorchStep

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PlanOptions:
    """Planner knobs. `max_fusions` caps how many anchors take an epilogue (bisect a numerical bug to one)."""

    conv_layout: str = "nhwc"  # "nhwc" | "nchw"
    cudnn_fused_relu: bool = True
    matmul_tf32: bool = False  # the tf32 policy: matrix products on TF32 tensor cores
    max_fusions: int | None = None


def plan_variants(graph: Graph, precision: str = "strict") -> list[Plan]:
    """The fused plans worth measuring: one per convolution layout when the graph has a convolution.

    Under the tf32 policy matrix products may run on TF32 tensor cores (cuDNN convolutions already do by default).
    """
    has_conv = any(ANCHOR_OPS.get(n.op) == "conv" for n in graph.nodes)
    layouts = ("nhwc", "nchw") if has_conv else ("nchw",)
    tf32 = precision == "tf32"
    return [make_plan(graph, PlanOptions(conv_layout=layout, matmul_tf32=tf32)) for layout in layouts]


def make_plan(graph: Graph, options: PlanOptions = PlanOptions()) -> Plan:
    fused: dict[str, FusedStep] = {}  # root node name -> step
    absorbed: set[str] = set()
    for node in graph.nodes:
        if node.name in absorbed or node.op not in ANCHOR_OPS or node.meta is None:
            continue
        if options.max_fusions is not None and len(fused) >= options.max_fusions:
            break
        ok, _ = anchor_supported(graph, node)
        if not ok:
            continue
        step = _fuse_behind(graph, node, options, kernel=f"k{len(fused)}")
        if step is None:
            continue
        fused[step.out] = step
        absorbed.update(step.replaces)
    steps: list[Step] = []
    for node in graph.nodes:
        if node.name in fused:
            steps.append(fused[node.name])
        elif node.name not in absorbed and node.op not in ("input", "param", "buffer"):
            steps.append(TorchStep(node, _unfused_reason(graph, node)))
    variant = "fused" if not any(s.anchor.family == "conv" for s in fused.values()) else f"fused-{options.conv_layout}"
    if options.matmul_tf32 and any(s.anchor.tf32 for s in fused.values()):
        variant += "-tf32"
    return Plan(graph, tuple(steps), variant)


def anchor_supported(graph: Graph, node: Node) -> tuple[bool, str]:
    """(ok, reason): can this library call take an epilogue? Checked on the real shapes and dtypes."""
    if node.meta.dtype not in FLOAT_DTYPES:
        return False, f"dtype {node.meta.dtype} not fused"
    if not node.meta.is_contiguous:
        return False, "non-contiguous library output"
    if ANCHOR_OPS[node.op] == "conv":
        weight = graph[node.args[1]].meta
        transposed = node.args[6]
        if weight is None or len(weight.shape) != 4 or transposed:
            return False, "only 2-d, non-transposed convolution is fused"
    return True, ""


def _fuse_behind(graph: Graph, anchor_node: Node, options: PlanOptions, kernel: str) -> FusedStep | None:
    family = ANCHOR_OPS[anchor_node.op]
    users = graph.users(anchor_node.name)
    fused_relu = (
        family == "conv" and options.cudnn_fused_relu and len(users) == 1 and users[0].op == "relu.default"
        and not graph.is_output(anchor_node.name)
    )
    inside = {anchor_node.name}
    acc_name = anchor_node.name
    if fused_relu:
        inside.add(users[0].name)
        acc_name = users[0].name
    members = _grow(graph, anchor_node, inside)
    if family == "conv" and options.conv_layout == "nhwc" and not members and not fused_relu:
        return None  # a lone convolution: nothing to fuse, the torch call is as good
    if family == "matmul" and not members:
        return None
    out_node = graph[members[-1].name] if members else graph[acc_name]
    epilogue = _epilogue(graph, members, acc_name, out_node.meta)
    anchor = Anchor(anchor_node, family, fused_relu, options.conv_layout if family == "conv" else "nchw",
                    tf32=options.matmul_tf32 and family == "matmul")
    replaces = (anchor_node.name,) + ((acc_name,) if fused_relu else ()) + tuple(m.name for m in members)
    return FusedStep(kernel, anchor, epilogue, replaces, out_node.name)


def _grow(graph: Graph, anchor_node: Node, inside: set[str]) -> list[Node]:
    out_meta = anchor_node.meta
    members: list[Node] = []
    start = graph.nodes.index(anchor_node)
    for node in graph.nodes[start + 1:]:
        if node.name in inside or node.op not in POINTWISE_BY_ATEN or node.meta is None:
            continue
        refs = node.refs
        if not any(r.name in inside for r in refs):
            continue
        if node.meta.shape != out_meta.shape or node.meta.dtype != out_meta.dtype:
            continue
        if not all(r.name in inside or _operand_ok(graph[r], out_meta) for r in refs):
            continue
        members.append(node)
        inside.add(node.name)
    # Shrink until only the last member's value is needed outside the epilogue.
    while members:
        escaping = [
            name for name in [anchor_node.name, *(n for n in inside if n != anchor_node.name)]
            if name != members[-1].name
            and (graph.is_output(name) or any(u.name not in inside for u in graph.users(name)))
        ]
        if not escaping:
            break
        inside.discard(members.pop().name)
    return members


def _operand_ok(node: Node, out: TensorMeta) -> bool:
    meta = node.meta
    if meta is None or meta.dtype != out.dtype or len(meta.shape) > len(out.shape):
        return False
    if not _dense(meta):  # the kernel wrappers accept contiguous operands only (a transposed weight, an expand)
        return False
    offset = len(out.shape) - len(meta.shape)
    return all(d in (1, out.shape[i + offset]) for i, d in enumerate(meta.shape))


def _dense(meta: TensorMeta) -> bool:
    """Contiguous as torch's `is_contiguous()` sees it: the strides of size-1 dimensions do not matter."""
    expected = contiguous_strides(meta.shape)
    return meta.numel == 0 or all(d == 1 or s == e for d, s, e in zip(meta.shape, meta.stride, expected, strict=True))


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


def _epilogue(graph: Graph, members: list[Node], acc_name: str, out: TensorMeta) -> Epilogue:
    names: dict[str, str] = {acc_name: "acc"}
    operands: list[Operand] = []
    statements: list[Statement] = []

    def value(arg: object) -> EArg:
        if isinstance(arg, Ref):
            if arg.name in names:
                return names[arg.name]
            names[arg.name] = f"in{len(operands)}"
            node = graph[arg]
            operands.append(Operand(arg, node.meta, broadcast_strides(node.meta, out)))
            return names[arg.name]
        return float(arg)  # a Python scalar operand (ATen computes it in the float opmath type)

    for node in members:
        row = POINTWISE_BY_ATEN[node.op]
        args = tuple(value(node.args[i]) if i < len(node.args) else 0.0 for i in row.operands)
        params = tuple(_param(node, pos, default) for pos, default in row.params)
        statements.append(Statement(node.name, row.ir, row.aten, args, params))
        names[node.name] = node.name
    return Epilogue(tuple(statements), tuple(operands), out)


def _param(node: Node, pos: int | str, default: object) -> object:
    """A constant argument by keyword name or by position; an omitted or None (optional) one is the default."""
    if isinstance(pos, str):
        for a in node.args:
            if isinstance(a, tuple) and len(a) == 3 and a[0] == "kw" and a[1] == pos:
                return default if a[2] is None else a[2]
        return default
    plain = [a for a in node.args if not (isinstance(a, tuple) and len(a) == 3 and a[0] == "kw")]
    value = plain[pos] if pos < len(plain) else default
    return default if value is None else value


def _unfused_reason(graph: Graph, node: Node) -> str:
    if node.op in VIEW_OPS:
        return "view"
    family = family_of(node.op)
    if node.op in ANCHOR_OPS:
        ok, why = anchor_supported(graph, node)
        return "library call, nothing to fuse behind it" if ok else f"library call: {why}"
    if node.op in POINTWISE_BY_ATEN:
        return "pointwise op not fused: no library call before it, or its input is needed elsewhere"
    return f"{family}: no kernel yet"
