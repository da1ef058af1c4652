"""Stage 4 — plan: which chains fuse, which stay torch calls and why; the CPU interpreter equals the model."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated, emulated_and_interpreted
from optimizer_helpers import (
    EXAMPLE_NAMES,
    EXAMPLES,
    assert_interpreter_matches,
    pipeline,
    shrunk_example,
    write_problem,
)

from kernelfuse.capture import Ref, capture
from kernelfuse.load import load_problem
from kernelfuse.plan import FusedStep, GenStep, PlanOptions, TorchStep, make_plan, plan_variants
from kernelfuse.rewrite import rewrite


@pytest.fixture(scope="module")
def example_plans():
    out = {}
    for name in EXAMPLE_NAMES:
        graph = rewrite(capture(load_problem(EXAMPLES / f"{name}.py")))
        out[name] = plan_variants(graph)
    return out


def test_gemm_add_relu_plan(example_plans):
    (plan,) = example_plans["gemm_add_relu"]
    assert plan.variant == "fused"
    (step,) = plan.fused
    assert step.chain(plan.graph) == "mm -> add -> relu"
    assert step.anchor.family == "matmul" and step.inplace and step.needs_kernel
    assert [st.op for st in step.epilogue.statements] == ["add", "relu"]
    (operand,) = step.epilogue.operands
    assert plan.graph[operand.ref].target == "bias"
    assert operand.strides == (0, 1)  # row bias broadcast over the batch
    assert step.epilogue.statements[0].args == ("acc", "in0")
    assert step.epilogue.statements[1].args == ("add",)
    assert plan.unfused == []
    assert plan.summary().splitlines() == [
        "plan variant: fused",
        "  fused k0: mm -> add -> relu  (cuBLAS + epilogue kernel)",
        "  unfused: none",
    ]


def test_gemm_sigmoid_residual_plan(example_plans):
    (plan,) = example_plans["gemm_sigmoid_scaling_residualadd"]
    (step,) = plan.fused
    assert step.replaces == ("addmm", "sigmoid", "mul", "add")
    assert step.out == "add" and step.epilogue.result == "add"
    sig, mul, add = step.epilogue.statements
    assert sig.args == ("acc",)
    assert mul.args == ("sigmoid", 2.0)
    assert add.args == ("mul", "acc")  # the residual reads the anchor's own value, not a second tensor
    assert step.epilogue.operands == ()
    # the view feeding addmm stays a torch call, labelled as a view and not reported as unfused
    assert [s.node.op for s in plan.steps if isinstance(s, TorchStep)] == ["t.default"]
    assert plan.unfused == []


def test_conv_plan_has_two_layout_variants(example_plans):
    plans = example_plans["conv2d_relu_biasadd"]
    assert [p.variant for p in plans] == ["fused-nhwc", "fused-nchw"]
    for plan, layout in zip(plans, ("nhwc", "nchw"), strict=True):
        (step,) = plan.fused
        assert step.anchor.family == "conv" and step.anchor.layout == layout
        assert step.anchor.fused_relu, "convolution -> relu goes to cuDNN's fused conv+bias+relu"
        assert step.replaces == ("convolution", "relu", "add")
        (st,) = step.epilogue.statements
        assert st.op == "add" and st.args == ("acc", "in0")
        assert step.epilogue.operands[0].strides == (0, 1, 0, 0)  # per-channel bias
        assert step.inplace == (layout == "nchw")
        assert "conv+bias+relu" in plan.summary() and f"[{layout}]" in plan.summary()


LIN = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16)
{extra}

def forward(self, x):
    y = self.lin(x)
{body}
"""


def _plan(tmp_path, body: str, extra: str = "", inputs: str = "[torch.randn(4, 16)]", name: str = "p"):
    path = write_problem(tmp_path, name, LIN.format(body=body, extra=extra), inputs)
    problem, graph, plans = pipeline(path)
    return problem, graph, plans[0]


def _step_for(plan, op_name: str) -> TorchStep:
    return next(s for s in plan.steps if isinstance(s, TorchStep) and s.node.name == op_name)


def _gen_for(plan, op_name: str) -> GenStep:
    return next(s for s in plan.generated if op_name in s.replaces)


def test_chain_stops_before_a_value_that_is_also_returned(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    r = torch.relu(y)
    return r, torch.sigmoid(r)
    """)
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu") and step.out == "relu"
    (gen,) = plan.generated  # the sigmoid reads the returned relu: a pointwise kernel of its own
    assert gen.replaces == ("sigmoid",) and gen.source.ref == Ref("relu")
    assert_interpreter_matches(problem, plan)


def test_chain_stops_before_a_value_read_by_a_reduction(tmp_path):
    """The anchor's epilogue stops at the ReLU the reduction reads; read by a pointwise kernel and the reduction,
    both as their source, it is recomputed in each (kernelfuse.plan.merge): never stored."""
    problem, g, plan = _plan(tmp_path, """
    r = torch.relu(y)
    s = r * 3.0
    return s + r.sum(dim=1, keepdim=True)
    """)
    (step,) = plan.fused
    assert step.replaces == ("addmm",) and not step.needs_kernel
    assert plan.unfused == []
    assert sorted(g.replaces for g in plan.generated) == [("relu", "mul", "add"), ("relu", "sum_1")]
    assert _gen_for(plan, "sum_1").spec.kind == "sum"
    assert_interpreter_matches(problem, plan)


def test_anchor_with_an_outside_user_is_not_fused(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return y, torch.relu(y)
    """)
    assert plan.fused == []
    assert _step_for(plan, "addmm").reason == "library call, nothing to fuse behind it"
    assert_interpreter_matches(problem, plan)


def test_later_operand_computed_outside_the_chain(tmp_path):
    # the tanh reads x only, so it may feed the epilogue as an operand even though it is computed after addmm
    problem, g, plan = _plan(tmp_path, """
    t = torch.tanh(x)
    return torch.relu(y) * t
    """)
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu", "mul")
    assert [g[o.ref].op for o in step.epilogue.operands] == ["tanh.default"]
    assert plan.steps.index(step) > plan.steps.index(_gen_for(plan, "tanh"))
    assert_interpreter_matches(problem, plan)


def test_dtype_mismatched_operand_is_not_fused(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.relu(y + self.b)
    """, extra="    self.b = nn.Parameter(torch.randn(16, dtype=torch.float64))")
    add = next(n for n in g.nodes if n.op == "add.Tensor")
    assert add.meta.dtype == torch.float64
    assert plan.fused == []
    assert {s.node.op for s in plan.unfused} == {"addmm.default", "add.Tensor", "relu.default"}
    assert_interpreter_matches(problem, plan)


def test_half_operand_of_float_chain_is_not_fused(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    r = torch.relu(y)
    return r + self.b
    """, extra="    self.b = nn.Parameter(torch.randn(16, dtype=torch.float16))")
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu")  # the float32 + float16 add stays a torch call
    assert_interpreter_matches(problem, plan)


@pytest.mark.parametrize("operand", ["self.m.t()", "self.b.expand(4, 16)", "self.m[::4]"])
def test_operand_the_kernel_wrapper_would_refuse_is_not_fused(tmp_path, operand):
    """The generated wrappers check operands with is_contiguous(): a strided operand must stay a torch call."""
    problem, g, plan = _plan(tmp_path, f"""
    r = torch.relu(y)
    return r * {operand}
    """, extra="    self.m = nn.Parameter(torch.randn(16, 16))\n    self.b = nn.Parameter(torch.randn(16))",
        inputs="[torch.randn(16, 16)]" if "m.t" in operand else "[torch.randn(4, 16)]",
        name="strided")
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu")
    assert_interpreter_matches(problem, plan)


def test_size_one_dims_do_not_make_an_operand_strided(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.relu(y) * self.b.unsqueeze(0)
    """, extra="    self.b = nn.Parameter(torch.randn(16))")
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu", "mul")
    assert step.epilogue.operands[0].meta.shape == (1, 16)
    assert_interpreter_matches(problem, plan)


def test_broadcast_to_a_bigger_shape_is_not_fused(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.relu(y) + self.b
    """, extra="    self.b = nn.Parameter(torch.randn(3, 1, 16))")
    (step,) = plan.fused
    assert step.replaces == ("addmm", "relu")  # [4,16] + [3,1,16] has another shape than the anchor
    assert_interpreter_matches(problem, plan)


def test_softmax_takes_the_anchor_epilogue_as_its_prologue(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.softmax(torch.relu(y), dim=1)
    """)
    (anchor,) = plan.fused
    assert anchor.replaces == ("addmm",) and not anchor.needs_kernel  # the relu moved into the softmax kernel
    (gen,) = plan.generated
    assert gen.chain(g) == "relu -> _softmax" and gen.spec.kind == "softmax" and gen.source.ref == Ref("addmm")
    assert "generated k1: relu -> _softmax  (softmax kernel)" in plan.summary()
    assert_interpreter_matches(problem, plan)


def test_softmax_without_the_generated_kernels_is_reported_unfused(tmp_path):
    path = write_problem(tmp_path, "p", LIN.format(body="    return torch.softmax(torch.relu(y), dim=1)", extra=""),
                         "[torch.randn(4, 16)]")
    problem, g, _ = pipeline(path)
    plan = make_plan(g, PlanOptions(generated=False))
    (unfused,) = plan.unfused
    assert unfused.node.op == "_softmax.default" and unfused.reason == "softmax: no kernel yet"
    assert_interpreter_matches(problem, plan)


def test_unknown_op_is_reported_as_other(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.roll(torch.relu(y), 1, 1)
    """)
    (unfused,) = plan.unfused
    assert unfused.node.op == "roll.default" and unfused.reason == "other: no kernel yet"


def test_integer_matmul_anchor_is_not_fused(tmp_path):
    path = write_problem(tmp_path, "intmm", """
        def forward(self, a, b):
            return torch.relu(torch.mm(a, b))
        """, "[torch.randint(0, 5, (4, 4)), torch.randint(0, 5, (4, 4))]")
    problem, g, plans = pipeline(path)
    (plan,) = plans
    assert plan.fused == []
    mm = next(s for s in plan.unfused if s.node.op == "mm.default")
    assert mm.reason == "library call: dtype torch.int64 not fused"
    assert_interpreter_matches(problem, plan)


TWO_LAYERS = """
def __init__(self):
    super().__init__()
    self.a = nn.Linear(16, 16)
    self.b = nn.Linear(16, 16)

def forward(self, x):
    return torch.sigmoid(self.b(torch.relu(self.a(x))))
"""


def test_max_fusions_caps_the_number_of_fused_anchors(tmp_path):
    problem, g, plans = pipeline(write_problem(tmp_path, "two", TWO_LAYERS, "[torch.randn(4, 16)]"))
    full = plans[0]
    assert [s.chain(g) for s in full.fused] == ["addmm -> relu", "addmm -> sigmoid"]
    assert [s.kernel for s in full.fused] == ["k0", "k1"]
    capped = make_plan(g, PlanOptions(max_fusions=1))
    assert [s.chain(g) for s in capped.fused] == ["addmm -> relu"] and capped.generated == []
    assert {s.node.op for s in capped.unfused} == {"addmm.default", "sigmoid.default"}
    assert "fusion cap" in _step_for(capped, "sigmoid").reason
    none = make_plan(g, PlanOptions(max_fusions=0))
    assert none.fused == [] and none.generated == [] and none.variant == "fused"
    for plan in (full, capped, none):
        assert_interpreter_matches(problem, plan)


def test_every_graph_node_is_computed_exactly_once(tmp_path):
    problem, g, plans = pipeline(write_problem(tmp_path, "two", TWO_LAYERS, "[torch.randn(4, 16)]"))
    for plan in plans:
        computed = []
        for s in plan.steps:
            computed += list(s.replaces) if isinstance(s, (FusedStep, GenStep)) else [s.node.name]
        expected = [n.name for n in g.nodes if n.op not in ("input", "param", "buffer")]
        assert sorted(computed) == sorted(expected)


CONV = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(3, 8, 3, padding=1)
    self.scale = nn.Parameter(torch.randn(8, 1, 1))

def forward(self, x):
{body}
"""


# oneDNN's CPU convolution adds the bias inside its sum; cuDNN (and the split plan) add it after the product:
# a plan whose bias moved into the epilogue matches the CPU model to fp32 rounding, not bit for bit.
CPU_BIAS = dict(atol=1e-6, rtol=1e-6)


def _conv_plans(tmp_path, body: str, name: str = "c"):
    return pipeline(write_problem(tmp_path, name, CONV.format(body=body), "[torch.randn(2, 3, 6, 6)]"))


def test_conv_without_relu_uses_plain_convolution(tmp_path):
    problem, g, plans = _conv_plans(tmp_path, """
    return torch.sigmoid(self.conv(x) * self.scale)
    """)
    for plan in plans:
        (step,) = plan.fused
        assert not step.anchor.fused_relu
        # the convolution's bias moved into the epilogue (rewrite conv_bias_to_epilogue): its first add
        assert step.chain(plan.graph) == "convolution -> add -> mul -> sigmoid"
        assert [o.strides for o in step.epilogue.operands] == [(0, 1, 0, 0)] * 2
        assert_interpreter_matches(problem, plan, **CPU_BIAS)


def test_conv_relu_with_relu_returned_keeps_cudnn_relu_only(tmp_path):
    problem, g, plans = _conv_plans(tmp_path, """
    r = torch.relu(self.conv(x))
    return r, r * self.scale
    """)
    for plan in plans:
        (step,) = plan.fused
        assert step.anchor.fused_relu and step.replaces == ("convolution", "relu")
        assert step.epilogue.statements == ()
        assert step.needs_kernel == (step.anchor.layout == "nhwc")
        assert_interpreter_matches(problem, plan)


def test_conv_read_twice_does_not_take_cudnn_relu(tmp_path):
    problem, g, plans = _conv_plans(tmp_path, """
    c = self.conv(x)
    return torch.relu(c) + c
    """)
    for plan in plans:
        (step,) = plan.fused
        assert not step.anchor.fused_relu
        assert step.chain(plan.graph) == "convolution -> add -> relu -> add"  # the bias, then relu(c) + c
        assert_interpreter_matches(problem, plan, **CPU_BIAS)


def test_lone_convolution(tmp_path):
    problem, g, plans = _conv_plans(tmp_path, """
    return nn.functional.conv2d(x, self.conv.weight, padding=1)
    """)
    nhwc, nchw = plans
    assert nhwc.fused == []  # a layout change alone buys nothing
    assert nhwc.unfused[0].reason == "library call, nothing to fuse behind it"
    for plan in plans:
        assert_interpreter_matches(problem, plan)


def test_lone_convolution_with_bias_adds_it_in_its_epilogue(tmp_path):
    problem, g, plans = _conv_plans(tmp_path, """
    return self.conv(x)
    """)
    for plan in plans:
        (step,) = plan.fused
        assert step.chain(plan.graph) == "convolution -> add" and step.anchor.node.args[2] is None
        assert_interpreter_matches(problem, plan, **CPU_BIAS)


def test_transposed_convolution_runs_in_either_layout_with_its_epilogue(tmp_path):
    path = write_problem(tmp_path, "convt", """
        def __init__(self):
            super().__init__()
            self.conv = nn.ConvTranspose2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))
        """, "[torch.randn(2, 3, 5, 5)]")
    problem, g, plans = pipeline(path)
    assert [p.variant for p in plans] == ["fused-nhwc", "fused-nchw"]
    for plan, layout in zip(plans, ("nhwc", "nchw"), strict=True):
        (step,) = plan.fused
        assert step.chain(plan.graph) == "convolution -> add -> relu" and step.anchor.layout == layout
        assert not step.anchor.fused_relu  # cuDNN's fused bias+ReLU is for 2-d non-transposed convolutions
        assert step.inplace == (layout == "nchw")  # channels-last: the epilogue writes a new NCHW tensor
        assert_interpreter_matches(problem, plan)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_interpreter_equals_model_on_examples(tmp_path, name):
    problem, g, plans = pipeline(shrunk_example(name, tmp_path))
    assert plans and all(p.fused for p in plans)
    for plan in plans:
        assert_interpreter_matches(problem, plan)


def test_interpreter_equals_model_on_many_pointwise_ops(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    a = torch.sigmoid(y) * self.w - torch.tanh(y)
    b = F.gelu(a, approximate="tanh") + F.silu(y) / (torch.exp(-y.abs()) + 1.0)
    c = torch.clamp(F.softplus(b, beta=2.0, threshold=3.0), min=-0.5)
    d = F.leaky_relu(c, 0.3) + F.hardtanh(torch.neg(c), -0.2, 0.4) + torch.sqrt(c.abs() + 1.0)
    e = torch.maximum(d, self.w) - torch.minimum(torch.rsqrt(d.abs() + 1.0), torch.log(y.abs() + 2.0))
    return torch.add(F.gelu(e), torch.clamp(y, max=0.25), alpha=0.5)
    """, extra="    self.w = nn.Parameter(torch.randn(16))")
    (step,) = plan.fused
    assert plan.unfused == []
    assert len(step.epilogue.statements) >= 25
    x = problem.make_inputs(0)
    x[0][1, :3] = float("nan")
    assert_interpreter_matches(problem, plan, inputs=x)


def test_fused_step_output_order_with_two_outputs(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.relu(x), torch.sigmoid(y) * 2.0
    """)
    (step,) = plan.fused
    assert step.replaces == ("addmm", "sigmoid", "mul")
    assert g.outputs[1] == Ref(step.out)
    assert_interpreter_matches(problem, plan)


def test_epilogue_joins_a_reduction_through_a_reshape(tmp_path):
    """conv -> bias -> scale -> view(n, c, -1) -> softmax: an NCHW anchor's epilogue runs in the softmax's
    prologue (a rename of the same flat index), not in a pass of its own; channels-last keeps its epilogue
    (its rows' elements would lie C apart: one thread per long row)."""
    problem, g, plans = _conv_plans(tmp_path, """
    return torch.softmax((self.conv(x) * self.scale).view(2, 8, -1), dim=2)
    """)
    by_variant = {p.variant: p for p in plans}
    nchw, nhwc = by_variant["fused-nchw"], by_variant["fused-nhwc"]
    (gen,) = nchw.generated
    assert gen.chain(nchw.graph) == "add -> mul -> view -> _softmax"
    assert gen.source.ref.name == nchw.fused[0].anchor.node.name and not nchw.fused[0].needs_kernel
    assert [s.chain(nhwc.graph) for s in nhwc.fused] == ["convolution -> add -> mul"]
    for plan in plans:
        assert_interpreter_matches(problem, plan, **CPU_BIAS)
    out, expected = emulated_and_interpreted(emulated(nchw, tmp_path), nchw, gen)  # the CUDA, on the CPU
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("returned", [False, True])
def test_a_norms_residual_recomputes_the_epilogue_it_moved_into(tmp_path, returned):
    """conv -> bias -> GroupNorm -> tanh -> + the biased conv -> logsumexp (level-2 92): the conv's value is read by
    the norm and by its residual, both in one kernel. The bias moves into the norm's prologue and the residual
    recomputes it from the raw conv output (the same add), so the biased value is never stored and no epilogue
    pass runs. Returned as well, it is stored: then the anchor keeps its epilogue."""
    tail = ", y" if returned else ""
    problem, g, plans = _conv_plans(tmp_path, f"""
    y = self.conv(x)
    z = torch.tanh(F.group_norm(y, 2)) + y
    return torch.logsumexp(z, dim=1){tail}
    """, name="res")
    nchw = {p.variant: p for p in plans}["fused-nchw"]
    anchor = nchw.fused[0]
    norm = next(s for s in nchw.generated if s.family == "norm")
    if returned:
        assert anchor.chain(nchw.graph) == "convolution -> add" and norm.source.ref.name == anchor.out
    else:
        conv, biased = anchor.anchor.node.name, norm.prologue.statements[0].name
        assert anchor.replaces == (conv,) and not anchor.needs_kernel and norm.source.ref.name == conv
        assert norm.chain(nchw.graph) == "add -> native_group_norm -> tanh -> add"
        stored = {s.out for s in nchw.steps if hasattr(s, "out")}
        assert biased not in stored and all(o.ref.name != biased for o in norm.epilogue.operands)
        assert norm.epilogue.statements[0].name == biased  # the bias again, on the raw output
        out, expected = emulated_and_interpreted(emulated(nchw, tmp_path), nchw, norm)  # the CUDA, on the CPU
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    for plan in plans:
        assert_interpreter_matches(problem, plan, **CPU_BIAS)


def test_a_bf16_residual_keeps_its_epilogue_pass(tmp_path):
    """The same in bf16: the anchor's epilogue rounds the scaled value to bf16, which the norm's epilogue would
    not reproduce; the anchor keeps its epilogue, and the norm reads the stored value."""
    _, _, plans = pipeline(write_problem(tmp_path, "res16", """
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(torch.bfloat16)
        self.s = nn.Parameter(torch.randn(8, 1, 1, dtype=torch.bfloat16))

    def forward(self, x):
        y = self.conv(x) * self.s
        return torch.logsumexp(torch.tanh(F.group_norm(y, 2)) + y, dim=1)
    """, "[torch.randn(2, 3, 6, 6, dtype=torch.bfloat16)]"))
    for plan in plans:
        anchor, norm = plan.fused[0], next(s for s in plan.generated if s.family == "norm")
        assert anchor.chain(plan.graph) == "convolution -> mul" and norm.source.ref.name == anchor.out


def test_node_read_by_two_anchors_joins_one_epilogue_and_kernel_names_are_unique(tmp_path):
    """A gated MLP, relu(down(silu(gate(x)) * up(x))): the mul reads both anchors' outputs. It joins the first
    anchor's epilogue only; it had joined both (the first step overwritten, the third anchor's kernel named k1
    like the second: a file nvcc rejects, while the plan computed the right values)."""
    problem = load_problem(write_problem(tmp_path, "gated", """
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(32, 64, bias=False)
            self.up = nn.Linear(32, 64, bias=False)
            self.down = nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return torch.relu(self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x)))
        """, "[torch.rand(4, 32)]"))
    (plan,) = plan_variants(rewrite(capture(problem)))
    assert [s.chain(plan.graph) for s in plan.fused] == ["mm -> silu -> mul", "mm -> relu"]
    names = [s.kernel for s in (*plan.fused, *plan.generated)]
    assert len(names) == len(set(names)), names
    replaced = [n for s in plan.fused for n in s.replaces]
    assert len(replaced) == len(set(replaced))
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_kept_nodes_stay_torch_calls_and_the_rest_still_fuses(example_plans):
    (plan,) = example_plans["gemm_add_relu"]
    relu = next(n for n in plan.graph.nodes if n.op == "relu.default")
    (kept,) = plan_variants(plan.graph, keep=frozenset({relu.name}))
    assert [s.chain(kept.graph) for s in kept.fused] == ["mm -> add"]
    assert any(s.node.name == relu.name and "failed to plan or generate" in s.reason for s in kept.unfused)


def test_a_pointwise_kernel_reads_the_full_size_operand_as_its_source(tmp_path):
    """`A.unsqueeze(1) * B` (dev level-1 12): the kernel's source is B, whose strides are the output's, so the
    launcher can move 16 bytes per access; A, read first, is a broadcast operand. The statement still multiplies
    A by B in that order, and the emulated kernel equals the interpreter."""
    from kernelfuse.codegen import generate

    body = "def forward(self, a, b):\n    return a.unsqueeze(1) * b\n"
    path = write_problem(tmp_path, "diag_mul", body, "[torch.randn(64), torch.randn(64, 128)]")
    _, _, (plan,) = pipeline(path)
    (step,) = plan.generated
    assert step.source.meta.shape == (64, 128) and step.prologue.operands[0].meta.shape == (64, 1)
    (stmt,) = step.prologue.statements
    assert stmt.args == ("in0", "acc")  # mul(A, B): the same operand order as eager's
    assert "k0_kernel<4><<<" in generate(plan).cuda
    out, expected = emulated_and_interpreted(emulated(plan, tmp_path), plan, step)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype, ctype", [("float16", "__half"), ("bfloat16", "__nv_bfloat16"), ("float32", None)])
def test_a_half_kernel_rounds_each_op_as_eager_does(tmp_path, dtype, ctype):
    """In a half or bfloat16 kernel the value entering the chain and every statement's result are rounded to the
    kernel's type, as eager rounds each op's output (an fp16 SwiGLU's silu * up rounded once missed the float64
    rule on the GPU); a float32 kernel computes as before."""
    from kernelfuse.codegen import generate

    body = "def forward(self, a, b):\n    return torch.sigmoid(a * b) + a\n"
    path = write_problem(tmp_path, "half_chain", body, f"[torch.randn(8, 64).to(torch.{dtype}), "
                                                        f"torch.randn(8, 64).to(torch.{dtype})]")
    _, _, (plan,) = pipeline(path)
    (step,) = plan.generated
    cuda = generate(plan).cuda.split(f"// {step.kernel}: ", 1)[1]
    statements = [ln for ln in cuda.splitlines() if ln.strip().startswith("const float p_v_")]
    assert len(statements) == 3  # mul, sigmoid, add
    if ctype is None:
        assert "kf_store<float>(" not in "".join(statements) and "p_acc_r" not in cuda
    else:
        assert all(f"kf_load(kf_store<{ctype}>(" in ln for ln in statements)
        assert f"const float p_acc_r = kf_load(kf_store<{ctype}>(acc));" in cuda


def test_nd_linear_runs_mm_and_its_bias_joins_the_kernel_behind_the_view(tmp_path):
    """A Linear on a 3-d input (rewrite linear_bias_to_kernel): mm stays the library call and says where its
    epilogue runs; the bias add and the GELU are one generated kernel."""
    problem, g, plan = _plan(tmp_path, """
    return torch.nn.functional.gelu(y)
    """, inputs="[torch.randn(2, 4, 16)]")
    (mm,) = [s for s in plan.steps if isinstance(s, TorchStep) and s.node.op == "mm.default"]
    assert mm.reason == "library call; the generated kernel reading it through a view runs its epilogue"
    (gen,) = plan.generated
    assert [g[n].op for n in gen.replaces] == ["add.Tensor", "gelu.default"]
