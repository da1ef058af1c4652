"""Weight-only values: computed once per weight version, not in every forward.

Rewrites such as `reduce_linear_output` turn `sum(Linear(x), 1)` into `x @ W.sum(1)`: the reduced weight depends
on the parameters only, yet a forward that computes it reads the whole weight on every call, which is most of
the work left. Here the plan's steps whose values depend only on parameters, buffers and constants are found,
and the emitted forward takes the ones it reads from a cache on the module (`_weights`), keyed on the identity,
data pointer, version counter, device, dtype, shape and strides of every tensor they read, so an optimizer step,
`load_state_dict`, `.to()` or an in-place change under `torch.no_grad()` recomputes them. A write through
`.data` bypasses the version counter (as it bypasses autograd) and is not seen: documented in the method.

Emit-only: the plan and its CPU interpreter are unchanged; the emitted file computes the same values in the same
way, once per weight version instead of once per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernelfuse.capture import Graph
from kernelfuse.capture.graph import pure
from kernelfuse.plan.aliasing import STATE_OPS, alias_closure, may_alias, weight_only, written_args
from kernelfuse.plan.ir import Plan, Step, TorchStep


@dataclass(frozen=True)
class Hoist:
    """What the emitted forward takes from the weight cache instead of computing it."""

    steps: tuple[Step, ...]  # plan order: what `_weight_values` runs (cached values and what they are built from)
    cached: tuple[str, ...]  # graph nodes whose values the forward reads from the cache
    weights: tuple[str, ...]  # the parameters and buffers those values read: the cache key
    skipped: frozenset[str]  # step outputs the forward no longer computes (cached, or read only by the cache)


def plan_hoist(plan: Plan) -> Hoist:
    """Cache the weight-only steps the forward reads, where computing them is work (a view of a parameter is free
    and stays in forward) and no output may share their storage (the caller would receive, and could modify, the
    cache). Steps only the cached values need move out of the forward with them."""
    graph = plan.graph
    constant = weight_only(graph)
    by_out = {step_out(s): s for s in plan.steps}
    constant_steps = {name for name, s in by_out.items() if all(n in constant for n in _computes(s))}
    returned = alias_closure(graph, (r.name for r in graph.outputs))
    work: dict[str, bool] = {}
    for name, s in by_out.items():  # plan order: a step's producers come first
        if name in constant_steps:
            free = isinstance(s, TorchStep) and may_alias(s.node)
            work[name] = not free or any(work.get(r, False) for r in _reads(graph, s))
    needed = {r.name for r in graph.outputs}  # values the forward itself reads
    cached: list[str] = []
    skipped: set[str] = set()
    for s in reversed(plan.steps):
        name = step_out(s)
        if name in constant_steps and (name not in needed or (work[name] and name not in returned)):
            skipped.add(name)
            if name in needed:
                cached.append(name)
        else:
            needed |= _reads(graph, s)
    inside = set(cached)  # what `_weight_values` computes: the cached values and their weight-only producers
    steps = []
    for s in reversed(plan.steps):
        if step_out(s) in inside:
            steps.append(s)
            inside |= _reads(graph, s)
    weights = tuple(n.name for n in graph.nodes if n.op in STATE_OPS and n.name in inside)
    return Hoist(tuple(reversed(steps)), tuple(reversed(cached)), weights, frozenset(skipped))


def shared_constants(graph: Graph) -> frozenset[str]:
    """The tensors forward makes from literals that the emitted file may make once per device and hand to every
    call: no op writes them (or a view of them) and no output shares their storage."""
    touched = alias_closure(graph, [*(r.name for n in graph.nodes if not pure(n) for r in written_args(n)),
                                    *(r.name for r in graph.outputs)])
    return frozenset(n.name for n in graph.nodes if n.op == "constant" and n.name not in touched)


def step_out(step: Step) -> str:
    """The graph node whose value a step produces (its variable in the emitted forward is `v_<name>`)."""
    return step.node.name if isinstance(step, TorchStep) else step.out


def weight_methods(hoist: Hoist, state: dict[str, str], step_lines: Callable[[Step, dict[str, str]], list[str]],
                   has_kernels: bool) -> str:
    """The `_weights` and `_weight_values` methods of the emitted class; `state` maps parameter and buffer nodes
    to their expressions (`self.lin.weight`), `step_lines` renders one plan step as the forward does."""
    weights = ", ".join(state[w] for w in hoist.weights) + ("," if len(hoist.weights) == 1 else "")
    out = [
        "def _weights(self):",
        '    """The values computed from parameters and buffers alone (e.g. a weight reduced for a matrix-vector',
        "    product), once per weight version instead of in every forward: a weight replaced, moved (.to()) or",
        "    changed in place (an optimizer step, load_state_dict, mul_ under torch.no_grad()) has another data",
        "    pointer or version, and they are recomputed. A write through `.data` bypasses the version counter:",
        "    after one, `del self._weights_cache`. The fused forward is inference-only: they are computed without",
        '    autograd, and without a cache where autograd needs them."""',
        f"    weights = ({weights})",
        "    if any(w.is_inference() for w in weights) or (",
        "        torch.is_grad_enabled() and any(w.requires_grad for w in weights)",
        "    ):",
        "        return self._weight_values()  # no version counter to key on, or autograd must see these ops",
        "    key = [(id(w), w.data_ptr(), w._version, w.device, w.dtype, w.shape, w.stride()) for w in weights]",
        '    cached = self.__dict__.get("_weights_cache")',
        "    if cached is None or cached[0] != key:",
        "        with torch.no_grad():",
        "            cached = (key, self._weight_values())",
        '        self.__dict__["_weights_cache"] = cached',
        "    return cached[1]",
        "",
        "def _weight_values(self):",
        '    """The weight-only steps of the plan (see _weights)."""',
    ]
    if has_kernels and any(not isinstance(s, TorchStep) for s in hoist.steps):
        out.append("    ext = _extension()")
    names = dict(state)
    for step in hoist.steps:
        out += step_lines(step, names)
    out.append(f"    return {cached_tuple(hoist)}")
    return "\n".join(out) + "\n"


def cached_tuple(hoist: Hoist) -> str:
    """`v_a, v_b` (or `v_a,`): the cached values as the forward unpacks them."""
    return ", ".join(f"v_{n}" for n in hoist.cached) + ("," if len(hoist.cached) == 1 else "")


def _computes(step: Step) -> tuple[str, ...]:
    return (step.node.name,) if isinstance(step, TorchStep) else step.replaces


def _reads(graph: Graph, step: Step) -> set[str]:
    """The values a step reads from outside itself."""
    inside = set(_computes(step))
    return {r.name for n in inside for r in graph[n].refs} - inside
