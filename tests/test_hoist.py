"""Emit — weight-only steps are computed once per weight version (kernelfuse.emit.hoist), on the CPU.

Which steps move into the weight cache on small graphs (and which stay: input-dependent, random, mutated,
returned, free views), and the emitted file's cache: reused between calls with unchanged weights, recomputed
after an in-place change, load_state_dict or a replaced tensor, bypassed where autograd needs the ops, and
always equal to the plan run by the CPU interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_helpers import write_problem

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.codegen.generated import tensor_args
from kernelfuse.emit import emit_modelnew
from kernelfuse.emit.hoist import plan_hoist
from kernelfuse.emit.module import build_module
from kernelfuse.load import load_problem
from kernelfuse.plan import GenStep, Plan, PlanOptions, interpret, make_plan
from kernelfuse.plan.aliasing import weight_only
from kernelfuse.plan.interpret import _run_generated
from kernelfuse.rewrite import rewrite

FIXTURE = Path(__file__).parent / "fixtures" / "problems" / "gemm_divide_sum.py"
SMALL_GEMM_SUM = """
def __init__(self):
    super().__init__()
    self.linear = nn.Linear(16, 24)

def forward(self, x):
    return (self.linear(x) / 2).sum(1, keepdim=True) * 1.5
"""


def _plan(tmp_path: Path, body: str, inputs: str = "[torch.randn(4, 16)]", generated: bool = True,
          name: str = "p") -> tuple[object, Plan]:
    problem = load_problem(write_problem(tmp_path, name, body, inputs))
    return problem, make_plan(rewrite(capture(problem)), PlanOptions(generated=generated))


def _ops(plan: Plan, names) -> list[str]:
    return sorted(plan.graph[n].op for n in names)


# ---- which steps are hoisted --------------------------------------------------------------------------------

def test_reduced_weights_are_cached_and_the_transpose_goes_with_them(tmp_path):
    _, plan = _plan(tmp_path, SMALL_GEMM_SUM)
    hoist = plan_hoist(plan)
    assert _ops(plan, hoist.cached) == ["sum.dim_IntList", "sum.dim_IntList"]
    assert [plan.graph[w].target for w in hoist.weights] == ["linear.weight", "linear.bias"]
    # the weight's transpose only feeds a cached sum: it leaves the forward too
    assert "t.default" in _ops(plan, hoist.skipped)
    # the input's cast and the small product stay in the forward
    assert {plan.graph[n].op for n in hoist.skipped} == {"t.default", "sum.dim_IntList"}


def test_a_view_of_a_weight_read_by_the_forward_is_not_cached(tmp_path):
    """Linear + ReLU: the only weight-only value is the weight's transpose, a free view: nothing to cache."""
    problem, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 24)

    def forward(self, x):
        return torch.relu(self.linear(x))
    """)
    hoist = plan_hoist(plan)
    assert "t.default" in _ops(plan, weight_only(plan.graph))
    assert hoist.cached == () and hoist.skipped == frozenset()
    assert "def _weights(" not in emit_modelnew(problem, plan, generate(plan), "test")


def test_input_dependent_and_random_values_stay_in_forward(tmp_path):
    _, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))
        self.v = nn.Parameter(torch.randn(8))

    def forward(self, x):
        noisy = torch.exp(self.v) * torch.rand_like(self.v)  # a random draw: new in every call
        dropped = F.dropout(self.v, 0.5, True)  # random too
        return x @ torch.tanh(self.w) + noisy + dropped + torch.sigmoid(x).sum()
    """, generated=False)
    constant = weight_only(plan.graph)
    ops = {plan.graph[n].op for n in constant}
    assert {"tanh.default", "exp.default"} <= ops
    assert not ops & {"rand_like.default", "native_dropout.default", "sigmoid.default", "sum.default"}
    # exp(v) is weight-only but feeds the random product only through mul with the draw: still cached, since the
    # forward reads it and computing it is work; the draw itself and everything after it are not
    hoist = plan_hoist(plan)
    assert _ops(plan, hoist.cached) == ["exp.default", "tanh.default"]


def test_a_buffer_updated_in_forward_is_not_weight_only(tmp_path):
    """A value read from a buffer the forward changes in place differs before and after the update."""
    _, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        y = x @ torch.tanh(self.w) * torch.exp(self.scale)
        self.scale.mul_(0.5)
        return y
    """, generated=False)
    constant = weight_only(plan.graph)
    assert not any(plan.graph[n].target == "scale" for n in constant)
    assert "exp.default" not in {plan.graph[n].op for n in constant}
    assert _ops(plan, plan_hoist(plan).cached) == ["tanh.default"]


def test_batch_norm_running_statistics_are_not_weight_only(tmp_path):
    _, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x) * torch.exp(self.bn.running_var)
    """, inputs="[torch.randn(4, 8)]", generated=False)
    constant = weight_only(plan.graph)
    assert not {"bn.running_mean", "bn.running_var"} & {plan.graph[n].target for n in constant}
    assert plan_hoist(plan).cached == ()


def test_returned_weight_only_values_stay_in_forward(tmp_path):
    """The caller must get fresh storage, never the cache (it could modify it) nor a view of it."""
    _, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        s = torch.exp(self.w)
        return x @ torch.tanh(self.w), s, torch.sigmoid(self.w).view(-1)
    """, generated=False)
    hoist = plan_hoist(plan)
    assert _ops(plan, hoist.cached) == ["tanh.default"]


# ---- the emitted file's cache, run on the CPU ----------------------------------------------------------------

class FakeExtension:
    """Generated kernels computed by the CPU interpreter, so the fused forward runs on the CPU."""

    def __init__(self, plan: Plan):
        self.calls: list[str] = []
        for step in plan.generated:
            setattr(self, step.kernel, self._kernel(step))

    def _kernel(self, step: GenStep):
        def run(*tensors):
            self.calls.append(step.kernel)
            env = {ref.name: t for (_, ref), t in zip(tensor_args(step), tensors, strict=True)}
            return _run_generated(step, env)
        return run


def _load(problem, plan: Plan) -> tuple[type, list[int]]:
    """The emitted ModelNew class with its fused path forced on (CPU), and a counter of weight computations."""
    sources = generate(plan)
    text = emit_modelnew(problem, plan, sources, "test")
    ns: dict = {"__name__": "emitted"}
    exec(compile(text, "emitted.py", "exec"), ns)  # noqa: S102 - our own emitted file
    if sources is not None:
        ext = FakeExtension(plan)
        ns["_extension"] = lambda: ext
        ns["_fallback_reason"] = lambda module, inputs: None
    cls = ns["ModelNew"]
    computed = [0]
    values = cls._weight_values

    def counted(self):
        computed[0] += 1
        return values(self)

    cls._weight_values = counted
    return cls, computed


def _expected(plan: Plan, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        (out,) = interpret(plan, state, [x])
    return out


@pytest.mark.parametrize("generated", [True, False], ids=["kernels", "torch-only"])
def test_cache_reused_until_a_weight_changes(tmp_path, generated):
    problem, plan = _plan(tmp_path, SMALL_GEMM_SUM, generated=generated, name=f"gs_{generated}")
    assert (plan.generated != []) == generated
    cls, computed = _load(problem, plan)
    torch.manual_seed(0)
    new = cls()
    model = problem.make_model(seed=0)
    new.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)

    def check(calls: int) -> None:
        with torch.no_grad():
            got = new(x)
        assert computed[0] == calls
        assert torch.equal(got, _expected(plan, new, x))  # the plan's own values, from the current weights
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)

    check(1)
    cached = new._weights_cache[1]
    check(1)  # unchanged weights: the same cached tensors
    assert all(a is b for a, b in zip(cached, new._weights_cache[1], strict=True))
    with torch.no_grad():  # an optimizer step's way: in place, under no_grad
        new.linear.weight.mul_(2)
        model.linear.weight.mul_(2)
    check(2)
    other = problem.make_model(seed=1)
    new.load_state_dict(other.state_dict())
    model.load_state_dict(other.state_dict())
    check(3)
    new.linear.bias.data = new.linear.bias.data + 1  # a replaced tensor (as `.to()` does): new data pointer
    model.linear.bias.data = model.linear.bias.data + 1
    check(4)
    new.linear.weight.data.mul_(-1)  # `.data` bypasses the version counter: the documented reset
    model.linear.weight.data.mul_(-1)
    del new._weights_cache
    check(5)


def test_autograd_sees_the_weight_ops(tmp_path):
    """Without kernels the forward is unguarded: with grad enabled it computes the weight values uncached, and
    the weight's gradient equals the model's."""
    problem, plan = _plan(tmp_path, SMALL_GEMM_SUM, generated=False)
    cls, computed = _load(problem, plan)
    new = cls()
    model = problem.make_model(seed=0)
    new.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    new(x).sum().backward()
    model(x).sum().backward()
    assert computed[0] == 1 and "_weights_cache" not in new.__dict__
    torch.testing.assert_close(new.linear.weight.grad, model.linear.weight.grad, rtol=1e-5, atol=1e-5)
    new(x).sum().backward()
    assert computed[0] == 2


def test_inference_mode_then_no_grad(tmp_path):
    problem, plan = _plan(tmp_path, SMALL_GEMM_SUM, generated=False)
    cls, computed = _load(problem, plan)
    new = cls()
    x = torch.randn(4, 16)
    with torch.inference_mode():
        a = new(x)
    with torch.no_grad():
        b = new(x)
    assert computed[0] == 1 and torch.equal(a, b)


def test_in_process_module_caches_on_the_wrapper(tmp_path):
    """kernelfuse.optimize's module runs the same forward text, reading the wrapped model's weights."""
    problem, plan = _plan(tmp_path, SMALL_GEMM_SUM, generated=False)
    model = problem.make_model(seed=0)
    fused = build_module(model, plan, None)
    type(fused).forward.__globals__["_fallback_reason"] = lambda module, inputs: None  # the fused path on the CPU
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = fused(x)
        cached = fused._weights_cache
        assert torch.equal(fused(x), first) and fused._weights_cache is cached
        model.linear.weight.add_(1.0)
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)
    assert fused._weights_cache is not cached


def test_fixture_emits_the_cache(tmp_path):
    """The bundled level-2-like fixture (used by the GPU test): its reduced weight leaves the forward."""
    problem = load_problem(FIXTURE)
    plan = make_plan(rewrite(capture(problem)))
    hoist = plan_hoist(plan)
    assert _ops(plan, hoist.cached) == ["sum.dim_IntList", "sum.dim_IntList"]
    text = emit_modelnew(problem, plan, generate(plan), "test")
    forward = text[text.index("    def forward("):text.index("    def _weights(")]
    assert "self._weights()" in forward and "self.linear.weight" not in forward


def test_judge_cpu_path_calls_the_cached_file_correct(tmp_path):
    """The cache memoises on weights, not inputs: the judge's checks (every timed call compared with the
    reference, rotated inputs, both modes) find nothing. Without kernels the emitted forward runs on the CPU, so
    the judge exercises the cache itself."""
    from kernelfuse.judge import EvalOptions, evaluate

    problem, plan = _plan(tmp_path, SMALL_GEMM_SUM, generated=False, name="judged")
    candidate = tmp_path / "judged_new.py"
    candidate.write_text(emit_modelnew(problem, plan, None, "test"))
    assert "self._weights()" in candidate.read_text()
    options = EvalOptions(device="cpu", baselines=("eager",), timing_reps=10, warmup=1, trials=3, timeout_s=180,
                          mode="both")
    verdict = evaluate(problem.path, candidate, options)
    assert verdict.correct and verdict.defence is None, verdict.reason


def test_weights_inside_a_sequential_are_read_by_path(tmp_path):
    """Parameter paths that are no identifiers (`0.weight`) are read with get_parameter in the cache too."""
    problem, plan = _plan(tmp_path, """
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(16, 24))

    def forward(self, x):
        return self.seq(x).mean(1)
    """, generated=False, name="seq")
    cls, computed = _load(problem, plan)
    new = cls()
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = new(x)
        torch.testing.assert_close(got, new._reference_forward(x), rtol=1e-5, atol=1e-5)
        new.seq[0].weight.add_(1.0)
        torch.testing.assert_close(new(x), new._reference_forward(x), rtol=1e-5, atol=1e-5)
    assert computed[0] == 2
    text = emit_modelnew(problem, plan, None, "test")
    assert "weights = (self.get_parameter('seq.0.weight'), self.get_parameter('seq.0.bias'))" in text
