"""Greedy shrinking of a failing model: drop outputs and ops, cut dims, plain inputs, fp32, while it still fails.

Each candidate is a smaller `ModelSpec`; one that no longer materializes (an op no longer fits its operands) is
skipped, one that keeps failing the same way (`still_fails`) is kept and shrinking starts over from it. The
passes go from coarse to fine, so a failure in one op of eight takes a few dozen runs, each milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from kernelfuse.fuzz.generate import InputSpec, ModelSpec, OpSpec, leaves, materialize
from kernelfuse.fuzz.kind import Invalid

SHRINK_BUDGET_S = 30.0  # per failure


def shrink(spec: ModelSpec, still_fails: Callable[[ModelSpec], bool], budget_s: float = SHRINK_BUDGET_S
           ) -> ModelSpec:
    """The smallest spec found within `budget_s` seconds for which `still_fails` holds (`spec` itself if none)."""
    deadline = time.monotonic() + budget_s
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for candidate in _candidates(spec):
            if time.monotonic() >= deadline:
                break
            if _valid(candidate) and still_fails(candidate):
                spec, improved = candidate, True
                break
    return spec


def _valid(spec: ModelSpec) -> bool:
    try:
        materialize(spec)
    except Invalid:
        return False
    return True


def _candidates(spec: ModelSpec) -> Iterator[ModelSpec]:
    """Smaller specs, coarse first: fewer outputs, fewer ops, fewer inputs, smaller dims, plainer inputs, fp32."""
    pruned = _prune(spec)
    if pruned != spec:  # dead ops gone (kept otherwise: a failure may need a value nothing reads)
        yield pruned
    if len(spec.outputs) > 1:
        for o in spec.outputs:
            yield replace(spec, outputs=(o,))
    for i in reversed(range(len(spec.ops))):
        for j, _ in enumerate(spec.ops[i].args):
            yield _bypass(spec, i, j)
    for i in range(len(spec.inputs)):
        if len(spec.inputs) > 1:
            yield _drop_input(spec, i)
    for i, inp in enumerate(spec.inputs):
        for d, size in enumerate(inp.shape):
            for smaller in sorted({1, size // 2, size - 1}):
                if 1 <= smaller < size:
                    yield _with_input(spec, i, replace(inp, shape=inp.shape[:d] + (smaller,) + inp.shape[d + 1:]))
        if inp.layout != "contiguous":
            yield _with_input(spec, i, replace(inp, layout="contiguous"))
        if inp.special:
            yield _with_input(spec, i, replace(inp, special=""))
    if spec.dtype != "float32":
        yield replace(spec, dtype="float32")
    if spec.training:
        yield replace(spec, training=False)


def _with_input(spec: ModelSpec, i: int, inp: InputSpec) -> ModelSpec:
    return replace(spec, inputs=spec.inputs[:i] + (inp,) + spec.inputs[i + 1:])


def _bypass(spec: ModelSpec, i: int, j: int) -> ModelSpec:
    """Op `i` removed, its readers (and the outputs) reading its operand `j` instead."""
    n_in = len(spec.inputs)
    victim, source = n_in + i, spec.ops[i].args[j]
    return _renumber(spec, victim, source)


def _drop_input(spec: ModelSpec, i: int) -> ModelSpec:
    """Input `i` removed, whatever read it reading another input (shapes permitting: else invalid)."""
    return _renumber(spec, i, 0 if i else 1, input_dropped=True)


def _renumber(spec: ModelSpec, victim: int, source: int, input_dropped: bool = False) -> ModelSpec:
    def move(v: int) -> int:
        v = source if v == victim else v
        return v - 1 if v > victim else v

    ops = [OpSpec(op.kind, tuple(move(a) for a in op.args), op.params) for k, op in enumerate(spec.ops)
           if input_dropped or k != victim - len(spec.inputs)]
    inputs = tuple(x for k, x in enumerate(spec.inputs) if not (input_dropped and k == victim))
    outputs = tuple(dict.fromkeys(move(o) for o in spec.outputs))
    return replace(spec, inputs=inputs, ops=tuple(ops), outputs=outputs)


def _prune(spec: ModelSpec) -> ModelSpec:
    """Ops whose value reaches no output removed (the outputs kept as they are)."""
    n_in = len(spec.inputs)
    live = set(spec.outputs)
    for k in reversed(range(len(spec.ops))):
        if n_in + k in live:
            live.update(spec.ops[k].args)
    keep = [k for k in range(len(spec.ops)) if n_in + k in live]
    index = {n_in + k: n_in + new for new, k in enumerate(keep)}
    index.update({i: i for i in range(n_in)})
    ops = tuple(OpSpec(spec.ops[k].kind, tuple(index[a] for a in spec.ops[k].args), spec.ops[k].params)
                for k in keep)
    outputs = tuple(index[o] for o in spec.outputs)
    return replace(spec, ops=ops, outputs=outputs or leaves(n_in, ops))
