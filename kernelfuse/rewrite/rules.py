"""The rewrite stage: named rules applied in the order of `RULES`, each individually switchable.

A rule is either a whole-graph pass (Graph -> Graph) or a local rule (a match at one node, see
`kernelfuse.rewrite.engine`). The stage applies the list again until no rule fires, so a rule can expose work
for one listed before it, and records every firing. Every rule states its identity and conditions in its
docstring and has a CPU test that proves it on random values and one where its condition fails.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial

import torch

from kernelfuse.capture import Graph, Node, Ref
from kernelfuse.errors import Fallback, KernelfuseError, one_line
from kernelfuse.rewrite.anchors import conv_bias_to_epilogue, linear_bias_to_kernel
from kernelfuse.rewrite.chains import (
    cat_without_empties,
    collapse_clamps,
    common_subexpressions,
    double_views,
    mish_written_out,
    neutral_scalars,
    pad_without_padding,
)
from kernelfuse.rewrite.dropout import dropout_as_on_cuda
from kernelfuse.rewrite.engine import Match, RuleFiring, drop_dead, rebuild, rewire, run_local
from kernelfuse.rewrite.inplace import inplace_to_functional
from kernelfuse.rewrite.losses import losses_as_pointwise
from kernelfuse.rewrite.monotonic import reduce_before_monotonic
from kernelfuse.rewrite.norms import norm_statistics_apart
from kernelfuse.rewrite.reductions import (
    avg_pool_linear_output,
    reduce_before_affine,
    reduce_linear_output,
    size1_reductions,
)
from kernelfuse.rewrite.vector_norms import vector_norm_as_reduction

# Ops that return their input's value unchanged; in a traced, non-mutating graph they can be bypassed.
IDENTITY_OPS = frozenset({"alias.default", "detach.default", "clone.default", "lift_fresh_copy.default"})
# Of those, the ones that return fresh storage: kept when returned, so the caller never receives an input, a
# parameter or another output itself where the model returned a copy.
COPY_OPS = frozenset({"clone.default", "lift_fresh_copy.default"})
MAX_ROUNDS = 10  # passes over the whole list; each round that fires removes or shrinks work, so few are needed


def drop_identities(graph: Graph) -> Graph:
    """Bypass alias/detach/clone so they do not split a fusable chain (skipped if the graph mutates anything).

    A clone the forward returns is kept: the caller gets fresh storage, as from the model, not an input, a
    parameter or another output.
    """
    if any(n.op.split(".")[0].endswith("_") for n in graph.nodes):
        return graph  # an in-place op: a clone may be protecting a value, keep the graph as traced
    returned_copies = set()  # the first copy on each output's chain of identities
    for ref in graph.outputs:
        node = graph[ref]
        while node.op in IDENTITY_OPS and node.args and isinstance(node.args[0], Ref):
            if node.op in COPY_OPS:
                returned_copies.add(node.name)
                break
            node = graph[node.args[0]]
    rename: dict[str, Ref] = {}
    kept = []
    for node in graph.nodes:
        if node.op in IDENTITY_OPS and not node.keywords and node.name not in returned_copies:
            rename[node.name] = _resolve(node.args[0], rename)
            continue
        kept.append(rewire(node, rename))
    outputs = tuple(_resolve(r, rename) for r in graph.outputs)
    return rebuild(graph, kept, outputs)


def div_by_scalar_to_mul(graph: Graph) -> Graph:
    """`x / c` for a Python scalar c becomes `x * (1/c)` with 1/c rounded to float32, as ATen's CUDA kernel does."""
    nodes = []
    for node in graph.nodes:
        if node.op == "div.Tensor" and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
                and not isinstance(node.args[1], bool) and node.meta is not None \
                and node.meta.dtype in (torch.float32, torch.float16, torch.bfloat16):
            inv = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(node.args[1]), dtype=torch.float32))
            node = Node(node.name, "mul.Tensor", (node.args[0], inv.item()), node.meta, node.target)
        nodes.append(node)
    return rebuild(graph, nodes, graph.outputs)


class UnknownRewriteError(KernelfuseError):
    """A rule named to be switched off (`--no-rewrite NAME`) does not exist: a usage error."""

    exit_code = 2


@dataclass(frozen=True)
class Rule:
    """A named rule: `run` maps a graph to the rewritten graph and the firings it made."""

    name: str
    run: Callable[[Graph], tuple[Graph, tuple[RuleFiring, ...]]]
    doc: str

    def __str__(self) -> str:
        return f"{self.name}: {self.doc}"


@dataclass(frozen=True)
class RewriteResult:
    graph: Graph
    fired: tuple[RuleFiring, ...]
    failed: tuple[Fallback, ...] = ()  # rules that raised: skipped from then on, the others still applied

    @property
    def rules_fired(self) -> tuple[str, ...]:
        """Names of the rules that fired, in order of first firing, each once."""
        return tuple(dict.fromkeys(f.rule for f in self.fired))

    def summary(self) -> str:
        if not self.fired:
            return "rewrites: none fired"
        counts = [f"{name} x{sum(f.rule == name for f in self.fired)}" for name in self.rules_fired]
        return "rewrites: " + ", ".join(counts)


def _whole(fn: Callable[[Graph], Graph]) -> Rule:
    def run(graph: Graph) -> tuple[Graph, tuple[RuleFiring, ...]]:
        out = fn(graph)
        if out == graph:
            return graph, ()
        new = {n.name: n.op for n in out.nodes}
        changed = tuple(n.name for n in graph.nodes if new.get(n.name) != n.op)
        return out, (RuleFiring(fn.__name__, changed, _first_line(fn)),)

    return Rule(fn.__name__, run, _first_line(fn))


def _local(match: Match) -> Rule:
    return Rule(match.__name__, partial(run_local, match.__name__, match), _first_line(match))


def _first_line(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().split("\n")[0]


RULES: tuple[Rule, ...] = (
    _local(inplace_to_functional),
    _whole(dropout_as_on_cuda),
    _whole(drop_identities),
    _whole(div_by_scalar_to_mul),
    _local(losses_as_pointwise),
    _local(vector_norm_as_reduction),
    _local(common_subexpressions),
    _local(neutral_scalars),
    _local(cat_without_empties),
    _local(pad_without_padding),
    _local(double_views),
    _local(collapse_clamps),
    _local(mish_written_out),
    _local(size1_reductions),
    _local(reduce_before_monotonic),
    _local(reduce_before_affine),
    _local(reduce_linear_output),
    _local(avg_pool_linear_output),
    _local(conv_bias_to_epilogue),
    _local(linear_bias_to_kernel),
    _local(norm_statistics_apart),
)
RULE_NAMES: tuple[str, ...] = tuple(r.name for r in RULES)


def apply_rules(graph: Graph, disabled: Collection[str] = ()) -> RewriteResult:
    """Apply every rule not in `disabled`, in order, until none fires; the result records each firing. Values
    nothing reads are dropped first, whatever rules run: the trace keeps them (a pool's indices, squeezed)."""
    unknown = sorted(set(disabled) - set(RULE_NAMES))
    if unknown:
        raise UnknownRewriteError(f"unknown rewrite rule {', '.join(unknown)}: the rules are "
                                  f"{', '.join(RULE_NAMES)}")
    graph = drop_dead(graph)
    fired: list[RuleFiring] = []
    failed: list[Fallback] = []
    skip = set(disabled)
    for _ in range(MAX_ROUNDS):
        before = len(fired)
        for rule in RULES:
            if rule.name in skip:
                continue
            try:
                graph, new = rule.run(graph)
            except Exception as err:  # noqa: BLE001 - a rule's bug: the graph stays as it was before that rule
                skip.add(rule.name)
                failed.append(Fallback("rewrite", rule.name, one_line(err)))
                continue
            fired.extend(new)
        if len(fired) == before:
            break
    return RewriteResult(graph, tuple(fired), tuple(failed))


def rewrite(graph: Graph, disabled: Collection[str] = ()) -> Graph:
    """The rewritten graph (see `apply_rules` for the record of what fired)."""
    return apply_rules(graph, disabled).graph


def _resolve(arg: object, rename: dict[str, Ref]) -> Ref:
    if not isinstance(arg, Ref):
        raise TypeError(f"a graph reference was expected, found {type(arg).__name__} {arg!r}")
    while arg.name in rename:
        arg = rename[arg.name]
    return arg
