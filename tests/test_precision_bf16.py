"""The bf16 policy: the model is captured as it runs under CUDA autocast (on a fake CUDA device, no GPU needed),
planned with autocast's casts as nodes, checked on the CPU against those captured ops, and returns what the
model returns."""

from __future__ import annotations

import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernelfuse.capture import capture, capture_module
from kernelfuse.capture.trace import module_state
from kernelfuse.cpucheck import _autocast_rule, check_plans, check_plans_on
from kernelfuse.load import load_problem
from kernelfuse.pipeline import OptimizeOptions, optimize_file
from kernelfuse.plan import Epilogue, Program, interpret, plan_variants, torch_calls_plan
from kernelfuse.rewrite import rewrite
from kernelfuse.verify.policy import get_policy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class Block(nn.Module):
    """Linear -> GELU -> LayerNorm, attention, a final Linear and softmax: each of CUDA autocast's kinds of op."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(F.gelu(self.up(x)))
        q = h.view(4, 2, 4, 4)
        return self.down(h).softmax(-1), F.scaled_dot_product_attention(q, q, q)


def test_only_the_bf16_policy_captures_under_autocast() -> None:
    assert get_policy("bf16").autocast is torch.bfloat16
    assert get_policy("strict").autocast is None and get_policy("tf32").autocast is None


def test_autocast_capture_follows_cudas_lists() -> None:
    graph = capture_module(Block().eval(), [torch.randn(4, 16)], autocast=torch.bfloat16)
    assert graph.autocast is torch.bfloat16
    dtype = {n.op: n.meta.dtype for n in graph.nodes if n.meta is not None}
    # matrix products and attention in bf16 (attention kept whole on the fake CUDA device), norms and softmax in fp32
    assert dtype["addmm.default"] == dtype["gelu.default"] == torch.bfloat16
    assert dtype["scaled_dot_product_attention.default"] == torch.bfloat16
    assert dtype["_softmax.default"] == torch.float32
    (norm,) = [n for n in graph.nodes if n.op == "native_layer_norm.default"]
    assert graph[norm.refs[0]].meta.dtype == torch.float32
    # what the model returns: float32, autocast's narrowing undone at the end
    assert [graph[r].meta.dtype for r in graph.outputs] == [torch.float32, torch.float32]
    # the graph names the CPU as its device, as a CPU trace does (the emitted forward uses its inputs' device)
    devices = {a[2] for n in graph.nodes for a in n.args if isinstance(a, tuple) and a[:2] == ("kw", "device")}
    assert devices <= {torch.device("cpu")}


def test_without_autocast_nothing_is_cast() -> None:
    graph = capture_module(Block().eval(), [torch.randn(4, 16)])
    assert graph.autocast is None and not any(n.op == "_to_copy.default" for n in graph.nodes)


def test_a_model_already_in_bf16_keeps_its_outputs_dtype() -> None:
    model = Block().eval().to(torch.bfloat16)
    graph = capture_module(model, [torch.randn(4, 16, dtype=torch.bfloat16)], autocast=torch.bfloat16)
    assert [graph[r].meta.dtype for r in graph.outputs] == [torch.float32, torch.bfloat16]  # softmax is fp32


def test_cpu_check_compares_with_the_captured_autocast_ops() -> None:
    model = Block().eval()
    graph = rewrite(capture_module(model, [torch.randn(4, 16)], autocast=torch.bfloat16))
    plans = plan_variants(graph, "bf16")
    checks = check_plans_on(model, plans, [torch.randn(4, 16)])
    assert all(c.ok for c in checks), [c.note for c in checks]
    assert all("captured autocast ops" in c.note for c in checks)


def test_cpu_check_of_a_wrong_plan_fails() -> None:
    """A generated kernel computing relu where the graph says gelu is caught: the check is no formality."""
    model = Block().eval()
    graph = rewrite(capture_module(model, [torch.randn(4, 16)], autocast=torch.bfloat16))
    plan = plan_variants(graph, "bf16")[0]

    def relu_for_gelu(step: object) -> object:
        if not isinstance(getattr(step, "epilogue", None), (Epilogue, Program)):
            return step
        programs = {}
        for name in ("prologue", "epilogue"):  # a norm's prologue holds the gelu it reads widened
            program = getattr(step, name, None)
            if program is None:
                continue
            statements = tuple(replace(st, op="relu", aten="relu.default", params=()) if st.aten == "gelu.default"
                               else st for st in program.statements)
            programs[name] = replace(program, statements=statements)
        return replace(step, **programs)

    wrong = replace(plan, steps=tuple(relu_for_gelu(s) for s in plan.steps))
    assert wrong.steps != plan.steps, "the plan has no generated gelu to break"
    (check,) = check_plans_on(model, [wrong], [torch.randn(4, 16)])
    assert not check.ok and "mismatch" in check.note


def test_cpu_check_applies_the_accuracy_rule_where_roundings_drift_apart() -> None:
    """Past the bf16 tolerance, a plan passes when it is no less accurate than the captured ops against the model in
    fp32 (in max and mean error, NaN where they have NaN): the ops' errors mirrored pass, amplified ones fail."""
    model = Block().eval()
    x = [torch.randn(4, 16)]
    graph = rewrite(capture_module(model, x, autocast=torch.bfloat16))
    plan = plan_variants(graph, "bf16")[0]
    state = dict(module_state(model))
    before = {k: v.clone() for k, v in state.items() if not isinstance(v, torch.nn.Parameter)}
    with torch.no_grad():
        ops = interpret(torch_calls_plan(graph), dict(state), x)
        exact = model(*x)
    mirrored = [2 * e - o for e, o in zip(exact, ops, strict=True)]  # as far from fp32 as the ops, other side
    amplified = [o + 3 * (o - e) for e, o in zip(exact, ops, strict=True)]
    with_nan = [t.clone() for t in mirrored]
    with_nan[0][0, 0] = float("nan")
    check = _autocast_rule("fused", model, plan, state, before, x, ops, mirrored)
    assert check is not None and check.ok and "accuracy rule" in check.note
    assert _autocast_rule("fused", model, plan, state, before, x, ops, amplified) is None
    assert _autocast_rule("fused", model, plan, state, before, x, ops, with_nan) is None


def test_optimize_on_the_cpu_writes_the_autocast_plan(tmp_path: Path) -> None:
    out = tmp_path / "gemm_bf16.py"
    result = optimize_file(EXAMPLES / "gemm_add_relu.py", out, OptimizeOptions(precision="bf16", use_gpu=False))
    text = out.read_text()
    assert "dtype=torch.bfloat16" in text and "_to_copy" in text
    assert result.cpu_checks and all(c.ok for c in result.cpu_checks), [c.note for c in result.cpu_checks]


def test_problem_capture_under_bf16_matches_capture_module() -> None:
    """The pipeline's capture of a problem file and the API's capture of the same module agree under autocast, and
    the CPU check passes the problem's plans (the small-batch twin is captured under autocast too)."""
    problem = load_problem(EXAMPLES / "gemm_add_relu.py")
    model = problem.make_model()
    graph = capture(problem, model, autocast=torch.bfloat16)
    live = capture_module(model, problem.make_inputs(seed=0), autocast=torch.bfloat16)
    assert [(n.op, n.meta) for n in graph.nodes] == [(n.op, n.meta) for n in live.nodes]
    assert any(n.op in ("mm.default", "addmm.default") and n.meta.dtype == torch.bfloat16 for n in graph.nodes)
    checks = check_plans(problem, model, rewrite(graph), plan_variants(rewrite(graph), "bf16"))
    assert checks and all(c.ok and not c.skipped for c in checks), [c.note for c in checks]


def _bf16_outputs(seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float64 answer, fp32 eager, bf16 eager up to 4 bf16 ulps above it, a candidate up to `noise` ulps below)."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(4096, generator=g, dtype=torch.float64) * 3
    ulp = exact.abs() * 2.0 ** -8
    bf16_eager = (exact + 4 * ulp * torch.rand(4096, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    candidate = exact - noise * ulp * torch.rand(4096, generator=g, dtype=torch.float64)
    return exact, exact.float(), bf16_eager, candidate.float()


@pytest.mark.parametrize(("noise", "passes"), [(4.0, True), (12.0, False)])
def test_bf16_rule_accepts_what_is_as_accurate_as_eager_under_autocast(noise: float, passes: bool) -> None:
    # two bf16 computations rounding at other points differ by bf16 eager's own error, far beyond 1e-2 on values
    # of a few units: the judge then asks whether the candidate is as accurate as eager under autocast
    from kernelfuse.judge.calls import TrialSettings, as_accurate_as_baseline
    from kernelfuse.verify import NumericsFlags, compare_outputs

    exact, fp32, bf16_eager, candidate = _bf16_outputs(0, noise)
    policy = get_policy("bf16")
    assert not compare_outputs(bf16_eager.float(), candidate, policy.atol, policy.rtol).ok
    settings = TrialSettings(torch.device("cpu"), policy, 0, NumericsFlags.capture(), NumericsFlags.capture(),
                             False, 0)
    assert as_accurate_as_baseline(settings, candidate, fp32, exact, bf16_eager) is passes
    strict = replace(settings, policy=get_policy("strict"))  # no autocast baseline: the rule does not apply
    assert not as_accurate_as_baseline(strict, candidate, fp32, exact, bf16_eager)
    nan = candidate.clone()
    nan[7] = float("nan")  # a NaN where eager under autocast has none fails whatever the errors
    assert not as_accurate_as_baseline(settings, nan, fp32, exact, bf16_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemm_add_relu", "conv2d_relu_biasadd"])
def test_bf16_optimize_verifies_against_eager_under_autocast(name: str, tmp_path: Path) -> None:
    """On the GPU: the file made under bf16 verifies (against eager under autocast), is timed against eager and
    torch.compile under autocast, and returns float32 like the model."""
    out = tmp_path / f"{name}_bf16.py"
    result = optimize_file(EXAMPLES / f"{name}.py", out,
                           OptimizeOptions(precision="bf16", trials=3, final_baselines=("eager",)))
    assert result.final is not None and result.final.correct, result.final
    assert result.final.precision == "bf16"
    namespace = runpy.run_path(str(out))
    problem = load_problem(EXAMPLES / f"{name}.py")
    init = problem.init_inputs()
    torch.manual_seed(1)
    model = problem.make_model(init_inputs=init).cuda()
    fused = namespace["ModelNew"](*init).cuda()
    fused.load_state_dict(model.state_dict())
    x = [t.cuda() for t in problem.make_inputs(seed=3)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(*x)
    with torch.no_grad():
        got = fused(*x)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected.float(), atol=1e-2, rtol=1e-2)
