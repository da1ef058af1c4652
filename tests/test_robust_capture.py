"""Capture and CPU check on models the fake-tensor construction used to refuse or the batch cut used to break.

Each problem here is a small fixture of a pattern found in KernelBench: dtype conversions and `.item()` in the
constructor, fp16/bf16 models, tensor constants made in forward, plain tensor attributes, batch-sized views,
transformer layers, models too large to build on the host.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_helpers import write_problem

from kernelfuse.capture import build_model, capture
from kernelfuse.cpucheck import check_plans
from kernelfuse.errors import Unsupported
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

FIXTURES = Path(__file__).parent / "fixtures" / "problems"


def checked(path: Path):
    """(graph, plans, checks) as the optimizer makes them."""
    problem = load_problem(path)
    model = build_model(problem)
    graph = rewrite(capture(problem, model))
    plans = plan_variants(graph)
    return graph, plans, check_plans(problem, model, graph, plans)


def test_constructor_converting_to_half_and_reading_item():
    graph, _, checks = checked(FIXTURES / "tiny_half_ctor.py")
    assert graph[graph.outputs[0]].meta.dtype == torch.float16
    assert all(c.ok for c in checks), [c.note for c in checks]


def test_bf16_model_and_inputs(tmp_path):
    path = write_problem(tmp_path, "bf16", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 16).to(torch.bfloat16)

        def forward(self, x):
            return torch.sigmoid(self.lin(x)) * 2.0
        """, "[torch.rand(8, 32, dtype=torch.bfloat16)]")
    graph, _, checks = checked(path)
    assert graph[graph.outputs[0]].meta.dtype == torch.bfloat16
    assert all(c.ok for c in checks), [c.note for c in checks]


def test_scalar_constants_made_in_forward_and_batch_view_recaptured():
    graph, _, checks = checked(FIXTURES / "tiny_forward_constant.py")
    assert any(n.op == "scalar_tensor.default" for n in graph.nodes)
    assert graph[graph.outputs[0]].meta.shape == (16, 4 * 6 * 6)  # the view keeps the captured batch
    assert all(c.ok for c in checks), [c.note for c in checks]
    assert all("(2, 3, 8, 8)" in c.note for c in checks), "checked on a re-captured small batch"


def test_large_constant_made_in_forward_is_unsupported_with_the_fix(tmp_path):
    """Small tensors made from literals are graph constants (tests/test_signatures.py); a large one is a weight in
    disguise: Unsupported at capture (the original module ships), saying to register it."""
    path = write_problem(tmp_path, "vec_const", """
        def __init__(self):
            super().__init__()

        def forward(self, x):
            return x * torch.tensor([1.0, 2.0, 3.0] * 1000)
        """, "[torch.rand(4, 3000)]")
    with pytest.raises(Unsupported, match="register_buffer"):
        capture(load_problem(path))


def test_plain_tensor_attribute_and_global_batch_view_checked_at_full_shape(tmp_path):
    path = write_problem(tmp_path, "h0", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.h0 = torch.randn(batch_size, 8)

        def forward(self, x):
            y = torch.relu(self.lin(x) + self.h0)
            return y.view(batch_size, 2, 4)
        """, "[torch.rand(batch_size, 8)]", header="batch_size = 6\n")
    graph, _, checks = checked(path)
    assert any(n.op == "buffer" and n.target == "h0" for n in graph.nodes)
    assert all(c.ok for c in checks), [c.note for c in checks]
    assert all("(6, 8)" in c.note for c in checks), "a batch-bound model is checked at its full (small) shape"


TRANSFORMER = """
def __init__(self):
    super().__init__()
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    self.enc = nn.TransformerEncoder(layer, num_layers=1)

def forward(self, x):
    return self.enc(x)
"""


def test_transformer_encoder_is_traced(tmp_path):
    path = write_problem(tmp_path, "tenc", TRANSFORMER, "[torch.rand(4, 10, 32)]")
    graph = capture(load_problem(path))
    assert graph[graph.outputs[0]].meta.shape == (4, 10, 32)
    assert any(n.op.startswith("addmm") for n in graph.nodes)


def test_model_too_large_for_the_host_is_built_on_meta_and_its_check_skipped(tmp_path):
    path = write_problem(tmp_path, "huge", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(24576, 24576)  # 2.25 GiB of fp32 weights

        def forward(self, x):
            return torch.relu(self.lin(x))
        """, "[torch.rand(2, 24576)]")
    problem = load_problem(path)
    model = build_model(problem)
    assert model.lin.weight.is_meta
    graph = rewrite(capture(problem, model))
    assert graph[graph.outputs[0]].meta.shape == (2, 24576)
    checks = check_plans(problem, model, graph, plan_variants(graph))
    assert all(c.skipped and not c.ok and "meta device" in c.note for c in checks)


def test_check_that_runs_too_long_is_skipped_not_failed():
    problem = load_problem(FIXTURES / "tiny_half_ctor.py")
    model = build_model(problem)
    graph = rewrite(capture(problem, model))
    plans = plan_variants(graph)
    checks = check_plans(problem, model, graph, plans, timeout_s=1e-6)
    assert all(c.skipped and not c.ok and "limit" in c.note for c in checks)


def test_a_plan_that_computes_something_else_fails_the_check(monkeypatch):
    import kernelfuse.cpucheck as cpucheck

    real = cpucheck.interpret
    monkeypatch.setattr(cpucheck, "interpret", lambda plan, state, x: [t + 1e-3 for t in real(plan, state, x)])
    _, _, checks = checked(FIXTURES / "tiny_forward_constant.py")
    assert all(c.status == "FAILED" and "mismatch" in c.note for c in checks), [c.note for c in checks]
