"""Each algebraic rewrite rule, proven in float64 on random values (negatives, zeros, and NaN/Inf where the rule
claims them) by running the graph before and after, and shown not to fire where its condition fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import node_values
from torch import nn

from kernelfuse.capture import Graph, capture_module
from kernelfuse.rewrite import RULE_NAMES, apply_rules, rewrite
from kernelfuse.rewrite.rules import UnknownRewriteError

INF, NAN = float("inf"), float("nan")


class Fn(nn.Module):
    """A forward given as a function of (module, *inputs), with a Linear(8 -> 6) and a per-channel parameter."""

    def __init__(self, fn, bias: bool = True):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(8, 6, bias=bias)
        self.scale = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, *xs):
        return self.fn(self, *xs)


def run_graph(graph: Graph, model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate a graph node by node with the ATen ops themselves (what the planner's torch steps run)."""
    env = node_values(graph, model, inputs)
    return [env[r.name] for r in graph.outputs]


def prove(fn, *inputs: torch.Tensor, rule: str, fires: bool = True, bias: bool = True, rtol: float = 1e-12):
    """Capture fn in float64, rewrite, check `rule` fired (or not) and both graphs agree on `inputs`."""
    torch.manual_seed(0)
    model = Fn(fn, bias).double()
    inputs = [t.double() for t in inputs]
    graph = capture_module(model, inputs)
    result = apply_rules(graph)
    assert (rule in result.rules_fired) == fires, result.fired
    with torch.no_grad():
        before = run_graph(graph, model, inputs)
        after = run_graph(result.graph, model, inputs)
        eager = model(*inputs)
    eager = list(eager) if isinstance(eager, tuple) else [eager]
    for b, a, e in zip(before, after, eager, strict=True):
        assert a.shape == b.shape == e.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12, equal_nan=True)
    return result


def signed(*shape: int) -> torch.Tensor:
    """Random values of both signs with exact zeros."""
    t = torch.randn(*shape) * 3
    t.view(-1)[::5] = 0.0
    return t


def specials(*shape: int) -> torch.Tensor:
    """`signed` with NaN, +Inf and -Inf mixed in."""
    t = signed(*shape)
    flat = t.view(-1)
    flat[1::7], flat[2::11], flat[3::13] = INF, -INF, NAN
    return t


# ---- reductions and normalisations over size-1 dims ------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda m, x: x.sum(1, keepdim=True),
    lambda m, x: x.sum(1),
    lambda m, x: x.mean((1, 3), keepdim=True),
    lambda m, x: x.amax(1),
    lambda m, x: x.amin(3, keepdim=True),
    lambda m, x: torch.logsumexp(x, 1, keepdim=True),
    lambda m, x: torch.logsumexp(x, 3),
    lambda m, x: x.max(1, keepdim=True)[0],
    lambda m, x: x.min(3)[0],
    lambda m, x: torch.softmax(x, 1),
    lambda m, x: torch.log_softmax(x, 3),
])
def test_size1_reductions_exact_with_nan_inf(fn):
    # scaled after: a reduction returned as is would make the output the input itself (never rewritten so)
    r = prove(lambda m, x: fn(m, x) * 2.0, specials(4, 1, 5, 1), rule="size1_reductions", rtol=0)
    assert not any(n.op.startswith(("sum", "mean", "amax", "amin", "logsumexp", "max", "min", "_softmax",
                                     "_log_softmax")) for n in r.graph.nodes)


@pytest.mark.parametrize("fn", [
    lambda m, x: x.sum(2, keepdim=True),  # a dim of size 5
    lambda m, x: x.max(1)[1],  # the indices are used
    lambda m, x: x.sum((1, 2)),  # one of the dims is not size 1
    lambda m, x: torch.softmax(x, 2),
])
def test_size1_reductions_negative(fn):
    prove(lambda m, x: fn(m, x) * 2, signed(4, 1, 5, 1), rule="size1_reductions", fires=False)


def test_size1_reduction_returned_is_kept():
    """Returned as is, the identity would make the output the input tensor itself: left alone."""
    prove(lambda m, x: x.sum(1, keepdim=True), signed(4, 1, 5), rule="size1_reductions", fires=False)


# ---- reductions before affine scalar ops ------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda m, x: (x * 2.5).sum(2, keepdim=True),
    lambda m, x: (x / 4.0).mean((1, 2)),
    lambda m, x: (3.0 * x).sum(1),
    lambda m, x: (x + 1.5).sum(2),  # sum of a constant: n * c
    lambda m, x: (x - 0.75).mean(2),  # mean of a constant: c
    lambda m, x: (x - 2.0).sum((0, 2), keepdim=True),
    lambda m, x: (x * m.scale).sum(2, keepdim=True),  # a per-channel tensor, constant along the reduced dim
    lambda m, x: (x / m.scale).mean((1, 2), keepdim=True),
    lambda m, x: nn.functional.avg_pool2d(x.unsqueeze(0) * m.scale, 2),
    lambda m, x: nn.functional.avg_pool2d(x.unsqueeze(0) * 3.0, 2, padding=1),  # zero padding scales to zero
    lambda m, x: (x * m.scale).sum(2),  # keepdim=False: the per-channel tensor loses the reduced dim too
    lambda m, x: (x / m.scale[0]).mean(2),  # a per-row tensor of lower rank
    lambda m, x: (x + m.scale).sum(2, keepdim=True),  # an added tensor broadcast along the sum: n * c
    lambda m, x: (x - m.scale).mean((1, 2)),  # mean of a broadcast tensor: itself
    lambda m, x: (x - x[0]).sum(0),  # a tensor broadcast along the reduced dim, of lower rank: 3 * c
    lambda m, x: (x + x[0, 0]).sum(2),  # a tensor that varies along the reduced dim: its own sum
    lambda m, x: (x - x[0, 0]).mean((0, 2), keepdim=True),
])
def test_reduce_before_affine(fn):
    r = prove(fn, signed(3, 4, 5), rule="reduce_before_affine", rtol=1e-10)
    ops = [n.op for n in r.graph.nodes]
    assert ops.index(next(o for o in ops if o in ("sum.dim_IntList", "mean.dim", "avg_pool2d.default"))) < \
        ops.index(next(o for o in ops if o in ("mul.Tensor", "div.Tensor", "add.Tensor", "sub.Tensor")))


@pytest.mark.parametrize("fn", [
    lambda m, x: (x * 0.0).sum(2),  # x*0 is NaN at Inf: left alone
    lambda m, x: (x * m.scale).sum(0, keepdim=True),  # the tensor varies along the reduced dim
    lambda m, x: nn.functional.avg_pool2d(x.unsqueeze(0) + 1.0, 2, padding=1),  # padding would count the 1.0
    lambda m, x: (x[:, :1] - x).sum(1),  # the broadcast operand is the minuend: x would be broadcast
    lambda m, x: (x * 2.0).amax(2),  # not a linear reduction (the monotonic rule's business, not this one's)
    lambda m, x: ((x * 2.0).sum(2), x * 2.0),  # the scaled value has another reader
])
def test_reduce_before_affine_negative(fn):
    prove(fn, signed(3, 4, 5), rule="reduce_before_affine", fires=False)


# ---- reductions after a Linear ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fn", [
    lambda m, x: m.lin(x).sum(1, keepdim=True),
    lambda m, x: m.lin(x).sum(-1),
    lambda m, x: m.lin(x).mean(1, keepdim=True),
    lambda m, x: (m.lin(x) / 2.0).sum(1, keepdim=True) * 1.5,  # through a scaling (the Gemm-Divide-Sum pattern)
    lambda m, x: (m.lin(x) - 1.0).mean(1),
    lambda m, x: (m.lin(x) - x[0, :6]).mean(1),  # a per-feature vector subtracted before the mean
    lambda m, x: ((m.lin(x) + x[1, 2:]) * 0.5).sum(1, keepdim=True),
])
def test_reduce_linear_output(fn, bias):
    r = prove(fn, signed(5, 8), rule="reduce_linear_output", bias=bias, rtol=1e-10)
    products = [n for n in r.graph.nodes if n.op in ("mm.default", "addmm.default", "mv.default", "addmv.default")]
    assert len(products) == 1 and products[0].meta.shape == (5,)  # a matrix-vector product (cuBLAS gemv)
    assert products[0].op == ("addmv.default" if bias else "mv.default")
    weight_sum = [n for n in r.graph.nodes if n.op in ("sum.dim_IntList", "mean.dim")
                  and r.graph[n.args[0]].op in ("t.default", "permute.default")]
    assert weight_sum  # the weight is reduced in the graph (from the parameter, on every call), not cached


@pytest.mark.parametrize("fn", [
    lambda m, x: m.lin(x).sum(0),  # over the batch, not the features
    lambda m, x: m.lin(x).amax(1),  # not linear
    lambda m, x: torch.sigmoid(m.lin(x)).sum(1),  # through a non-linear op
    lambda m, x: (m.lin(x).sum(1), m.lin(x)),  # the product is needed anyway
])
def test_reduce_linear_output_negative(fn):
    prove(fn, signed(5, 8), rule="reduce_linear_output", fires=False)


def test_reduce_linear_output_follows_weight_changes():
    """The reduced weight is part of the forward graph: a changed parameter changes the result."""
    torch.manual_seed(0)
    model = Fn(lambda m, x: m.lin(x).sum(1)).double()
    x = [signed(5, 8).double()]
    graph = rewrite(capture_module(model, x))
    with torch.no_grad():
        model.lin.weight.mul_(-3.0)
        got = run_graph(graph, model, x)[0]
        torch.testing.assert_close(got, model(*x), rtol=1e-12, atol=1e-12)


# ---- max/min commute with non-decreasing ops --------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda m, x: torch.relu(x).amax(2),
    lambda m, x: torch.sigmoid(x).amin(2, keepdim=True),
    lambda m, x: torch.tanh(x).max(2)[0],
    lambda m, x: torch.clamp(x, -1.0, 0.5).min(1, keepdim=True)[0],
    lambda m, x: nn.functional.hardtanh(x, -2.0, 2.0).amax((1, 2)),
    lambda m, x: nn.functional.leaky_relu(x, 0.2).amax(2),
    lambda m, x: (x * 2.0).amax(2),
    lambda m, x: (x / 3.0).amin(2),
    lambda m, x: (x + 1.0).amax(2),
    lambda m, x: (x + m.scale).amax(2, keepdim=True),  # a per-channel constant: constant along the reduced dim
    lambda m, x: nn.functional.max_pool2d(torch.tanh(x.unsqueeze(0)) * 2.0 + m.scale, 2),
    lambda m, x: nn.functional.max_pool2d(torch.relu(x.unsqueeze(0)), 2, 2, padding=1),
])
def test_reduce_before_monotonic_exact_with_nan_inf(fn):
    r = prove(fn, specials(3, 4, 6), rule="reduce_before_monotonic", rtol=0)
    reduce_at = min(i for i, n in enumerate(r.graph.nodes) if n.op in (
        "amax.default", "amin.default", "max.dim", "min.dim", "max_pool2d_with_indices.default"))
    assert all(n.op in ("input", "param", "buffer", "unsqueeze.default") for n in r.graph.nodes[:reduce_at])


@pytest.mark.parametrize("fn", [
    lambda m, x: nn.functional.gelu(x).amax(2),  # gelu is not monotonic
    lambda m, x: nn.functional.silu(x).amax(2),
    lambda m, x: nn.functional.mish(x).amin(2),
    lambda m, x: (x * -2.0).amax(2),  # a negative scale reverses the order
    lambda m, x: (x * m.scale).amax(2),  # a scale of unknown sign
    lambda m, x: nn.functional.leaky_relu(x, -0.5).amax(2),
    lambda m, x: torch.relu(x).max(2)[1],  # the indices are used: relu ties change argmax
    lambda m, x: (x + m.scale).amax(0, keepdim=True),  # the operand varies along the reduced dim
    lambda m, x: (x + m.scale).amax(2),  # keepdim=False: the operand would broadcast against other dims
    lambda m, x: (torch.relu(x).amax(2), torch.relu(x)),  # relu has another reader
])
def test_reduce_before_monotonic_negative(fn):
    prove(fn, signed(3, 4, 6), rule="reduce_before_monotonic", fires=False)


# ---- chains that collapse, values computed twice ----------------------------------------------------------------

@pytest.mark.parametrize("fn, op", [
    (lambda m, x: torch.clamp(torch.clamp(x, -2.0, 3.0), -1.0, 5.0) * 2.0, "clamp.default"),
    (lambda m, x: torch.relu(torch.relu(x)) * 2.0, "relu.default"),
    (lambda m, x: nn.functional.hardtanh(torch.relu(x)) * 2.0, "clamp.default"),
    (lambda m, x: torch.clamp(torch.clamp(x, min=0.0), max=1.0) * 2.0, "clamp.default"),
])
def test_collapse_clamps_exact_with_nan_inf(fn, op):
    r = prove(fn, specials(4, 6), rule="collapse_clamps", rtol=0)
    assert sum(n.op == op for n in r.graph.nodes) == 1


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.clamp(torch.clamp(x, 0.0, 1.0), 2.0, 3.0),  # disjoint ranges
    lambda m, x: torch.clamp(torch.relu(x) * 2.0, 0.0, 1.0),  # not adjacent
    lambda m, x: (torch.clamp(torch.relu(x), 0.0, 1.0), torch.relu(x)),  # inner clamp has another reader
])
def test_collapse_clamps_negative(fn):
    prove(fn, signed(4, 6), rule="collapse_clamps", fires=False)


MISH_FORMS = [
    lambda m, x: x * torch.tanh(F.softplus(x)),
    lambda m, x: torch.multiply(torch.tanh(F.softplus(x)), x),  # level-2 52's activation
    lambda m, x: torch.tanh(F.softplus(x, 1.0, 30.0)) * x + 1.0,  # a higher threshold: the same values
]


def _mish_input(*shape: int) -> torch.Tensor:
    """specials() and the region around softplus's threshold and tanh's saturation (9 to 21)."""
    t = specials(*shape)
    flat = t.view(-1)
    flat[::4] = torch.linspace(8.5, 21.0, flat[::4].numel())
    return t


@pytest.mark.parametrize("fn", MISH_FORMS)
def test_mish_written_out_exact(fn):
    r = prove(fn, _mish_input(6, 8), rule="mish_written_out", rtol=0)
    assert [n.op for n in r.graph.nodes if n.op in ("mish.default", "tanh.default", "softplus.default")] == \
        ["mish.default"]


@pytest.mark.parametrize("fn", MISH_FORMS)
def test_mish_written_out_exact_in_float32(fn):
    """float32 too (prove runs float64): within 2 ulp on the CPU, where ATen's vectorised mish, softplus and tanh
    round differently from each other (its CUDA kernels compute both forms with the same expf, log1pf, tanhf)."""
    model, x = Fn(fn), _mish_input(6, 8)
    graph = capture_module(model, [x])
    result = apply_rules(graph)
    assert "mish_written_out" in result.rules_fired
    with torch.no_grad():
        before, after = run_graph(graph, model, [x]), run_graph(result.graph, model, [x])
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=2.4e-7, atol=0, equal_nan=True)


@pytest.mark.parametrize("fn", [
    lambda m, x: x * torch.tanh(F.softplus(x, 2.0)),  # beta 2
    lambda m, x: x * torch.tanh(F.softplus(x, 1.0, 5.0)),  # a threshold below tanh's saturation
    lambda m, x: (x + 1.0) * torch.tanh(F.softplus(x)),  # another operand
    lambda m, x: (x * torch.tanh(F.softplus(x)), torch.tanh(F.softplus(x)) + 1.0),  # the tanh has another reader
])
def test_mish_written_out_negative(fn):
    prove(fn, signed(6, 8), rule="mish_written_out", fires=False)


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.sigmoid(x * 1.0),
    lambda m, x: torch.sigmoid(1 * x),
    lambda m, x: torch.sigmoid(x + 0.0),
    lambda m, x: torch.sigmoid(x - 0),
    lambda m, x: torch.sigmoid(x / 1.0),
])
def test_neutral_scalars_exact_with_nan_inf(fn):
    r = prove(fn, specials(4, 6), rule="neutral_scalars", rtol=0)
    assert [n.op for n in r.graph.nodes if n.op != "input" and n.op != "param"] == ["sigmoid.default"]


@pytest.mark.parametrize("fn, x", [
    (lambda m, x: torch.sigmoid(x * 1.5), signed(4, 6)),
    (lambda m, x: x * 1.0, signed(4, 6)),  # returned: the output would be the input itself
])
def test_neutral_scalars_negative(fn, x):
    prove(fn, x, rule="neutral_scalars", fires=False)


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.softmax(torch.cat([x.new_zeros(0), x.t()], -2), -1),  # legacy 1-d empty: a KV cache's start
    lambda m, x: torch.cat([x[:, :0], x * 2, x[:, 3:3]], 1).sigmoid(),  # size 0 along the dim
    lambda m, x: torch.cat([x[:0], x, x.new_zeros(0), x + 1], 0),  # two operands stay: a smaller cat
])
def test_cat_without_empties(fn):
    r = prove(fn, specials(4, 6), rule="cat_without_empties", rtol=0)
    cats = [n for n in r.graph.nodes if n.op == "cat.default"]
    assert all(len(n.args[0]) == 2 for n in cats) and len(cats) <= 1


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.sigmoid(F.pad(x, (0, 0, 0, 0))) * 2,  # Swin's window padding on its own shapes
    lambda m, x: F.pad(x.t(), [0, 0]),  # a transposed input: the copy keeps its strides, as ATen's clone does
])
def test_pad_without_padding(fn):
    r = prove(fn, specials(4, 6), rule="pad_without_padding", rtol=0)
    assert not [n for n in r.graph.nodes if n.op == "constant_pad_nd.default"]


def test_pad_without_padding_keeps_a_real_pad():
    prove(lambda m, x: F.pad(x, (0, 1)) * 2, signed(4, 6), rule="pad_without_padding", fires=False)


def test_cat_without_empties_keeps_a_promoting_empty():
    """cat promotes over the empty operand too: float32 empty with a float16 tensor is float32, kept as traced."""
    prove(lambda m, x: torch.cat([torch.zeros(0, dtype=torch.float64), x.half()], 0), signed(4, 6),
          rule="cat_without_empties", fires=False)


@pytest.mark.parametrize("fn", [
    lambda m, x: torch.sigmoid(x.t().t()),
    lambda m, x: torch.sigmoid(x.transpose(0, 1).transpose(1, 0)),
    lambda m, x: torch.sigmoid(x.unsqueeze(0).permute(1, 2, 0).permute(2, 0, 1)),
    lambda m, x: torch.sigmoid(x.unsqueeze(0).permute(1, 2, 0).permute(1, 0, 2)),
])
def test_double_views(fn):
    prove(fn, signed(4, 6), rule="double_views", rtol=0)


def test_double_views_negative():
    prove(lambda m, x: torch.sigmoid(x.t().contiguous().t()), signed(4, 6), rule="double_views", fires=False)


def test_common_subexpressions():
    r = prove(lambda m, x: torch.sigmoid(x) * torch.sigmoid(x) + torch.tanh(x), specials(4, 6),
              rule="common_subexpressions", rtol=0)
    assert sum(n.op == "sigmoid.default" for n in r.graph.nodes) == 1


@pytest.mark.parametrize("fn", [
    lambda m, x: nn.functional.dropout(x, 0.5) + nn.functional.dropout(x, 0.5),  # random: two different masks
    lambda m, x: (torch.sigmoid(x), torch.sigmoid(x)),  # two outputs must not become one tensor
])
def test_common_subexpressions_negative(fn):
    torch.manual_seed(0)
    model = Fn(fn).double()
    x = [signed(4, 6).double()]
    result = apply_rules(capture_module(model, x))
    assert "common_subexpressions" not in result.rules_fired


# ---- the stage: order, switches, record -------------------------------------------------------------------------

def _gemm_sum(m, x):
    return torch.logsumexp((m.lin(x) * 0.5).sum(1, keepdim=True), 1, keepdim=True)


def test_rules_switch_off_one_by_one_and_all():
    torch.manual_seed(0)
    model = Fn(_gemm_sum).double()
    x = [signed(5, 8).double()]
    graph = capture_module(model, x)
    full = apply_rules(graph)
    assert {"size1_reductions", "reduce_before_affine", "reduce_linear_output"} <= set(full.rules_fired)
    partial = apply_rules(graph, disabled={"reduce_linear_output"})
    assert "reduce_linear_output" not in partial.rules_fired and "size1_reductions" in partial.rules_fired
    assert any(n.op == "addmm.default" and n.meta.shape == (5, 6) for n in partial.graph.nodes)
    assert apply_rules(graph, disabled=RULE_NAMES).graph == graph
    assert "reduce_linear_output" in full.summary() and "none fired" in apply_rules(graph, RULE_NAMES).summary()


def test_unknown_rule_is_a_one_line_usage_error():
    with pytest.raises(UnknownRewriteError, match="unknown rewrite rule no_such_rule: the rules are") as err:
        apply_rules(capture_module(Fn(_gemm_sum), [torch.rand(2, 8)]), disabled={"no_such_rule"})
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_every_rule_is_documented_and_listed_once():
    from kernelfuse.rewrite import RULES

    assert len(set(RULE_NAMES)) == len(RULE_NAMES) == len(RULES)
    assert all(r.doc for r in RULES)


def test_float32_graph_keeps_dtypes_and_runs(tmp_path):
    """In float32 the rewritten Gemm-Sum graph runs and stays as accurate as eager against float64."""
    torch.manual_seed(0)
    model = Fn(_gemm_sum)
    x = [torch.randn(64, 8)]
    result = apply_rules(capture_module(model, x))
    with torch.no_grad():
        got = run_graph(result.graph, model, x)[0]
        eager = model(*x)
        ref = Fn(_gemm_sum).double()
        ref.load_state_dict(model.state_dict())
        exact = ref(x[0].double())
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 2 * (eager.double() - exact).abs().max() + 1e-6


# ---- the optimize pipeline and the command line -----------------------------------------------------------------

GEMM_SUM = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 32)

def forward(self, x):
    return torch.logsumexp((self.lin(x) / 2.0).sum(1, keepdim=True), 1, keepdim=True)
"""


def test_optimize_cpu_only_records_and_switches_rules(tmp_path):
    from optimizer_helpers import write_problem

    from kernelfuse.pipeline import OptimizeOptions, optimize_file

    path = write_problem(tmp_path, "gemm_sum", GEMM_SUM, "[torch.randn(4, 16)]")
    logs: list[str] = []
    result = optimize_file(path, tmp_path / "out.py", OptimizeOptions(use_gpu=False), log=logs.append)
    fired = {f.rule for f in result.rewrites}
    assert {"reduce_linear_output", "size1_reductions", "reduce_before_affine"} <= fired
    assert any("reduce_linear_output" in line for line in logs)
    assert result.cpu_checks and all(c.ok for c in result.cpu_checks), result.cpu_checks
    off = optimize_file(path, tmp_path / "off.py", OptimizeOptions(use_gpu=False,
                        disabled_rewrites=("reduce_linear_output",)), log=lambda s: None)
    assert "reduce_linear_output" not in {f.rule for f in off.rewrites} and off.rewrites
    none = optimize_file(path, tmp_path / "none.py", OptimizeOptions(use_gpu=False, no_rewrites=True),
                         log=lambda s: None)
    assert none.rewrites == ()


def test_cli_unknown_rule_exits_2(tmp_path, capsys):
    from optimizer_helpers import write_problem

    from kernelfuse.cli import main

    path = write_problem(tmp_path, "gemm_sum", GEMM_SUM, "[torch.randn(4, 16)]")
    code = main(["optimize", str(path), "-o", str(tmp_path / "o.py"), "--cpu-only", "--no-rewrite", "nope"])
    assert code == 2 and "unknown rewrite rule nope" in capsys.readouterr().err


# ---- average pooling over a Linear's features --------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fn", [
    lambda m, x: nn.functional.avg_pool2d(m.lin(x).unsqueeze(1).unsqueeze(-2), (1, 2)).squeeze(-2).squeeze(1),
    lambda m, x: torch.relu(nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 3)).squeeze(1),
    lambda m, x: nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 4).squeeze(1) * 2.0,  # 6 features: one window
])
def test_avg_pool_linear_output(fn, bias):
    r = prove(fn, signed(5, 8), rule="avg_pool_linear_output", bias=bias, rtol=1e-10)
    (product,) = [n for n in r.graph.nodes if n.op in ("mm.default", "addmm.default")]
    assert product.meta.shape[1] < 6 and not any(n.op.startswith("avg_pool") for n in r.graph.nodes)


@pytest.mark.parametrize("fn", [
    lambda m, x: nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 2, stride=1).squeeze(1),  # overlapping windows
    lambda m, x: nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 2, padding=1).squeeze(1),  # padded
    lambda m, x: nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 4, ceil_mode=True).squeeze(1),  # partial window
    lambda m, x: nn.functional.avg_pool1d(torch.sigmoid(m.lin(x)).unsqueeze(1), 2).squeeze(1),  # not linear
    lambda m, x: (nn.functional.avg_pool1d(m.lin(x).unsqueeze(1), 2).squeeze(1), m.lin(x)),  # GEMM needed anyway
    lambda m, x: nn.functional.avg_pool2d(m.lin(x).view(5, 1, 2, 3), (1, 3)).flatten(1),  # features split in 2-d
])
def test_avg_pool_linear_output_negative(fn):
    prove(fn, signed(5, 8), rule="avg_pool_linear_output", fires=False)


def test_rules_see_the_rewritten_graph_after_its_readers_were_indexed():
    """A graph whose reader index was built before rewriting (the planner builds it) is rewritten as a fresh one:
    every rule works on the new nodes, not a stale index of the old ones."""
    torch.manual_seed(0)
    model = Fn(_gemm_sum).double()
    x = [signed(5, 8).double()]
    graph = capture_module(model, x)
    for node in graph.nodes:
        graph.users(node.name)
    assert {"size1_reductions", "reduce_before_affine", "reduce_linear_output"} <= set(apply_rules(graph).rules_fired)


# ---- a convolution's bias moves into the kernel after it ---------------------------------------------------------

def _conv(groups: int = 1, transposed: bool = False, dims: int = 2):
    """fn(m, x, w, b) for a convolution given its weight and bias as inputs, followed by a sigmoid."""
    name = f"conv{'_transpose' if transposed else ''}{dims}d"
    op = getattr(nn.functional, name)
    return lambda m, x, w, b: torch.sigmoid(op(x, w, b, stride=2 if transposed else 1, padding=1, groups=groups))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("transposed, groups", [(False, 1), (False, 2), (True, 1), (True, 2)])
def test_conv_bias_to_epilogue_exact_with_nan_inf(dims, transposed, groups):
    x = specials(2, 4, *(5,) * dims)
    w = signed(*((4, 6 // (groups if transposed else 1)) if transposed else (6, 4 // groups)), *(3,) * dims)
    r = prove(_conv(groups, transposed, dims), x, w, signed(6), rule="conv_bias_to_epilogue")
    (conv,) = [n for n in r.graph.nodes if n.op == "convolution.default"]
    assert conv.args[2] is None and any(n.op == "add.Tensor" for n in r.graph.nodes)


@pytest.mark.parametrize("fn, w, b", [
    (_conv(groups=4), signed(4, 1, 3, 3), signed(4)),  # depthwise: ATen's native kernel starts its sum at the bias
    (lambda m, x, w: torch.relu(nn.functional.conv2d(x, w)), signed(6, 4, 3, 3), None),  # no bias
])
def test_conv_bias_to_epilogue_negative(fn, w, b):
    prove(fn, signed(2, 4, 5, 5), w, *([b] if b is not None else []), rule="conv_bias_to_epilogue", fires=False)


def test_conv_bias_stays_with_cudnn_fused_relu():
    """conv2d -> relu keeps its bias: cuDNN's fused convolution + bias + ReLU adds it in the product's epilogue."""
    fn = lambda m, x, w, b: torch.relu(nn.functional.conv2d(x, w, b)) * 2.0  # noqa: E731
    prove(fn, signed(2, 4, 5, 5), signed(6, 4, 3, 3), signed(6), rule="conv_bias_to_epilogue", fires=False)


# ---- an N-d Linear's bias moves into the kernel after its view ---------------------------------------------------

_LINEAR = nn.functional.linear


@pytest.mark.parametrize("fn", [
    lambda m, x, w, b: nn.functional.gelu(_LINEAR(x, w, b)),  # BERT's FFN up-projection
    lambda m, x, w, b: nn.functional.layer_norm(_LINEAR(x, w, b) + x, (6,)),  # a residual add, then the norm
])
def test_linear_bias_to_kernel_on_nd_inputs(fn):
    r = prove(fn, specials(2, 3, 6), signed(6, 6), signed(6), rule="linear_bias_to_kernel")
    ops = [n.op for n in r.graph.nodes]
    assert "addmm.default" not in ops and "mm.default" in ops
    views = {n.name for n in r.graph.nodes if n.op == "view.default" and r.graph[n.args[0]].op == "mm.default"}
    # the bias is added after the view: no anchor epilogue takes the add alone, in a pass of its own
    assert any(n.op == "add.Tensor" and n.args[0].name in views for n in r.graph.nodes)


@pytest.mark.parametrize("fn, x", [
    (lambda m, x, w, b: torch.relu(_LINEAR(x, w, b)), signed(4, 6)),  # 2-d: the anchor's epilogue plans it
    (lambda m, x, w, b: _LINEAR(x, w, b), signed(2, 3, 6)),  # nothing after it: the output itself
    (lambda m, x, w, b: _LINEAR(x, w, b).view(2, 3, 2, 3).transpose(1, 2) * 2.0, signed(2, 3, 6)),  # heads
])
def test_linear_bias_to_kernel_negative(fn, x):
    prove(fn, x, signed(6, 6), signed(6), rule="linear_bias_to_kernel", fires=False)
