"""GPU: the signature fixtures' fused files serve the traced call with their kernels (scalars, defaults,
keyword-only, containers, structured outputs, literal tensors), hand other calls to the original ops, and pass the
judge; their CUDA-graph variants rebuild structured outputs from the replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_signatures import CASES, FIXTURES, _import, _same
from torch.utils._pytree import tree_map

from kernelfuse.capture import capture
from kernelfuse.judge import EvalOptions, evaluate
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

pytestmark = pytest.mark.gpu


def _cuda(value: object) -> object:
    return tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, value)


def _close(a: object, b: object) -> bool:
    return _same(a, b, lambda x, y: torch.allclose(x, y, atol=1e-5, rtol=1e-5))


def _emitted(name: str, tmp_path: Path, graphed: bool = False) -> tuple[object, object, Path]:
    problem = load_problem(FIXTURES / f"{name}.py")
    plan = plan_variants(rewrite(capture(problem)))[0]
    plan = plan.as_graphed() if graphed else plan
    path = tmp_path / f"{name}_{plan.variant}.py"
    path.write_text(emit_file(problem, plan, "GPU test"))
    module = _import(path)
    model = problem.make_model().cuda()
    new = module.ModelNew(*problem.init_inputs()).cuda()
    new.load_state_dict(model.state_dict())
    return module, (problem, model, new), path


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_file_serves_the_traced_call_and_passes_the_judge(name, tmp_path):
    module, (problem, model, new), path = _emitted(name, tmp_path)
    real = module._fallback_reason
    served: list[bool] = []  # the guard is asked only where the call fits; True: the kernels serve it

    def guard(m, inputs):
        why = real(m, inputs)
        served.append(why is None)
        return why

    module._fallback_reason = guard
    cases = CASES[name](_cuda(problem.make_inputs(seed=1)))
    for args, kwargs, fused in cases:
        served.clear()
        with torch.no_grad():
            assert _close(new(*args, **kwargs), model(*args, **kwargs)), (args, kwargs)
        assert served == ([True] if fused else []), (args, kwargs, served)
    n_fused = sum(fused for _, _, fused in cases)
    stats = new.kernelfuse_stats()  # every other case is a call of another structure
    assert (stats["fused_calls"], stats["fallback_calls"]) == (n_fused, len(cases) - n_fused), stats
    assert set(stats["fallback_reasons"]) <= {"call"}, stats
    verdict = evaluate(problem.path, path, EvalOptions(trials=2, baselines=("eager",)))
    assert verdict.correct, verdict.reason


@pytest.mark.parametrize("name", ["sig_dict_output", "sig_structured_output", "sig_tensor_constants"])
def test_graphed_variant_rebuilds_the_structure_from_the_replay(name, tmp_path):
    _, (problem, model, new), _ = _emitted(name, tmp_path, graphed=True)
    inputs = _cuda(problem.make_inputs(seed=1))
    with torch.no_grad():
        expected = model(*inputs)
        for _ in range(4):  # one by one, capture, replay, replay
            assert _close(new(*inputs), expected)
    assert new.__dict__.get("_cuda_graph") is not None, "the forward was captured into a CUDA graph"
    assert new.kernelfuse_stats()["fused_calls"] == 4 and new.kernelfuse_stats()["fallback_calls"] == 0
