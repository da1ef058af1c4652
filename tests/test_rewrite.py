"""Stage 3 — rewrite: each rule is exact, and proven on a tensor."""

from __future__ import annotations

import pytest
import torch
from optimizer_helpers import fused_names, write_problem

from kernelfuse.capture import Graph, Node, Ref, TensorMeta, capture
from kernelfuse.load import load_problem
from kernelfuse.plan import interpret, make_plan
from kernelfuse.rewrite import RULE_NAMES, div_by_scalar_to_mul, drop_identities, rewrite

LIN = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(8, 8)

def forward(self, x):
    y = self.lin(x)
{body}
"""


def _graph(tmp_path, body: str, name: str = "p", x: str = "[torch.rand(2, 8)]"):
    problem = load_problem(write_problem(tmp_path, name, LIN.format(body=body), x))
    return problem, capture(problem)


def _ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes if n.op not in ("input", "param", "buffer")]


def test_rules_are_in_order():
    # in-place ops become functional and dropout's CPU decomposition goes first: drop_identities keeps any graph
    # that still mutates something
    assert RULE_NAMES[:4] == ("inplace_to_functional", "dropout_as_on_cuda", "drop_identities", "div_by_scalar_to_mul")


def test_drop_identities_rewires_users_and_outputs(tmp_path):
    problem, g = _graph(tmp_path, """
    z = y.clone().detach()
    w = torch.ops.aten.alias(z)
    return torch.relu(w), w.clone()
    """)
    assert {"clone.default", "alias.default"} <= set(_ops(g))
    r = drop_identities(g)
    # the inner clone and the aliases go; the returned clone stays (the caller gets its own storage)
    assert _ops(r) == ["t.default", "addmm.default", "relu.default", "clone.default"]
    addmm = next(n for n in r.nodes if n.op == "addmm.default")
    relu = next(n for n in r.nodes if n.op == "relu.default")
    clone = next(n for n in r.nodes if n.op == "clone.default")
    assert relu.args == (Ref(addmm.name),) and clone.args == (Ref(addmm.name),)
    assert r.outputs == (Ref(relu.name), Ref(clone.name))
    # every reference resolves to a node that still exists
    names = {n.name for n in r.nodes}
    assert all(ref.name in names for n in r.nodes for ref in n.refs)
    assert all(ref.name in names for ref in r.outputs)
    # and the rewritten graph computes the same values (no plan fusion: relu's input is also an output)
    plan = make_plan(r)
    assert not plan.fused
    model = problem.make_model()
    x = problem.make_inputs(0)
    state = dict(model.named_parameters())
    with torch.no_grad():
        expected = model(*x)
        got = interpret(plan, state, x)
    for e, o in zip(expected, got, strict=True):
        assert torch.equal(e, o)


@pytest.mark.parametrize("body, copied", [
    ("return torch.relu(y), x.clone()", "input"),
    ("return torch.relu(y), self.lin.weight.clone()", "param"),
    ("return y, y.clone()", "addmm.default"),
    ("return torch.relu(y), x.clone().detach()", "input"),
])
def test_returned_copies_are_kept(tmp_path, body, copied):
    """A returned clone must not become the input, a weight or another output itself (aliasing changes)."""
    problem, g = _graph(tmp_path, f"""
    {body}
    """, name=f"copy_{copied.split('.')[0]}")
    r = rewrite(g)
    out = r[r.outputs[-1]]
    assert out.op == "clone.default" and r[out.args[0]].op == copied
    assert len(set(r.outputs)) == len(r.outputs)
    plan = make_plan(r)
    model = problem.make_model()
    x = problem.make_inputs(0)
    state = dict(model.named_parameters())
    with torch.no_grad():
        got = interpret(plan, state, x)
        expected = model(*x)
    storages = {t.untyped_storage().data_ptr() for t in [*x, *state.values()]}
    assert got[-1].untyped_storage().data_ptr() not in storages
    assert got[0].untyped_storage().data_ptr() != got[-1].untyped_storage().data_ptr()
    for e, o in zip(expected, got, strict=True):
        assert torch.equal(e, o)


def test_drop_identities_unlocks_fusion(tmp_path):
    _, g = _graph(tmp_path, """
    return torch.sigmoid(y.clone())
    """)
    plan = make_plan(rewrite(g))
    assert [s.chain(plan.graph) for s in plan.fused] == ["addmm -> sigmoid"]


def test_drop_identities_keeps_clone_protecting_an_in_place_op(tmp_path):
    problem, g = _graph(tmp_path, """
    z = y.clone()
    z.add_(1.0)
    return y, z
    """)
    assert "add_.Tensor" in _ops(g) and "clone.default" in _ops(g)
    assert drop_identities(g) is g
    assert _ops(rewrite(g, disabled=("inplace_to_functional",))) == _ops(g)
    # the clone's fresh copy is the add_'s only reader: the in-place op becomes add, and then the clone can go
    r = rewrite(g)
    assert _ops(r) == ["t.default", "addmm.default", "add.Tensor"]
    # the rewritten graph still computes two different values
    plan = make_plan(r)
    model = problem.make_model()
    x = problem.make_inputs(0)
    with torch.no_grad():
        y, z = interpret(plan, dict(model.named_parameters()), x)
        ey, ez = model(*x)
    assert torch.equal(y, ey) and torch.equal(z, ez) and torch.equal(z, y + 1.0)


def test_drop_identities_keeps_clone_with_memory_format(tmp_path):
    _, g = _graph(tmp_path, """
    return y.clone(memory_format=torch.contiguous_format)
    """)
    assert "clone.default" in _ops(drop_identities(g))


def _hand_graph(divisor: object, dtype=torch.float32) -> Graph:
    meta = TensorMeta((4,), dtype, (1,))
    return Graph((Node("x", "input", meta=meta, target=0), Node("d", "div.Tensor", (Ref("x"), divisor), meta)),
                 (Ref("d"),))


def test_div_by_scalar_uses_float32_reciprocal():
    c = 1e-3
    (node,) = [n for n in div_by_scalar_to_mul(_hand_graph(c)).nodes if n.op != "input"]
    inv = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(c, dtype=torch.float32)).item()
    assert node.op == "mul.Tensor" and node.args == (Ref("x"), inv)
    # 1/c rounded in float32 arithmetic, not the double 1/c rounded once: these differ for c = 1e-3
    assert inv != torch.tensor(1 / c, dtype=torch.float32).item()
    assert inv == pytest.approx(1000.0, rel=1e-6)


def test_div_by_int_scalar_is_rewritten():
    (node,) = [n for n in div_by_scalar_to_mul(_hand_graph(4)).nodes if n.op != "input"]
    assert node.op == "mul.Tensor" and node.args[1] == 0.25


@pytest.mark.parametrize("divisor, dtype", [(2.0, torch.float64), (2, torch.int64), (True, torch.float32)])
def test_div_not_rewritten(divisor, dtype):
    g = _hand_graph(divisor, dtype)
    assert div_by_scalar_to_mul(g).nodes[1].op == "div.Tensor"


def test_div_by_tensor_not_rewritten():
    meta = TensorMeta((4,), torch.float32, (1,))
    g = Graph((Node("x", "input", meta=meta, target=0), Node("y", "input", meta=meta, target=1),
               Node("d", "div.Tensor", (Ref("x"), Ref("y")), meta)), (Ref("d"),))
    assert div_by_scalar_to_mul(g).nodes[2].op == "div.Tensor"


@pytest.mark.parametrize("c", [1e-3, 3.0, 7.0])
def test_div_rewrite_numerics_match_aten_cuda(tmp_path, c):
    """The plan computes x * float32(1/c), which is what ATen's CUDA kernel computes for x / c."""
    problem, g = _graph(tmp_path, f"""
    return y / {c!r}
    """, name=f"div_{str(c).replace('.', '_').replace('-', '_')}", x="[torch.randn(64, 8)]")
    r = rewrite(g)
    assert "div.Tensor" not in _ops(r)
    plan = make_plan(r)
    assert [s.chain(r) for s in plan.fused] == ["addmm -> mul"]
    model = problem.make_model()
    x = problem.make_inputs(0)
    state = dict(model.named_parameters())
    with torch.no_grad():
        lin = model.lin(x[0])
        (got,) = interpret(plan, state, x)
        expected = model(*x)
    cuda_style = lin * torch.tensor(1.0, dtype=torch.float32).div(torch.tensor(c, dtype=torch.float32))
    assert torch.equal(got, cuda_style)
    torch.testing.assert_close(got, expected, rtol=2e-7, atol=0)  # one rounding apart from true division


def test_rewrite_of_example_graphs_is_identity(tmp_path):
    from optimizer_helpers import EXAMPLES

    for name in ("gemm_add_relu", "gemm_sigmoid_scaling_residualadd", "conv2d_relu_biasadd"):
        g = capture(load_problem(EXAMPLES / f"{name}.py"))
        assert rewrite(g) == g


def test_rewrite_div_then_fuse_whole_chain(tmp_path):
    _, g = _graph(tmp_path, """
    return torch.relu(y.clone() / 2.0)
    """)
    plan = make_plan(rewrite(g))
    assert len(plan.fused) == 1
    assert {n.op for n in plan.graph.nodes if n.name in fused_names(plan)} == {"addmm.default", "mul.Tensor",
                                                                                "relu.default"}


def test_rewrite_work_grows_with_firings_not_graph_size_times_firings(tmp_path, monkeypatch):
    """A hand-written RNN loop computes the same value twice per step: common-subexpression elimination fires
    once per step. Each firing copies only the readers of the replaced node, never the whole graph (the stage
    was quadratic: 87 CPU seconds on KernelBench's 256-step VanillaRNN), and the result is the same."""
    import dataclasses

    from kernelfuse.rewrite import apply_rules

    path = write_problem(tmp_path, "loop", """
        def forward(self, x, h):
            for _ in range(60):
                h = torch.tanh(x + h) * torch.tanh(x + h)
            return h
        """, "[torch.rand(4, 8), torch.rand(4, 8)]")
    graph = capture(load_problem(path))
    copies = 0
    real_replace = dataclasses.replace

    def counting_replace(obj, **changes):
        nonlocal copies
        copies += 1
        return real_replace(obj, **changes)

    monkeypatch.setattr(dataclasses, "replace", counting_replace)
    result = apply_rules(graph)
    firings = sum(f.rule == "common_subexpressions" for f in result.fired)
    assert firings == 120  # x + h and its tanh, once per step
    ops = [n.op for n in result.graph.nodes]
    assert ops.count("tanh.default") == 60 and ops.count("add.Tensor") == 60 and ops.count("mul.Tensor") == 60
    assert copies <= 6 * firings, copies  # whole-graph copies would be ~120 x 300 node copies


@pytest.mark.parametrize(("body", "kept"), [
    ("    torch.empty_like(y)\n    return y * 2.0", False),  # nothing reads it: no effect, dropped
    ("    buf = torch.empty_like(y)\n    buf.copy_(y)\n    return buf * 2.0", True),  # written, then read
])
def test_an_allocation_nothing_reads_is_dropped(tmp_path, body, kept):
    # batch norm's reserve buffer: under autocast an `empty` per norm stayed in the forward, a call each
    from kernelfuse.rewrite import apply_rules

    problem, graph = _graph(tmp_path, body)
    assert any(op.startswith("empty") for op in _ops(graph))
    out = apply_rules(graph).graph
    assert any(op.startswith("empty") for op in _ops(out)) == kept, _ops(out)
    plan = make_plan(out)
    x = problem.make_inputs(0)
    model = problem.make_model()
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        assert torch.equal(interpret(plan, state, x)[0], model(*x))
