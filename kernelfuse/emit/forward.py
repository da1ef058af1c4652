"""The fused `forward` of an emitted file or in-process module: one line per plan step, the state read through
`self.<path>`, the weight cache methods (kernelfuse.emit.hoist) and the CUDA-graph replay where the plan asks."""

from __future__ import annotations

import torch

from kernelfuse.capture import Node, Ref
from kernelfuse.capture.signature import Output, literal
from kernelfuse.codegen.common import channels_last_format
from kernelfuse.codegen.conv_igemm import dense_kernel
from kernelfuse.codegen.generated import tensor_args
from kernelfuse.emit.calltext import CallText, output_text
from kernelfuse.emit.graphed import graphed_forward_source
from kernelfuse.emit.hoist import cached_tuple, plan_hoist, shared_constants, step_out, weight_methods
from kernelfuse.emit.runtime import STATS_METHOD
from kernelfuse.plan.gemm import gemm_operands
from kernelfuse.plan.ir import AttnStep, FusedStep, GenStep, Plan, Step, TorchStep
from kernelfuse.plan.layout import channels_last_strides

# Readable spellings for common ATen calls; anything else is written `torch.ops.aten.<op>(...)`. A tensor method
# is also half the host time of the `torch.ops` overload (0.7 against 1.4 µs for a view): it counts where a
# forward is launch-bound.
PY_SPELLING = {
    "getitem": "{0}[{1}]",
    "t.default": "{0}.t()",
    "mm.default": "torch.mm({0}, {1})",
    "addmm.default": "torch.addmm({0}, {1}, {2})",
    "view.default": "{0}.view({1})",
    "unsqueeze.default": "{0}.unsqueeze({1})",
    "squeeze.dim": "{0}.squeeze({1})",
    "transpose.int": "{0}.transpose({1}, {2})",
    "permute.default": "{0}.permute({1})",
    "expand.default": "{0}.expand({1})",
    "select.int": "{0}.select({1}, {2})",
}


_FP32_COMMENT = "    # cuDNN's TF32 off for this call: eager's NCHW convolution computes in full fp32 on this GPU"


def forward_source(plan: Plan, call: CallText, has_kernels: bool, guarded: bool, state: str = "self") -> str:
    """The text of the fused `forward` method, and of the weight cache methods it calls (kernelfuse.emit.hoist)
    where the plan computes values from the weights alone; module state is read as `{state}.<attribute path>`.
    `call`: the forward's parameters, where its tensors are, and what its graph was specialised to."""
    graph = plan.graph
    hoist = plan_hoist(plan)
    state_names = {n.name: _state_expr(state, str(n.target), n.op) for n in graph.state}
    names = dict(state_names)
    tensors = call.identifiers() if plan.graphed else list(call.tensors)
    for node in graph.inputs:
        names[node.name] = tensors[int(node.target)]  # type: ignore[arg-type]
    output = graph.call_spec.output
    flat_out = plan.graphed and not _plain_output(output)  # the graph returns its tensors; forward rebuilds
    if plan.graphed:  # forward replays the graph; the plan's kernels run from _fused_forward, guard checked before
        out = [f"def _fused_forward(self, {', '.join(tensors)}):" if tensors else "def _fused_forward(self):",
               '    """The plan\'s kernels one by one: what the CUDA graph captures."""']
    else:
        out = [f"def forward(self, {call.params}):" if call.params else "def forward(self):",
               '    """Fused kernels on the captured shapes; the original ops otherwise (see _use_kernels)."""']
    if guarded and not plan.graphed:
        out += [f"    {c}" for c in call.comments]
        out.append(f"    if not _use_kernels(self, {call.checked}):")
        out.append(f"        return self._reference_forward({call.reference})")
    if has_kernels:
        out.append("    ext = _extension()")
    if any(isinstance(a, torch.device) for n in graph.nodes for a in _flat(n.args)):
        first = tensors[0] if tensors else "next(self.parameters())"
        out.append(f"    _device = {first}.device")
    if hoist.cached:
        out.append(f"    {cached_tuple(hoist)} = self._weights()  # computed once per weight version")
        names.update({n: f"v_{n}" for n in hoist.cached})
    for step in plan.steps:
        if step_out(step) not in hoist.skipped:
            out += _step_lines(graph, step, names)
    results = [names[r.name] for r in graph.outputs]
    if flat_out:
        out.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    else:
        out.append(f"    return {output_text(output, iter(results))}")
    text = "\n".join(out) + "\n"
    if plan.graphed:
        rebuild = output_text(output, (f"out[{i}]" for i in range(len(results)))) if flat_out else None
        text = graphed_forward_source(call, "_fused_forward", rebuild) + "\n" + text
    if hoist.cached:
        text += "\n" + weight_methods(hoist, state_names, lambda s, n: _step_lines(graph, s, n), has_kernels)
    if guarded:
        text += STATS_METHOD
    return text


def _plain_output(output: Output) -> bool:
    """A tensor, or a tuple of tensors: what the graph replay returns as it is."""
    return output.kind == "tensor" or (output.kind == "tuple" and all(o.kind == "tensor" for o in output.items))


def _step_lines(graph, step: Step, names: dict[str, str]) -> list[str]:
    """One plan step as lines of a method body; `names` gains the variable holding its value."""
    if isinstance(step, TorchStep):
        if step.into is not None:
            return _cat_into_lines(graph, step, names)
        names[step.node.name] = f"v_{step.node.name}"
        if step.node.op == "constant" and step.node.name in shared_constants(graph):
            return [f"    v_{step.node.name} = {_constant_call(step.node)}"]
        if step.fp32:
            return [_FP32_COMMENT,
                    f"    v_{step.node.name} = _without_tf32(lambda: {_call(step.node, names)})"]
        return [f"    v_{step.node.name} = {_call(step.node, names)}"]
    if isinstance(step, GenStep):
        return _generated_lines(graph, step, names)
    if isinstance(step, AttnStep):
        return _attention_lines(graph, step, names)
    return _fused_lines(graph, step, names)


def _fused_lines(graph, step: FusedStep, names: dict[str, str]) -> list[str]:
    anchor = step.anchor
    node = anchor.node
    lines = [f"    # {step.kernel}: {step.chain(graph)}"]
    if anchor.epilogue_inside:
        return lines + _generated_anchor_lines(graph, step, names)
    acc = f"v_{node.name}" if not step.needs_kernel else "acc"
    if anchor.family == "conv":
        x, w, b = (_py(a, names) for a in node.args[:3])
        stride, padding, dilation, transposed, output_padding, groups = node.args[3:9]
        if anchor.layout == "nhwc":
            x_meta = graph[node.args[0]].meta
            if x_meta.stride != channels_last_strides(x_meta.shape):  # a kernel of ours may have written it so
                x = f"ext.to_channels_last({x}{'' if x_meta.is_contiguous else '.contiguous()'})"
            fmt = channels_last_format(node.meta)
            w = f"{w}.contiguous(memory_format={fmt})"
            then = ("the reduction kernel reads its channels-last output" if step.keeps_layout
                    else "the epilogue writes NCHW back")
            lines.append(f"    # channels-last convolution (measured faster than NCHW here); {then}")
        if anchor.fused_relu:
            call = f"torch.cudnn_convolution_relu({x}, {w}, {b}, {list(stride)}, {list(padding)}, {list(dilation)}, {groups})"
            lines.append("    # cuDNN fused convolution + bias + ReLU")
        else:
            call = (f"torch.convolution({x}, {w}, {b}, {list(stride)}, {list(padding)}, {list(dilation)}, {transposed}, "
                    f"{list(output_padding)}, {groups})")
    elif anchor.tf32:
        lines.append("    # cuBLAS with TF32 tensor cores: the tf32 precision policy allows it")
        call = f"_with_tf32(lambda: {_call(node, names)})"
    else:
        call = _call(node, names)
    if anchor.fp32:
        lines.append(_FP32_COMMENT)
        call = f"_without_tf32(lambda: {call})"
    if step.keeps_layout:  # cuDNN returns channels-last for channels-last operands; the reader's kernel needs it
        call = f"{call}.contiguous(memory_format={channels_last_format(node.meta)})"
    lines.append(f"    {acc} = {call}")
    if step.needs_kernel:
        operands = "".join(f", {_py(o.ref, names)}" for o in step.epilogue.operands)
        where = "in place" if step.inplace else "into a new NCHW tensor"
        what = "; ".join(str(s) for s in step.epilogue.statements) or "layout change only"
        lines.append(f"    # epilogue kernel {step.kernel} ({where}): {what}")
        lines.append(f"    v_{step.out} = ext.{step.kernel}({acc}{operands})")
    elif acc != f"v_{step.out}":
        lines.append(f"    v_{step.out} = {acc}")
    names[step.out] = f"v_{step.out}"
    return lines


def _cat_into_lines(graph, step: TorchStep, names: dict[str, str]) -> list[str]:
    """A concatenation of a chain sharing one buffer (kernelfuse.plan.catbuffer): the first allocates it, each copies
    its new operands into their slices, and its value is the buffer's first part (the last one's: all of it)."""
    into, node = step.into, step.node
    assert into is not None
    buf = f"v_{into.buffer}"
    meta = graph[into.buffer].meta
    lines = [f"    # {node.name}: concatenation written into {into.buffer}'s buffer" + (" (allocated here)" if into.first else "")]
    if into.first:
        device = names[into.copies[0][0].name]
        lines.append(f"    {buf} = torch.empty_strided({list(meta.shape)}, {list(meta.stride)}, dtype={meta.dtype}, "
                     f"device={device}.device)")
    for ref, offset in into.copies:
        size = graph[ref].meta.shape[into.dim]
        lines.append(f"    {buf}.narrow({into.dim}, {offset}, {size}).copy_({names[ref.name]})")
    names[node.name] = f"v_{node.name}"
    if node.name != into.buffer:
        lines.append(f"    v_{node.name} = {buf}.narrow({into.dim}, 0, {node.meta.shape[into.dim]})")
    return lines


def _generated_anchor_lines(graph, step: FusedStep, names: dict[str, str]) -> list[str]:
    """One call of kernelfuse's own anchor kernel: the convolution or matrix product and its epilogue, the output
    written once."""
    node = step.anchor.node
    operands = "".join(f", {_py(o.ref, names)}" for o in step.epilogue.operands)
    what = "; ".join(str(s) for s in step.epilogue.statements) or "no epilogue"
    names[step.out] = f"v_{step.out}"
    if step.anchor.family == "matmul":
        bias, x, wt = gemm_operands(node)
        b = "None" if bias is None else _py(bias, names)
        return [f"    # GEMM on tensor cores (3xTF32: fp32 accuracy, as eager's cuBLAS call), epilogue inside: {what}",
                f"    v_{step.out} = ext.{step.kernel}({_py(x, names)}, {_py(wt, names)}, {b}{operands})"]
    x, w, b = (_py(a, names) for a in node.args[:3])
    if not graph[node.args[0]].meta.is_contiguous:
        x = f"{x}.contiguous()"
    precision = "3xTF32: fp32 accuracy, as eager's call" if step.anchor.fp32 else "TF32, as eager's cuDNN call"
    if dense_kernel(graph, step):  # w: the tap-major copy the kernel reads (made once per weight version)
        return [f"    # dense implicit-GEMM convolution ({precision}), epilogue inside: {what}",
                f"    v_{step.out} = ext.{step.kernel}({x}, {w}, {b}{operands})"]
    return [f"    # implicit-GEMM convolution ({precision}), epilogue inside: {what}",
            f"    v_{step.out} = ext.{step.kernel}({x}, {w}.contiguous(), {b}{operands})"]


def _generated_lines(graph, step: GenStep, names: dict[str, str]) -> list[str]:
    """One call of a generated kernel; the comment names the ops it computes and its algorithm."""
    args = ", ".join(_py(ref, names) for _, ref in tensor_args(step))
    names[step.out] = f"v_{step.out}"
    return [f"    # {step.kernel}: {step.chain(graph)}  ({step.family} kernel)",
            f"    v_{step.out} = ext.{step.kernel}({args})"]


def _constant_call(node: Node) -> str:
    """A tensor forward makes from literals, made once per device (see _constant)."""
    return f"_constant({node.name!r}, {literal(node.args[0])}, {node.meta.dtype}, {list(node.meta.shape)}, _device)"


def _attention_lines(graph, step: AttnStep, names: dict[str, str]) -> list[str]:
    """One call of a flash-attention kernel (it reads q, k, v and the mask through their strides), or one torch
    SDPA call on the same tensors viewed as (batch, heads, rows, cols), its result laid out as the step's."""
    names[step.out] = f"v_{step.out}"
    if step.impl == "kernel":
        args = ", ".join(names[i.ref.name] for i in step.inputs)
        lines = [f"    # {step.kernel}: {step.chain(graph)}  (flash-attention kernel, {step.origin})"]
        if step.causal_guard is not None:  # the buffers the mask is made from: the binding's check is per version
            sources = [names[n] for n in step.causal_guard]
            args += f", ({', '.join(sources)}{',' if len(sources) == 1 else ''})"
            lines.append("    # causal where its binding finds the mask causal (checked once per version of these "
                         "buffers), else masked")
        return [*lines, f"    v_{step.out} = ext.{step.kernel}({args})"]
    batch = step.dims[0]
    q, k, v = (names[i.ref.name] + (".transpose(-2, -1)" if i.swap else "") +
               (f".unflatten(0, ({batch}, -1))" if len(i.meta.shape) == 3 else "") for i in step.inputs[:3])
    kw = [f"scale={step.scale!r}"] + (["is_causal=True"] if step.causal else []) + \
        (["enable_gqa=True"] if step.dims[1] != step.dims[2] else [])
    lines = [f"    # {step.kernel}: {step.chain(graph)}  (torch SDPA call, {step.origin})"]
    if step.mask is not None:
        mask = names[step.mask.ref.name]
        kw.insert(0, f"attn_mask={'~' if step.mask_kind == 'drop' else ''}{mask}")
    lines.append(f"    v_{step.out} = torch.nn.functional.scaled_dot_product_attention({q}, {k}, {v}, {', '.join(kw)})")
    if step.mask is not None and step.empty_nan and step.mask_kind == "drop":  # softmax over no key: NaN, as eager
        lines.append(f"    v_{step.out} = v_{step.out}.masked_fill({mask}.all(-1, keepdim=True), float('nan'))")
    order = tuple(sorted(range(4), key=lambda d: -step.out_strides[d]))  # the output's memory order
    lines.append(f"    v_{step.out} = v_{step.out}.permute{order}.contiguous().view({list(step.out_meta.shape)})")
    return lines


def _call(node: Node, names: dict[str, str]) -> str:
    if node.op == "constant":  # written to or returned: made in every call (capture limits its size)
        return f"torch.tensor({_py(node.args[0], names)}, dtype={node.meta.dtype}, device=_device).reshape({list(node.meta.shape)})"
    plain, kwargs = node.positional, node.keywords
    if node.op in PY_SPELLING and not kwargs and len(plain) == PY_SPELLING[node.op].count("{"):
        return PY_SPELLING[node.op].format(*(_py(a, names) for a in plain))
    args = [_py(a, names) for a in plain] + [f"{k}={_py(v, names)}" for k, v in kwargs.items()]
    packet, overload = node.op.split(".")
    return f"torch.ops.aten.{packet}.{overload}({', '.join(args)})"


def _state_expr(state: str, path: str, kind: str) -> str:
    """`self.gemm.weight`, or `self.get_parameter("0.weight")` where a part is no identifier (nn.Sequential)."""
    if all(part.isidentifier() for part in path.split(".")):
        return f"{state}.{path}"
    getter = "get_parameter" if kind == "param" else "get_buffer"
    return f"{state}.{getter}({path!r})"


def _flat(args: tuple) -> list[object]:
    out: list[object] = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, tuple) else [a])
    return out


def _py(a: object, names: dict[str, str]) -> str:
    if isinstance(a, Ref):
        return names[a.name]
    if isinstance(a, tuple):
        return "[" + ", ".join(_py(x, names) for x in a) + "]"
    if isinstance(a, torch.device):
        return "_device"  # captured on CPU fake tensors: the run-time device is the inputs' (set in forward)
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return f"float('{a}')"
    return repr(a)
