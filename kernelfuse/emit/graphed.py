"""Replay a fused forward from a CUDA graph: one launch per call instead of one per op from Python.

Deep models at small batch sizes are launch-bound: measured on an H100, eager ResNet101 takes 16.6 ms for 4.3 ms
of kernels, DenseNet201 15.5 ms for 7.4 ms, and a graph replay of the same kernels 4.6 and 7.7 ms
(`benchmarks/graph_probe.py`). The pipeline judges a graphed variant of the plan when the judge's profile says
the GPU idles for longer than the replay's copies take (kernelfuse.choose), and ships it only if it is verified
and faster.

The emitted file's runtime (`GRAPH_RUNTIME`, copied into the file verbatim) keeps the forward's meaning:
- a replay serves a call only if the inputs have the captured shapes, strides, dtypes and device, every module,
  parameter, buffer and plain tensor attribute is the object captured with the same storage and version (a
  weight replaced, moved or changed in place: capture again), the train/eval modes, inference mode and the
  numerics flags are the captured ones, autograd needs nothing and the caller is not capturing a graph of its
  own; anything else runs the kernels one by one (and the original ops where `_use_kernels` says so); a replay
  counts as a fused call in the module's `kernelfuse_stats()`;
- inputs are copied into the graph's own buffers and outputs cloned out of its memory, so no result aliases the
  graph or an earlier call's result;
- the first call with new inputs or weights runs the kernels one by one (it also creates cuBLAS and cuDNN handles
  and workspaces, which a capture must not be the first to do); the next call captures, later ones replay;
- in-place updates (batch norm's running statistics and batch counter) are part of the graph, so each replay
  applies them once, like a call; plans with random ops are not graphed (the pipeline does not ask);
- a capture that fails (an op that synchronises with the host, a CPU tensor) is reported once as a warning and the
  module runs its kernels one by one from then on: the same results, without the graph's gain.
"""

from __future__ import annotations

from kernelfuse.emit.calltext import CallText

GRAPH_RUNTIME = '''
class _CudaGraph:
    """The fused forward captured once as a CUDA graph for one input signature, set of weights and mode."""

    def __init__(self, module, forward, inputs):
        self.modules = list(module.modules())
        self.calls = _calls(module)  # the module's counts (see _use_kernels): a replay is a fused call
        self.owners = [(m.__dict__[kind], name, value) for m in self.modules
                       for kind in ("_modules", "_parameters", "_buffers")
                       for name, value in m.__dict__[kind].items()]
        self.owners += [(m.__dict__, name, value) for m in self.modules for name, value in vars(m).items()
                        if isinstance(value, torch.Tensor) and not name.startswith("_")]  # plain tensor attributes
        self.state = [value for _, _, value in self.owners if isinstance(value, torch.Tensor)]
        if any(t.is_inference() for t in self.state):
            raise RuntimeError("inference tensors have no version counter to notice a weight changed in place")
        self.static = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
                       for x in inputs]
        self.out = self._record(forward)
        self.key = self._key(self.static)

    def _record(self, forward):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device((self.static or self.state)[0].device), torch.cuda.graph(self.graph):
            return forward(*self.static)

    def _launch(self):
        self.graph.replay()

    def _key(self, inputs):
        # inference mode too: a graph captured in it owns inference tensors, which no copy may write outside it
        return ([(x.shape, x.stride(), x.dtype, x.device) for x in inputs],
                list(map(torch.Tensor.data_ptr, self.state)), [t._version for t in self.state],
                [m.training for m in self.modules], _numerics_flags(), torch.is_inference_mode_enabled())

    def serves(self, inputs):
        """Whether a replay computes what the forward would compute for `inputs` now."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*self.state, *inputs)):
            return False
        if inputs and inputs[0].is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # the caller captures a graph of its own: the kernels run into it one by one
        return all(owner.get(name) is value for owner, name, value in self.owners) and \\
            self._key(inputs) == self.key

    def replay(self, inputs):
        """forward's result for `inputs` from the graph, counted as a fused call (the caller checked `serves`)."""
        self.calls["fused_calls"] += 1
        return self.run(inputs)

    def run(self, inputs):
        for static, x in zip(self.static, inputs):
            static.copy_(x)
        self._launch()
        if isinstance(self.out, torch.Tensor):
            return self.out.clone()
        return type(self.out)(t.clone() if isinstance(t, torch.Tensor) else t for t in self.out)


def _numerics_flags():
    """The settings a capture bakes into its kernels (cuBLAS math mode, cuDNN algorithms)."""
    return (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())


def _graphed(module, forward, inputs):
    """`forward(*inputs)` from a CUDA graph: the first call after a change runs the kernels one by one, the next
    captures them, later calls replay (the caller has checked that the kernels serve this call)."""
    state = module.__dict__
    state["_cuda_graph"] = None  # the old graph, if any, no longer serves: free its memory
    if state.get("_cuda_graph_broken") or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return forward(*inputs)
    if not state.pop("_cuda_graph_warm", False):
        state["_cuda_graph_warm"] = True
        return forward(*inputs)
    try:
        graph = _CudaGraph(module, forward, inputs)
    except Exception as err:
        import warnings

        state["_cuda_graph_broken"] = True
        warnings.warn(f"kernelfuse: CUDA graph capture failed ({type(err).__name__}: {err}); "
                      "the kernels run one by one from now on (same results, slower)")
        return forward(*inputs)
    state["_cuda_graph"] = graph
    return graph.run(inputs)  # _use_kernels counted this call
'''


def graphed_forward_source(call: CallText, body: str, rebuild: str | None = None) -> str:
    """The `forward` of a graphed plan: a replay where the captured graph serves the call, else the guard, else
    `_fused_forward` (the plan's forward, `body`'s name) through `_graphed`. `rebuild`: where forward returns more
    than a tensor or a tuple of tensors, `_fused_forward` returns its tensors as a tuple `out` and this expression
    over `out[i]` rebuilds the returned structure (the replay clones plain tensors only)."""
    inputs = call.inputs
    header = [
        f"def forward(self, {call.params}):" if call.params else "def forward(self):",
        '    """The fused kernels replayed from a CUDA graph (see _graphed); the original ops where they cannot serve',
        '    the call (see _use_kernels)."""',
        *(f"    {c}" for c in call.comments),
        '    graph = self.__dict__.get("_cuda_graph")',
        f"    if {call.fits}graph is not None and graph.serves({inputs}):",
    ]
    guard = [f"    if not _use_kernels(self, {call.checked}):",
             f"        return self._reference_forward({call.reference})"]
    if rebuild is None:
        return "\n".join([*header, f"        return graph.replay({inputs})", *guard,
                          f"    return _graphed(self, self.{body}, {inputs})", ""])
    return "\n".join([*header, f"        out = graph.replay({inputs})", "    else:",
                      *("    " + line for line in guard), f"        out = _graphed(self, self.{body}, {inputs})",
                      f"    return {rebuild}", ""])
