"""The channels-last graph: a CNN's activations kept channels-last from its input to its last convolution.

The per-convolution layout choice (kernelfuse.plan.fuse, `Anchor.layout`) converts each convolution's input to
channels-last and its output back: two passes over every activation, which torch.compile's layout optimisation
does not make (ResNet-50 under bf16 on an H200: 0.36 ms of 1.65 ms in cuDNN's own layout transposes). Here the
graph itself changes, as eager's would with `model.to(memory_format=torch.channels_last)` and a channels-last
input:
- each 4-d/5-d input that reaches a convolution is copied channels-last once, at the start;
- each convolution reads its weight through a channels-last copy (a weight-only value: the emitted file computes
  it once per weight version, kernelfuse.emit.hoist);
- every node's strides are propagated again on fake tensors, as torch lays out each op's output for such inputs;
- an output whose layout changed is copied back to the layout the model returns.
Kernels then read and write the strides the graph holds (a pointwise or batch-norm kernel in channels-last memory
order); the planner leaves to torch what its kernels cannot write in that layout (`make_plan`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.capture.graph import constant_value
from kernelfuse.ops import ANCHOR_OPS
from kernelfuse.plan.interpret import call_aten


def channels_last_graph(graph: Graph) -> Graph | None:
    """`graph` with channels-last activations (see the module's docstring), or None where no 2-d/3-d convolution
    reads another's output, or where an op's layout cannot be propagated."""
    convs = {n.name for n in graph.nodes if _channels_last_conv(graph, n)}
    if not _chained(graph, convs):
        return None
    names = {n.name for n in graph.nodes}
    feeding = _reaching(graph, convs)
    nodes: list[Node] = []
    renamed: dict[str, str] = {}
    for node in graph.nodes:
        node = replace(node, args=_renamed(node.args, renamed))
        if node.name in convs:
            weight = node.args[1]
            cl = fresh_name(f"{weight.name}_cl", names)  # type: ignore[union-attr]
            nodes.append(Node(cl, "clone.default", (weight, ("kw", "memory_format", _format(node))), None))
            node = replace(node, args=(node.args[0], Ref(cl), *node.args[2:]))
        nodes.append(node)
        if node.op == "input" and node.name in feeding and node.meta is not None and len(node.meta.shape) in (4, 5):
            cl = fresh_name(f"{node.name}_cl", names)
            fmt = torch.channels_last if len(node.meta.shape) == 4 else torch.channels_last_3d
            nodes.append(Node(cl, "clone.default", (Ref(node.name), ("kw", "memory_format", fmt)), None))
            renamed[node.name] = cl
    propagated = _propagate(nodes, names)
    if propagated is not None and any(_needs_contiguous(n, propagated[1]) for n in propagated[0]):
        propagated = _propagate(_contiguous_before(propagated[0], propagated[1], names), names)
    if propagated is None:
        return None
    nodes, metas = propagated
    outputs = []
    for ref in graph.outputs:
        before, after = graph[ref].meta, metas.get(ref.name)
        if before is None or after is None or _same_layout(before, after):
            outputs.append(ref)
            continue
        if not before.is_dense_contiguous:
            return None  # an output in another layout still: not worth a variant
        back = fresh_name(f"{ref.name}_nchw", names)
        nodes.append(Node(back, "clone.default", (ref, ("kw", "memory_format", torch.contiguous_format)), before))
        outputs.append(Ref(back))
    return graph.rebuilt(nodes, outputs)


# ops whose CUDA kernels take only contiguous inputs where the CPU's (which propagate the layouts here) also take
# channels-last ones: ATen's group_norm makes its input contiguous before calling native_group_norm on CUDA
CONTIGUOUS_ON_CUDA = {"native_group_norm.default"}


def _needs_contiguous(node: Node, metas: dict[str, TensorMeta]) -> bool:
    if node.op not in CONTIGUOUS_ON_CUDA or not isinstance(node.args[0], Ref):
        return False
    meta = metas.get(node.args[0].name)
    return meta is not None and not meta.is_dense_contiguous


def _contiguous_before(nodes: list[Node], metas: dict[str, TensorMeta], names: set[str]) -> list[Node]:
    """`nodes` with a contiguous copy of the input of each op that needs one on CUDA (CONTIGUOUS_ON_CUDA)."""
    out = []
    for node in nodes:
        if _needs_contiguous(node, metas):
            copy = fresh_name(f"{node.args[0].name}_contiguous", names)
            out.append(Node(copy, "clone.default", (node.args[0], ("kw", "memory_format", torch.contiguous_format)),
                            None))
            node = replace(node, args=(Ref(copy), *node.args[1:]))
        out.append(node)
    return out


def _channels_last_conv(graph: Graph, node: Node) -> bool:
    """A 2-d or 3-d convolution (transposed or not) whose weight is a graph value of 4 or 5 dims."""
    if ANCHOR_OPS.get(node.op) != "conv" or node.meta is None or len(node.meta.shape) not in (4, 5):
        return False
    weight = node.args[1]
    return isinstance(weight, Ref) and graph[weight].meta is not None and len(graph[weight].meta.shape) in (4, 5)


def _chained(graph: Graph, convs: set[str]) -> bool:
    """Does a convolution read a value computed from another's output? Only then do activations travel between
    convolutions; a lone one is the per-convolution layout choice's (kernelfuse.plan.fuse `Anchor.layout`)."""
    behind: set[str] = set()  # values computed from a convolution's output
    for node in graph.nodes:
        if node.name in convs and any(r.name in behind for r in node.refs):
            return True
        if node.name in convs or any(r.name in behind for r in node.refs):
            behind.add(node.name)
    return False


def _format(conv: Node) -> torch.memory_format:
    return torch.channels_last if len(conv.meta.shape) == 4 else torch.channels_last_3d  # type: ignore[union-attr]


def _reaching(graph: Graph, targets: set[str]) -> set[str]:
    """The nodes whose values reach one of `targets`."""
    found = set(targets)
    for node in reversed(graph.nodes):
        if node.name in found:
            found.update(r.name for r in node.refs)
    return found


def fresh_name(name: str, names: set[str]) -> str:
    """`name`, with underscores appended until it is not in `names` (which it then joins)."""
    while name in names:
        name += "_"
    names.add(name)
    return name


def _renamed(args: tuple, renamed: dict[str, str]) -> tuple:
    return tuple(Ref(renamed.get(a.name, a.name)) if isinstance(a, Ref) else
                 _renamed(a, renamed) if isinstance(a, tuple) else a for a in args)


def _propagate(nodes: list[Node], names: set[str]) -> tuple[list[Node], dict[str, TensorMeta]] | None:
    """Every node's output strides (and the new nodes' metas) as torch's ops give them for these inputs, run on
    fake CPU tensors (whose convolution keeps channels-last as cuDNN's does); None where an op fails. A view that
    needs the old strides (a classifier's flatten of a channels-last map) reads a contiguous copy, inserted here."""
    env: dict[str, object] = {}
    out: list[Node] = []
    metas: dict[str, TensorMeta] = {}

    def run(node: Node) -> bool:
        if node.op in ("input", "param", "buffer"):
            meta = node.meta
            assert meta is not None
            env[node.name] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
        elif node.op == "constant":
            env[node.name] = constant_value(node)
        else:
            env[node.name] = call_aten(node, env)
        value = env[node.name]
        if isinstance(value, torch.Tensor) and (node.meta is not None or node.op == "clone.default"):
            meta = TensorMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
            if node.meta is not None and (meta.shape, meta.dtype) != (node.meta.shape, node.meta.dtype):
                return False
            node = replace(node, meta=meta)
            metas[node.name] = meta
        out.append(node)
        return True

    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            for node in nodes:
                if node.op in VIEW_OPS and not _viewable(env[node.args[0].name], node.args[1]):  # type: ignore[union-attr]
                    copy = fresh_name(f"{node.args[0].name}_contiguous", names)  # type: ignore[union-attr]
                    if not run(Node(copy, "clone.default",
                                    (node.args[0], ("kw", "memory_format", torch.contiguous_format)), None)):
                        return None
                    node = replace(node, args=(Ref(copy), *node.args[1:]))
                if not run(node):
                    return None
    except Exception:  # noqa: BLE001 - an op whose layout cannot change here: no channels-last variant
        return None
    return out, metas


# views whose strides the fake tensors above do not always check (a real tensor of strides (4, 1, 4, 4, 2) refuses
# view(1, 4); a fake one took it: fuzz seed 75000, model 400), so they are checked on the meta device
VIEW_OPS = {"view.default", "_unsafe_view.default"}
_real_tensors = getattr(fake_tensor, "unset_fake_temporarily", contextlib.nullcontext)  # torch >= 2.1 has it


def _viewable(value: object, shape: object) -> bool:
    """Whether a tensor of `value`'s shape and strides can be viewed as `shape`, as a real tensor checks it."""
    if not isinstance(value, torch.Tensor):
        return True
    with _real_tensors():  # inside _propagate's FakeTensorMode: a meta tensor, not another fake one
        probe = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
        try:
            probe.view(shape)  # type: ignore[call-overload]
        except RuntimeError:
            return False
    return True


def _same_layout(a: TensorMeta, b: TensorMeta) -> bool:
    """The same strides where they matter (a dimension of size 1 has any)."""
    return a.shape == b.shape and all(d == 1 or s == t for d, s, t in zip(a.shape, a.stride, b.stride, strict=True))


def channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a 4-d/5-d tensor in channels-last order (N, spatial..., C), as torch lays it out."""
    strides = [0] * len(shape)
    step = 1
    for d in (1, *range(len(shape) - 1, 1, -1), 0):  # innermost first: C, then W, H (D), then N
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)
