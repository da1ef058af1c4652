"""Concatenations that extend one another share one buffer (kernelfuse.plan.catbuffer): where a chain forms, what
the views look like to the kernels reading them, the emitted forward's copies, and where no chain may form."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_helpers import write_problem

from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.emit.module import build_module
from kernelfuse.load import load_problem
from kernelfuse.plan import GenStep, PlanOptions, TorchStep, interpret, make_plan
from kernelfuse.rewrite import rewrite

DENSE = Path(__file__).parent / "fixtures" / "problems" / "zoo_dense_cat.py"


def _plan(path: Path, **options):
    problem = load_problem(path)
    model = build_model(problem)
    return problem, model, make_plan(rewrite(capture(problem, model)), PlanOptions(**options))


def _shared(plan) -> dict[str, tuple[str, bool, list[tuple[str, int]]]]:
    return {s.node.name: (s.into.buffer, s.into.first, [(r.name, o) for r, o in s.into.copies])
            for s in plan.steps if isinstance(s, TorchStep) and s.into is not None}


def test_a_dense_block_and_the_nested_form_each_share_one_buffer():
    _, model, plan = _plan(DENSE)
    shared = _shared(plan)
    dense = {k: v for k, v in shared.items() if v[0] == "cat_2"}
    nested = {k: v for k, v in shared.items() if v[0] == "cat_5"}
    assert [v[1] for v in dense.values()] == [True, False, False]  # the first allocates, each copies its new part
    assert [[o for _, o in v[2]] for v in dense.values()] == [[0, 8], [12], [16]]
    assert [[o for _, o in v[2]] for v in nested.values()] == [[0, 2], [3], [4]]
    for name in ("cat", "cat_1"):  # a view of the buffer's first channels: the buffer's strides
        meta = plan.graph[name].meta
        assert meta.stride == plan.graph["cat_2"].meta.stride and meta.shape[1] == {"cat": 12, "cat_1": 16}[name]
    # each batch norm reads its view through the view's strides in a kernel of its own
    norms = [s for s in plan.steps if isinstance(s, GenStep) and s.spec is not None and s.spec.kind == "norm"]
    assert len(norms) == 3 and norms[1].source.strides[0] == 20 * 144


def test_the_emitted_forward_copies_each_operand_once_and_computes_eager_values():
    problem, model, plan = _plan(DENSE, generated=False)
    ref = build_model(problem)
    ref.load_state_dict(model.state_dict())
    fused = build_module(model, plan, None)
    type(fused).forward.__globals__["_fallback_reason"] = lambda module, inputs: None  # the fused path on the CPU
    text = emit_modelnew(problem, plan, generate(plan), "test")
    forward = text[text.index("    def forward("):]
    torch.manual_seed(3)
    inputs = problem.get_inputs()
    with torch.no_grad():
        expected = ref(*inputs)
        got = fused(*inputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert g.is_contiguous()
    for name in ("running_mean", "running_var"):  # the batch norms read the views in training mode
        torch.testing.assert_close(model.bns[2].get_buffer(name), ref.bns[2].get_buffer(name))
    assert forward.count(".copy_(") == 8 and forward.count("torch.empty_strided(") == 2  # 4 operands per chain


def test_the_plan_interpreter_agrees():
    problem, model, plan = _plan(DENSE)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = problem.get_inputs()
    ref = build_model(problem)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = interpret(plan, state, inputs)
        expected = ref(*inputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("body", "shared"), [
    # the first concatenation is an output too: a view of the last one would alias it
    ("a = torch.cat([x, x * 2], 1)\n    return a, torch.cat([x, x * 2, x * 3], 1)", set()),
    # the first is read through a view, whose strides were worked out for a dense tensor
    ("a = torch.cat([x, x * 2], 1)\n    return a.view(-1).sum(), torch.cat([x, x * 2, x * 3], 1)", set()),
    # an operand is written in place between the two: eager's second copy sees the new values
    ("y = x * 2\n    a = torch.cat([x, y], 1)\n    s = a.sum()\n    y.add_(1)\n"
     "    return s, torch.cat([x, y, x * 3], 1)", set()),
    # the plain chain, with a reader of the first
    ("a = torch.cat([x, x * 2], 1)\n    return a.sum(1), torch.cat([x, x * 2, x * 3], 1)", {"cat", "cat_1"}),
])
def test_a_chain_forms_only_where_the_views_are_invisible(tmp_path, body, shared):
    path = write_problem(tmp_path, "chain", f"def forward(self, x):\n    {body}", "[torch.randn(2, 3, 4)]")
    _, _, plan = _plan(path)
    assert set(_shared(plan)) == shared, plan.summary()


def test_weight_only_concatenations_stay_plain(tmp_path):
    """A concatenation of parameters alone is cached by the emitted file (kernelfuse.emit.hoist), not shared."""
    body = """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            w = self.lin.weight
            a = torch.cat([w, w * 2], 0)
            b = torch.cat([w, w * 2, w * 3], 0)
            return x @ a.t() + (x @ b.t()).sum(1, keepdim=True)
    """
    path = write_problem(tmp_path, "weights", body, "[torch.randn(2, 4)]")
    _, _, plan = _plan(path)
    assert not _shared(plan)
