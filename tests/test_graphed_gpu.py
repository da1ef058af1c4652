"""GPU: a plan replayed from a CUDA graph computes what eager computes, call after call, with batch norm's running
statistics updated once per call; a weight changed in place or a new input shape is noticed; the judge verifies
the graphed file; and on a launch-bound model the optimizer judges the graph variant.

Run on the GPU machine: `PYTHONPATH=. python -m pytest -m gpu tests/test_graphed_gpu.py`. No timing is asserted.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from optimizer_helpers import write_problem

from kernelfuse.bench.layout import measure_conv_layouts
from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.judge import EvalOptions, evaluate
from kernelfuse.load import load_problem
from kernelfuse.pipeline import OptimizeOptions, optimize_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

pytestmark = pytest.mark.gpu

# many small layers at batch 2: launch-bound, with training-mode batch norm (in-place running statistics)
DEEP = """
def __init__(self):
    super().__init__()
    self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                              nn.ReLU()) for _ in range(12))

def forward(self, x):
    for block in self.blocks:
        x = block(x) + x
    return torch.softmax(x.mean(dim=(2, 3)), dim=1)
"""


def _graphed_file(tmp_path: Path) -> tuple[Path, Path]:
    problem_path = write_problem(tmp_path, "deep", DEEP, "[torch.randn(2, 16, 16, 16)]")
    problem = load_problem(problem_path)
    graph = rewrite(capture(problem, build_model(problem)))
    # the plan the optimizer makes first on a GPU, each convolution's layout and arithmetic measured (its batch
    # norms are generated kernels)
    timings = measure_conv_layouts(graph)
    assert timings is not None
    plan = plan_variants(graph, conv_layouts={t.node: t.choice for t in timings},
                         fp32_convs=frozenset(t.node for t in timings if t.fp32))[0].as_graphed()
    assert plan.generated, plan.summary()
    out = tmp_path / "deep_graphed.py"
    out.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    return problem_path, out


def test_replays_match_eager_call_after_call(tmp_path: Path) -> None:
    problem_path, new_path = _graphed_file(tmp_path)
    torch.backends.cudnn.allow_tf32 = False  # both sides in full fp32: the comparison is about the graph
    ns_ref, ns_new = runpy.run_path(str(problem_path)), runpy.run_path(str(new_path))
    torch.manual_seed(0)
    ref = ns_ref["Model"]().cuda()
    torch.manual_seed(0)
    new = ns_new["ModelNew"]().cuda()
    with torch.no_grad():
        for call in range(6):
            x = torch.randn(2, 16, 16, 16, device="cuda")
            if call == 4:  # an optimizer step: the graph must see the new weight
                for model in (ref, new):
                    model.blocks[3][0].weight.mul_(0.5)
            torch.testing.assert_close(new(x), ref(x), rtol=1e-4, atol=1e-5)
        assert new.__dict__.get("_cuda_graph") is not None, "the graph was never captured"
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(new.get_buffer(name), buf, rtol=1e-4, atol=1e-6, msg=name)
        other = torch.randn(3, 16, 16, 16, device="cuda")  # another batch size: the original ops
        torch.testing.assert_close(new(other), ref(other), rtol=1e-4, atol=1e-5)


def test_judge_verifies_the_graphed_file(tmp_path: Path) -> None:
    problem_path, new_path = _graphed_file(tmp_path)
    verdict = evaluate(problem_path, new_path, EvalOptions(trials=5, baselines=("eager",)))
    print("graphed:", verdict.runtime_ms, "ms vs eager", verdict.eager_ms, verdict.details.get("streams"))
    assert verdict.correct, verdict.reason


def test_optimizer_judges_the_graph_of_a_launch_bound_model(tmp_path: Path) -> None:
    problem_path = write_problem(tmp_path, "deep", DEEP, "[torch.randn(2, 16, 16, 16)]")
    result = optimize_file(problem_path, tmp_path / "deep_new.py", OptimizeOptions(final_baselines=("eager",)))
    print(result.shipped, [(v.variant, v.verdict.correct, v.verdict.runtime_ms) for v in result.variants],
          result.notes)
    assert any(v.variant.endswith("+graph") for v in result.variants), result.notes
    # every graph variant verifies; another may be refused only by the accuracy rule, never by a crash or a wrong
    # value: the channels-last variant sums its twelve convolutions in other fp32 orders (cuDNN's channels-last
    # algorithms, TF32 off as eager's), which training-mode batch norm amplifies to ~1.3x the strict bound on an
    # H200 in some trials (before TF32 was off there: 78x)
    refused = [v for v in result.variants if not v.verdict.correct]
    assert all(v.verdict.defence == "precision" and not v.variant.endswith("+graph") for v in refused), \
        [(v.variant, v.verdict.reason) for v in refused]
    assert result.final is not None and result.final.correct
