"""Execute a Plan with torch ops on any device: the CPU check that a plan computes what the model computes.

Anchors run as their torch calls, epilogue statements through each op-table row's torch reference, in the
plan's order. It checks the plan's semantics (which ops were fused, operand binding, order), not CUDA code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.capture.graph import constant_value
from kernelfuse.ops import POINTWISE_BY_ATEN
from kernelfuse.ops.scans import SCAN_KINDS, scan_reference
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.catselect import SELECT, selected, windowed
from kernelfuse.plan.ir import AttnStep, Epilogue, FusedStep, GenStep, Operand, Plan, Program, TorchStep


def interpret(plan: Plan, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run `plan` on `state` (parameters and buffers by attribute path) and the graph's input tensors (flat, as
    `plan.graph.call_spec` orders them); the output tensors come back flat too."""
    env = run_env(plan, state, inputs)
    return [env[r.name] for r in plan.graph.outputs]  # type: ignore[misc]


def run_env(plan: Plan, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor],
            rounded: bool = False) -> dict[str, object]:
    """Every value the plan computes, by graph node name (benchmarks and kernel tests feed one step from it).
    `rounded`: each torch call computed in float64 and rounded once to its dtype (`call_aten_rounded`)."""
    call = call_aten_rounded if rounded else call_aten
    env: dict[str, object] = {}
    for node in plan.graph.nodes:
        if node.op == "input":
            env[node.name] = inputs[int(node.target)]  # type: ignore[arg-type]
        elif node.op in ("param", "buffer"):
            env[node.name] = state[str(node.target)]
    for step in plan.steps:
        if isinstance(step, TorchStep):
            env[step.node.name] = call(step.node, env)
        elif isinstance(step, GenStep):  # the kernel writes a new tensor: contiguous, or eager's permuted layout
            value = _run_generated(step, env)
            if tuple(value.shape) != tuple(step.out_meta.shape):  # a norm over a view computes in its own space
                value = value.reshape(step.out_meta.shape)  # (N, G, ...): the kernel writes the output's elements
            env[step.out] = _laid_out(value, step.out_strides)
        elif isinstance(step, AttnStep):
            env[step.out] = attention_reference(step, *(env[i.ref.name] for i in step.inputs[:3]),  # type: ignore[arg-type]
                                                env[step.mask.ref.name] if step.mask else None,  # type: ignore[arg-type]
                                                env[step.windows.ref.name] if step.windows else None)  # type: ignore[arg-type]
        else:
            env[step.out] = run_fused(plan.graph, step, env)
    return env


def call_aten(node: Node, env: dict[str, object]) -> object:
    """Call the node's ATen overload with its arguments looked up in `env`."""
    if node.op == "getitem":
        return env[node.args[0].name][node.args[1]]  # type: ignore[index,union-attr]
    if node.op == "constant":
        return constant_value(node)
    packet, overload = node.op.split(".")
    fn = getattr(getattr(torch.ops.aten, packet), overload)
    args = [_value(a, env) for a in node.positional]
    return fn(*args, **{k: _value(v, env) for k, v in node.keywords.items()})


def call_aten_rounded(node: Node, env: dict[str, object]) -> object:
    """The node's op computed in float64 on its floating operands, each result rounded once to the dtype eager's
    call returns: the op sequence as if every op were correctly rounded. Views, in-place ops and random ops are
    called as they are (a view must alias; a random draw differs between dtypes)."""
    value = call_aten(node, env)
    if not _roundable(node, value):
        return value
    try:
        wide = call_aten(node, {r.name: _widened(env[r.name]) for r in node.refs})
    except (RuntimeError, TypeError, NotImplementedError):  # an op without a float64 kernel: eager's value stands
        return value
    if isinstance(value, torch.Tensor):
        return _narrowed(value, wide)
    if not isinstance(wide, (tuple, list)) or len(wide) != len(value):  # type: ignore[arg-type]
        return value
    return type(value)(_narrowed(v, w) for v, w in zip(value, wide, strict=True))  # type: ignore[arg-type,call-arg]


RANDOM_OPS = ("bernoulli", "dropout", "rand", "normal", "uniform", "multinomial", "exponential")  # words of op names


def _roundable(node: Node, value: object) -> bool:
    if node.op in ("getitem", "constant") or any(word in node.op for word in RANDOM_OPS):
        return False
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float64 for v in values):
        return False
    packet, overload = node.op.split(".")
    schema = getattr(getattr(torch.ops.aten, packet), overload)._schema
    return not any(a.alias_info is not None for a in (*schema.returns, *schema.arguments))


def _widened(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, (tuple, list)):
        return type(value)(_widened(v) for v in value)  # type: ignore[call-arg]
    return value


def _narrowed(value: object, wide: object) -> object:
    """`wide` rounded into `value`'s dtype and layout, where both are tensors of one shape; else `value`."""
    if isinstance(value, torch.Tensor) and isinstance(wide, torch.Tensor) and value.is_floating_point() \
            and wide.shape == value.shape:
        return torch.empty_like(value).copy_(wide)
    return value


def run_fused(graph: Graph, step: FusedStep, env: dict[str, object]) -> torch.Tensor:
    """A fused step as torch ops: the anchor's own call, then its epilogue."""
    acc = call_aten(step.anchor.node, env)
    if step.anchor.fused_relu:
        acc = torch.relu(acc)
    if step.anchor.layout == "nhwc" and not step.keeps_layout:
        acc = acc.contiguous()  # the epilogue kernel writes NCHW, whatever layout its input arrived in
    return _run_program(step.epilogue, acc, env)


def _laid_out(value: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """`value` in the layout the kernel writes: contiguous, or the given (dense, permuted) strides."""
    if strides is None:
        return value.contiguous()
    return torch.empty_strided(value.shape, strides, dtype=value.dtype, device=value.device).copy_(value)


def _run_generated(step: GenStep, env: dict[str, object]) -> torch.Tensor:
    """Prologue on the source, the reduction node's own ATen call on its result, then the epilogue (and the
    broadcast consumer reading it, for a reduce-then-broadcast kernel)."""
    value = _run_program(step.prologue, _operand(step.source, env), env)
    if step.spec is not None and step.spec.kind in SCAN_KINDS:  # type: ignore[attr-defined]
        value = scan_reference(step.spec, value)  # type: ignore[arg-type]  # its reverse/exclusive form too
    elif step.reduce_node is not None:
        node = step.reduce_node
        args = (Ref("__kf_reduce_input"),) + node.args[1:]
        if getattr(step.spec, "kind", None) == "moments":  # the statistics alone: weight and bias do not enter them
            args = (args[0], None, None) + args[3:]
        if getattr(step.spec, "kind", None) in ("norm", "moments") and isinstance(value, torch.Tensor):
            value = value.contiguous()  # ATen's CPU channels-last norms lose accuracy (NaN on overflow); ours don't
        try:  # on the source as eager holds it: the same summation order as eager's own call
            value = call_aten(Node(node.name, node.op, args, node.meta), {**env, "__kf_reduce_input": value})
        except RuntimeError:  # torch 2.11's CPU group norm refuses a permuted input: the same values, dense
            dense = value.contiguous() if isinstance(value, torch.Tensor) else value
            value = call_aten(Node(node.name, node.op, args, node.meta), {**env, "__kf_reduce_input": dense})
        index = getattr(step.spec, "out_index", None)
        if index is not None:
            value = value[index]  # type: ignore[index]
        elif getattr(step.spec, "kind", None) == "moments":  # the kernel writes (mean, 1/std) pairs
            value = torch.stack((value[1], value[2]), -1)  # type: ignore[index]
    value = _run_program(step.epilogue, value, env)
    return value if step.mapped is None else _run_program(step.mapped, value, env)  # the row's value broadcast


def _run_program(program: Epilogue | Program, acc: object, env: dict[str, object]) -> torch.Tensor:
    values: dict[str, object] = {"acc": acc}
    for i, operand in enumerate(program.operands):
        values[f"in{i}"] = _operand(operand, env)
    for st in program.statements:
        args = [values[a] if isinstance(a, str) else a for a in st.args]
        if st.op == "reshape":
            values[st.name] = args[0].reshape(st.params[0])  # type: ignore[union-attr]
            continue
        if st.op == SELECT:  # a concatenation of branches evaluated over its whole shape
            values[st.name] = selected(args, st.params)  # type: ignore[arg-type]
            continue
        row = POINTWISE_BY_ATEN[st.aten]
        values[st.name] = row.torch_fn(*args, *st.params)
    return values[program.result]  # type: ignore[return-value]


def _operand(operand: Operand, env: dict[str, object]) -> object:
    """An operand's value as a program reads it: the graph value, or inside a concatenation's branch the value
    read through the branch's window (kernelfuse.plan.catselect)."""
    value = env[operand.ref.name]
    return value if operand.window is None else windowed(value, operand.window)  # type: ignore[arg-type]


def _value(a: object, env: dict[str, object]) -> object:
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, tuple):
        return [_value(x, env) for x in a]
    return a
