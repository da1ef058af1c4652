"""The rewrite rules that move or remove reductions, each proven in float64 on random values (negatives, zeros,
and NaN/Inf where the rule claims them) by running the graph before and after, and shown not to fire where its
condition fails: reductions and normalisations over size-1 dims, sums and means moved before affine scalar ops,
a Linear's output reduced as a matrix-vector product, max/min moved before non-decreasing ops, and average
pooling over a Linear's features folded into its weight."""

from __future__ import annotations

import pytest
import torch
from rewrite_helpers import Fn, prove, run_graph, signed, specials
from torch import nn

from kernelfuse.capture import capture_module
from kernelfuse.rewrite import rewrite

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
