"""The rewrite rules that simplify elementwise chains and views or move a bias, each proven in float64 on random
values (NaN/Inf where the rule claims them) by running the graph before and after, and shown not to fire where its
condition fails: clamps that collapse, mish written out, neutral scalars, empty cat operands, pads of nothing,
double views, common subexpressions, and a convolution's or an N-d Linear's bias moved into the kernel after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rewrite_helpers import Fn, prove, run_graph, signed, specials
from torch import nn

from kernelfuse.capture import capture_module
from kernelfuse.rewrite import apply_rules

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
