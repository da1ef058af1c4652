"""The CPU check's other eager references: CUDA's arithmetic (CudaConvolutionBias) and the captured layouts
(CapturedLayouts), tried only after a failed comparison, and the graph's ops each correctly rounded (the float64
rule's second reference); a plan faithful to one passes, a wrong plan still fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernelfuse.cpucheck as cpucheck
from kernelfuse.capture import build_model, capture
from kernelfuse.load import load_problem
from kernelfuse.plan import optimizer_variants
from kernelfuse.rewrite import apply_rules
from kernelfuse.verify.cuda_eager import CapturedLayouts, CudaConvolutionBias

FUZZ = Path(__file__).parent / "fixtures" / "problems" / "fuzz"
# regression files each plan of which matches only one of the other references, and the note that names it
FAITHFUL = {"log_after_conv_bias": cpucheck.RETRIES[True, False]}
# its norm kernel reads a permuted source: once faithful only to the captured layouts (ATen's batch norm on that
# layout), now to plain eager, the interpreter computing a norm on a dense copy (too ill-conditioned for the
# wrong-plan test: eager's own error against float64 exceeds 0.1% of its output)
PERMUTED_NORM = "batch_norm_of_huge_pow"
ROUNDED = "log2_of_bf16_attention_near_zero"  # passes only against each op correctly rounded


def test_captured_layouts_lay_out_new_tensors_as_the_meta_kernels():
    """A CPU batch norm of a permuted input is contiguous, the meta one permuted: under the mode it is permuted,
    the same values; a view and an in-place result stay what they alias."""
    x = torch.randn(1, 4, 1, 2, 10).transpose(-1, -2)
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    plain = F.batch_norm(x, mean, var)
    with torch.no_grad(), CapturedLayouts():
        laid = F.batch_norm(x, mean, var)
        y = torch.randn(3, 4)
        grown, flipped = y.add_(1.0), y.t()
    assert plain.is_contiguous() and laid.stride() == x.stride() and torch.equal(laid, plain)
    assert grown is y and flipped._base is y


def test_cuda_convolution_bias_is_added_after_the_product():
    """As ATen's cuDNN path: the product, then the bias (bit for bit what the rewrite plans); a depthwise
    convolution, whose CUDA kernel takes the bias in its own sum, is left to the CPU's call."""
    x, w, b = torch.randn(2, 4, 5, 6, 3), torch.randn(6, 4, 1, 2, 1), torch.randn(6)
    dw, db = torch.randn(4, 1, 3, 3, 3), torch.randn(4)
    with CudaConvolutionBias():
        split, depthwise = F.conv3d(x, w, b), F.conv3d(x, dw, db, groups=4)
    assert torch.equal(split, F.conv3d(x, w) + b.view(6, 1, 1, 1))
    assert torch.equal(depthwise, F.conv3d(x, dw, db, groups=4))


def _checks(stem: str, monkeypatch: pytest.MonkeyPatch, scale: float | None = None) -> tuple[list, list]:
    """Every plan of a regression file checked on its own inputs (its interpreted outputs times `scale`, if given),
    and the eager references the check ran, by (cuda, layouts)."""
    problem = load_problem(FUZZ / f"{stem}.py")
    model, inputs = build_model(problem), problem.make_inputs(0)
    plans = optimizer_variants(apply_rules(capture(problem, model)).graph)
    runs, run_model, interpret = [], cpucheck._run_model, cpucheck.interpret

    def recorded(*args: object) -> object:
        runs.append(tuple(args[5:]))
        return run_model(*args)

    monkeypatch.setattr(cpucheck, "_run_model", recorded)
    if scale is not None:
        monkeypatch.setattr(cpucheck, "interpret", lambda *a: [t * scale for t in interpret(*a)])
    return cpucheck.check_plans_on(model, plans, inputs), runs


@pytest.mark.parametrize("stem", sorted(FAITHFUL))
def test_a_plan_faithful_to_another_reference_passes(stem, monkeypatch):
    checks, _ = _checks(stem, monkeypatch)
    assert all(c.ok and c.max_abs_err == 0.0 and c.note.endswith(f"(against eager with {FAITHFUL[stem]})")
               for c in checks), [c.note for c in checks]


def test_a_norm_kernel_over_a_permuted_source_matches_plain_eager(monkeypatch):
    checks, runs = _checks(PERMUTED_NORM, monkeypatch)
    assert checks and all(c.ok and c.max_abs_err == 0.0 and "against eager with" not in c.note
                          for c in checks), [c.note for c in checks]
    assert set(runs) == {()}


@pytest.mark.parametrize("stem", sorted(FAITHFUL))
def test_a_wrong_plan_still_fails_against_every_reference(stem, monkeypatch):
    """Outputs 0.1% off (a kernel's constant wrong): every reference is tried, and the float64 rule, and the
    check still fails."""
    checks, runs = _checks(stem, monkeypatch, scale=1.001)
    assert checks and all(not c.ok and not c.skipped and c.note.startswith("mismatch") for c in checks)
    assert set(runs) == {()} | set(cpucheck.RETRIES)


def test_each_op_correctly_rounded_is_the_float64_op_rounded_once():
    """The rounded reference computes each op in float64 and rounds its result to the op's dtype (bf16 tanh of a
    sum: two roundings, not eager's fp32-internal ones); a view still aliases its input."""
    from kernelfuse.capture import capture_module
    from kernelfuse.plan import torch_calls_plan
    from kernelfuse.plan.interpret import run_env

    class Chain(torch.nn.Module):
        def forward(self, x, y):
            return torch.tanh(x @ y).t()

    x, y = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    graph = capture_module(Chain(), [x, y])
    plan = torch_calls_plan(graph)
    env = run_env(plan, {}, [x, y], rounded=True)
    (out,) = [env[r.name] for r in graph.outputs]
    expected = torch.tanh((x.double() @ y.double()).to(torch.bfloat16).double()).to(torch.bfloat16).t()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert out._base is not None  # the transpose is a view, as eager's


def test_a_plan_faithful_to_each_op_correctly_rounded_passes(monkeypatch):
    checks, _ = _checks(ROUNDED, monkeypatch)
    assert checks and all(c.ok and c.note.endswith("(no less accurate than eager there)") for c in checks), \
        [c.note for c in checks]


def test_a_wrong_plan_fails_against_each_op_correctly_rounded(monkeypatch):
    """Outputs 2% off (bf16's tolerance is 2%, so only the float64 rules can judge them): both fail."""
    checks, _ = _checks(ROUNDED, monkeypatch, scale=1.02)
    assert checks and all(not c.ok and c.note.startswith("mismatch") for c in checks), [c.note for c in checks]
