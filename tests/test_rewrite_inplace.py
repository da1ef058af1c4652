"""inplace_to_functional: in-place ops on fresh, single-reader values become out-of-place ops, proven in float64
on random values with NaN/Inf against the traced graph and eager, and shown not to fire where the mutation could
be observed (inputs, parameters, buffers, views, a second reader, a dtype the in-place op would cast)."""

from __future__ import annotations

import pytest
import torch
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from rewrite_helpers import prove, signed, specials
from torch import nn

from kernelfuse.capture import Graph, capture_module
from kernelfuse.rewrite import apply_rules
from kernelfuse.rewrite.inplace import functional_twin

RULE = "inplace_to_functional"


def inplace_ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes if n.op.split(".")[0].endswith("_")]


@pytest.mark.parametrize("fn", [
    lambda m, x: (x * 2).relu_(),
    lambda m, x: (x + m.scale).add_(m.scale),  # add_.Tensor with a broadcast operand
    lambda m, x: (x * 2).add_(x, alpha=0.5),  # a keyword argument carried over
    lambda m, x: (x * 2).add_(2.5),  # a scalar operand
    lambda m, x: torch.nn.functional.hardtanh(x - 1, -0.5, 2.0, inplace=True),
    lambda m, x: (x * 3).sigmoid_(),
    lambda m, x: (x * 3).clamp_(min=-1.0),
])
def test_single_ops_exact_with_nan_inf(fn):
    r = prove(fn, specials(2, 3, 4, 5), rule=RULE, rtol=0)
    assert inplace_ops(r.graph) == []


def test_chain_of_inplace_ops_exact_with_nan_inf():
    """A residual block's tail: out += identity; relu_; a clamp and a scale, each on the previous result."""
    def fn(m, x, identity):
        out = x * m.scale
        out += identity
        out.relu_()
        torch.nn.functional.hardtanh(out, 0.0, 6.0, inplace=True)
        return out.mul_(0.5)

    r = prove(fn, specials(2, 3, 4, 5), specials(2, 3, 4, 5), rule=RULE, rtol=0)
    assert inplace_ops(r.graph) == []
    assert sum(f.rule == RULE for f in r.fired) == 4


def test_later_reads_of_the_mutated_tensor_see_the_new_value():
    """`z = y.relu_(); return z + y`: make_fx points both reads at the relu_ node, so y itself has one reader and
    the rewrite is exact (both operands are relu(y))."""
    def fn(m, x):
        y = x * 2
        z = y.relu_()
        return z + y

    r = prove(fn, specials(3, 4), rule=RULE, rtol=0)
    relu = next(n for n in r.graph.nodes if n.op == "relu.default")
    add = next(n for n in r.graph.nodes if n.op == "add.Tensor")
    assert [a.name for a in add.refs] == [relu.name, relu.name]


def test_batch_norm_output_is_fresh():
    """A getitem of native_batch_norm is new storage: its relu_ becomes relu (the conv -> bn -> ReLU(inplace) idiom)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    result = apply_rules(capture_module(model, [torch.randn(2, 3, 8, 8)]))
    assert RULE in result.rules_fired
    assert "relu.default" in [n.op for n in result.graph.nodes]
    # what remains in place is batch norm's counter update on its buffer: never rewritten
    assert inplace_ops(result.graph) == ["add_.Tensor"]


# ---- where it must not fire -------------------------------------------------------------------------------------

class Fwd(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn, ops", [
    (lambda x: x.relu_() * 2, ["relu_.default"]),  # an input
    (lambda x: x.add_(1.0).relu_() * 2, ["add_.Tensor", "relu_.default"]),  # add_'s result aliases the input
])
def test_not_on_inputs(fn, ops):
    """Checked on the graph only: running it mutates the input, so before and after could not share inputs."""
    result = apply_rules(capture_module(Fwd(fn), [torch.randn(3, 4)]))
    assert RULE not in result.rules_fired
    assert inplace_ops(result.graph) == ops


def row_relu_then_read_base(m, x):
    y = x * 2
    y[0].relu_()  # writes y's storage through a select: the read of y below sees it
    return y + 1


@pytest.mark.parametrize("fn", [
    row_relu_then_read_base,
    lambda m, x: (x * 2).view(-1).relu_(),  # a view
    lambda m, x: (x * 2)[:, 1:].relu_(),  # a slice
    lambda m, x: (x * 2)[0].add_(1.0),  # a select
    lambda m, x: (x * 2).split(1)[0].relu_(),  # a chunk of a split
    lambda m, x: (x * 2).unbind(0)[1].sigmoid_(),  # one of unbind's views
])
def test_not_on_views(fn):
    prove(fn, signed(3, 4), rule=RULE, fires=False)


def test_not_on_a_value_with_a_view_read_after_the_mutation():
    """v was taken before relu_ and read after: eager sees the mutated values through v, so the relu_ must stay."""
    def fn(m, x):
        y = x * 2
        v = y.view(-1)
        y.relu_()
        return v * 3

    r = prove(fn, signed(3, 4), rule=RULE, fires=False)
    assert inplace_ops(r.graph) == ["relu_.default"]


def test_not_on_a_value_with_another_reader():
    """A second reader of x (here one that ran before the mutation) keeps the op in place (conservative)."""
    def fn(m, x):
        y = x * 2
        w = y + 1
        y.relu_()
        return y * w

    prove(fn, specials(3, 4), rule=RULE, fires=False)


class WithState(nn.Module):
    """In-place updates of a parameter and of a buffer, under no_grad as a model would do them."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        with torch.no_grad():
            self.p.mul_(0.5)
        self.b.add_(1.0)
        return x * self.p + self.b


def test_not_on_parameters_or_buffers():
    graph = capture_module(WithState(), [torch.randn(3, 4)])
    assert sorted(inplace_ops(graph)) == ["add_.Tensor", "mul_.Tensor"]
    result = apply_rules(graph)
    assert RULE not in result.rules_fired
    assert sorted(inplace_ops(result.graph)) == ["add_.Tensor", "mul_.Tensor"]


class Promote(nn.Module):
    def forward(self, x, y):
        return (x * 2).add_(y)  # float32 += float64 stays float32; add(x, y) would be float64


def test_not_when_the_out_of_place_dtype_differs():
    result = apply_rules(capture_module(Promote(), [torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)]))
    assert RULE not in result.rules_fired
    assert inplace_ops(result.graph) == ["add_.Tensor"]


@pytest.mark.parametrize("op, twin", [
    ("relu_.default", "relu.default"), ("add_.Tensor", "add.Tensor"), ("hardtanh_.default", "hardtanh.default"),
    ("mul_.Tensor", "mul.Tensor"), ("leaky_relu_.default", "leaky_relu.default"),
    ("bernoulli_.float", None),  # random: its twin is no pure op
    ("relu.default", None), ("getitem", None), ("input", None), ("__iand__.Tensor", None),
])
def test_functional_twin(op, twin):
    assert functional_twin(op) == twin


# ---- the planner sees the functional graph ----------------------------------------------------------------------

def test_batch_norm_and_inplace_relu_plan_as_one_kernel(tmp_path):
    path = write_problem(tmp_path, "bn_relu_inplace", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)))
    """, "[torch.randn(2, 3, 10, 10)]")
    problem, graph, plans = pipeline(path)
    for plan in plans:
        norms = [s for s in plan.generated if "native_batch_norm" in s.chain(plan.graph)]
        assert [s.chain(plan.graph) for s in norms] == ["native_batch_norm -> relu"], plan.summary()
        assert not any(s.node.op.startswith("relu") for s in plan.unfused)
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)


def test_residual_add_and_relu_fuse_into_the_norm_kernel(tmp_path):
    path = write_problem(tmp_path, "residual_inplace", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            identity = x
            out = self.bn(self.conv(x))
            out += identity
            return self.relu(out)
    """, "[torch.randn(2, 8, 6, 6)]")
    problem, graph, plans = pipeline(path)
    assert inplace_ops(graph) == ["add_.Tensor"]  # batch norm's counter only
    for plan in plans:
        chains = [s.chain(plan.graph) for s in plan.generated]
        assert "native_batch_norm -> add -> relu" in chains, plan.summary()
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)
