"""FLOPs of the problem after kernelfuse's exact rewrites: the floor of the function, not of one way to write it.

Each rewrite rule is an identity, and its tests prove it. So a candidate that computes a sum over a GEMM's
output as a matrix-vector product legitimately does far less arithmetic than the reference does. The floor takes
the smaller FLOP count of the reference and of its rewritten graph. Such a candidate then stays plausible, while
one that skips work no identity removes is still caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernelfuse.bench.floor import count_flops
from kernelfuse.load import Problem


def rewritten_flops(problem: Problem, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> int | None:
    """FLOPs of one call of the rewritten graph on `model`'s state and `inputs`; None where no rule fires or the
    graph cannot run here (the floor then keeps the reference's count)."""
    from kernelfuse.capture import capture
    from kernelfuse.capture.trace import module_state
    from kernelfuse.plan import interpret, torch_calls_plan
    from kernelfuse.rewrite import apply_rules

    try:
        result = apply_rules(capture(problem))  # traced on fake tensors: the real model is only read below
        if not result.fired:
            return None
        plan = torch_calls_plan(result.graph)
        # buffers are copied: running statistics must not move because the floor was measured
        state = {name: t if isinstance(t, torch.nn.Parameter) else t.clone() for name, t in module_state(model)}
        with torch.no_grad():
            flops = count_flops(lambda: interpret(plan, state, list(inputs)))
    except Exception:  # noqa: BLE001 - no rewritten count is a missing refinement, not a failure
        return None
    return flops if flops > 0 else None
