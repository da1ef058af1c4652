"""Trace a problem's forward to ATen ops on fake tensors: shapes, dtypes and strides without allocating data.

The model is constructed and the inputs are drawn inside a `FakeTensorMode`, so a problem whose output is 1 GB
costs nothing on the host. `make_fx` then records the forward at the ATen level (Linear becomes `t` + `mm`/
`addmm`, Conv2d becomes `convolution`), which is the vocabulary the planner's op tables speak.
"""

from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kernelfuse.capture.graph import Arg, Graph, Node, Ref, TensorMeta
from kernelfuse.errors import CaptureError, ProblemError
from kernelfuse.load import Problem


def capture(problem: Problem) -> Graph:
    """The problem's forward as a Graph of normalised ATen ops, traced on fake tensors."""
    mode = FakeTensorMode()
    init_inputs = problem.init_inputs()  # plain Python values (sizes, factors), taken outside fake mode
    with mode:
        model = problem.make_model(init_inputs=init_inputs)
        inputs = problem.make_inputs(seed=0)
    return _trace(model, list(inputs), mode, str(problem.path))


def capture_module(model: torch.nn.Module, example_inputs: list[torch.Tensor]) -> Graph:
    """A live module's forward as a Graph: its tensors are mirrored as fake tensors, no data is touched."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_state = {n: mode.from_tensor(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    return _trace(model, fake_inputs, mode, type(model).__name__, fake_state)


def _trace(model: torch.nn.Module, inputs: list, mode: FakeTensorMode, what: str,
           state: dict[str, torch.Tensor] | None = None) -> Graph:
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    state_names = [n for n, _ in params] + [n for n, _ in buffers]
    kinds = ["param"] * len(params) + ["buffer"] * len(buffers)
    flat = [t for _, t in params] + [t for _, t in buffers] + list(inputs)
    if state is not None:  # a live module: trace against its fake mirrors
        flat = [state[n] for n in state_names] + list(inputs)
    n_state = len(state_names)

    def forward(*flat_args: torch.Tensor) -> object:
        state = dict(zip(state_names, flat_args[:n_state], strict=True))
        return torch.func.functional_call(model, state, tuple(flat_args[n_state:]))

    try:
        with mode, torch.no_grad():
            gm = make_fx(forward, tracing_mode="real")(*flat)
    except ProblemError:
        raise
    except Exception as err:  # noqa: BLE001 - tracing failures of arbitrary models become one clear error
        raise CaptureError(
            f"{what}: could not trace forward to ATen ops: {type(err).__name__}: {err}") from None
    return _to_graph(gm, state_names, kinds)


def _to_graph(gm: torch.fx.GraphModule, state_names: list[str], kinds: list[str]) -> Graph:
    nodes: list[Node] = []
    outputs: tuple[Ref, ...] = ()
    placeholder = 0
    for fx_node in gm.graph.nodes:
        meta = _meta(fx_node.meta.get("val"))
        if fx_node.op == "placeholder":
            if placeholder < len(state_names):
                nodes.append(Node(fx_node.name, kinds[placeholder], meta=meta, target=state_names[placeholder]))
            else:
                nodes.append(Node(fx_node.name, "input", meta=meta, target=placeholder - len(state_names)))
            placeholder += 1
        elif fx_node.op == "call_function":
            if fx_node.target is operator.getitem:  # one result of a multi-output op (batch_norm, max_pool...)
                op = "getitem"
            elif isinstance(fx_node.target, torch._ops.OpOverload):
                op = f"{fx_node.target._opname}.{fx_node.target._overloadname}"
            else:
                raise CaptureError(f"unsupported call in traced graph: {fx_node.target}")
            args = tuple(_arg(a) for a in fx_node.args)
            if fx_node.kwargs:
                args = args + tuple(("kw", k, _arg(v)) for k, v in fx_node.kwargs.items())
            nodes.append(Node(fx_node.name, op, args, meta))
        elif fx_node.op == "output":
            result = fx_node.args[0]
            result = result if isinstance(result, (list, tuple)) else [result]
            if not all(isinstance(r, torch.fx.Node) for r in result):
                raise CaptureError("forward must return a tensor or a tuple of tensors")
            outputs = tuple(Ref(r.name) for r in result)
    return Graph(tuple(nodes), outputs)


def _meta(val: object) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(d) for d in val.shape), val.dtype, tuple(int(s) for s in val.stride()))
    return None


def _arg(a: object) -> Arg:
    if isinstance(a, torch.fx.Node):
        return Ref(a.name)
    if isinstance(a, (list, tuple)):
        return tuple(_arg(x) for x in a)
    return a  # constants: numbers, bools, None, torch.dtype / device / layout / memory_format
