"""The channels-last graph (kernelfuse.plan.layout): a CNN's activations kept channels-last between its
convolutions, planned as a variant of its own (`fused-cl`). Its batch norms run as kernels reading and writing
channels-last memory order (VEC elements per access), its convolutions are torch calls on channels-last operands,
its weights are copied channels-last once per weight version, and an output whose layout changed is copied back.
Checked against the interpreter in the CPU emulation and by the CPU check, in fp32 and under bf16 autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import write_problem

from kernelfuse.capture import capture
from kernelfuse.codegen import check_bindings, generate
from kernelfuse.cpucheck import check_plans
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.pipeline import build_model
from kernelfuse.plan import plan_variants
from kernelfuse.plan.ir import TorchStep
from kernelfuse.plan.layout import channels_last_graph
from kernelfuse.rewrite import rewrite

BLOCK = """
def __init__(self):
    super().__init__()
    self.conv1 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    self.bn1 = nn.BatchNorm2d(16)
    self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    self.bn2 = nn.BatchNorm2d(16)
    self.fc = nn.Linear(16, 10)
    with torch.no_grad():
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)

def forward(self, x):
    y = torch.relu(self.bn1(self.conv1(x)))
    y = torch.relu(self.bn2(self.conv2(y)) + y)
    return {tail}
"""
POOLED = "self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))"


def _plans(tmp_path: Path, tail: str, autocast: torch.dtype | None = None, training: bool = False):
    path = write_problem(tmp_path, "cl_block", BLOCK.format(tail=tail), "[torch.randn(4, 8, 12, 12)]")
    problem = load_problem(path)
    model = build_model(problem).train(training)
    graph = rewrite(capture(problem, model, autocast=autocast))
    plans = plan_variants(graph, "bf16" if autocast else "strict")
    return problem, model, graph, plans


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_channels_last_plan_runs_batch_norms_in_channels_last_order(tmp_path, autocast):
    problem, model, graph, plans = _plans(tmp_path, POOLED, autocast)
    assert [p.variant for p in plans][-1] == "fused-cl"
    plan = plans[-1]
    norms = [s for s in plan.generated if s.spec is not None and s.spec.kind == "affine_norm"]
    assert len(norms) == 2
    for step in norms:  # channels-last in, channels-last out, the relu (and the residual add) inside
        assert step.out_meta.stride == (16 * 144, 1, 16 * 12, 16) == step.source.strides
        assert step.permuted_out == step.out_meta.stride
    convs = [s for s in plan.steps if getattr(s, "node", None) is not None and s.node.op == "convolution.default"]
    assert len(convs) == 2 and all(s.node.meta.stride[1] == 1 for s in convs)  # torch calls, channels-last out
    sources = generate(plan)
    for step in norms:  # in memory order, 16 bytes per access (the source is laid out as the output)
        assert f"{step.kernel}_kernel<{16 // step.source.meta.dtype.itemsize}><<<" in sources.cuda
    check_bindings(plan, sources)
    # fp32 norms: a few ulps apart from ATen's CPU arithmetic (indexing errors would be of the values' size)
    assert emulated_against_interpreter(plan, tmp_path, ulps=1 if autocast else 16) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


@pytest.mark.parametrize("tail", [POOLED, "y"], ids=["pooled", "returned"])
def test_training_batch_norms_are_kernels_in_channels_last_order_too(tmp_path, tail):
    """In training mode each batch norm reduces over batch and space per channel: over the channels-last input's
    own strides (rows C apart), writing the input's layout, the ReLU and the residual add inside, the running
    statistics updated (compared with ATen's by `emulated_against_interpreter`). They were torch calls in this
    graph (a permuted input refused). Returned, the block's output is copied back to NCHW inside the last norm's
    kernel."""
    problem, model, graph, plans = _plans(tmp_path, tail, training=True)
    plan = plans[-1]
    assert plan.variant == "fused-cl"
    norms = [s for s in plan.generated if s.spec is not None and s.spec.kind == "norm"]
    assert len(norms) == 2 and not [s for s in plan.unfused if s.node.op == "native_batch_norm.default"]
    for step in norms:
        assert step.source.strides == (16 * 144, 1, 16 * 12, 16) and step.spec.running is not None
        laid = step.out_meta.stride
        assert laid == step.source.strides and step.permuted_out == laid or laid == (16 * 144, 144, 12, 1)
    check_bindings(plan, generate(plan))
    assert emulated_against_interpreter(plan, tmp_path, ulps=16) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_weights_are_copied_channels_last_once_per_weight_version(tmp_path):
    problem, _, _, plans = _plans(tmp_path, POOLED)
    text = emit_modelnew(problem, plans[-1], generate(plans[-1]), "test")
    weights_line = next(line for line in text.splitlines() if "self._weights()" in line and "=" in line)
    assert weights_line.count("_cl") >= 2  # both convolutions' channels-last weights come from the cache


def test_an_output_whose_layout_changed_is_copied_back(tmp_path):
    problem, model, graph, plans = _plans(tmp_path, "y")  # the block's 4-d activation is the output
    plan = plans[-1]
    cl = plan.graph
    (out,) = cl.outputs
    assert cl[out].meta.stride == graph[graph.outputs[0]].meta.stride  # contiguous, as the model returns it
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_a_view_that_needs_the_old_strides_reads_a_contiguous_copy(tmp_path):
    # `view` of a channels-last tensor to (N, C * H * W) has no strides (a classifier's flatten): it reads a
    # contiguous copy of its input, and the variant is made and checked
    problem, model, graph, plans = _plans(tmp_path, "self.fc(y.view(4, -1)[:, :16])")
    changed = channels_last_graph(graph)
    assert changed is not None
    (view,) = [n for n in changed.nodes if n.op == "view.default"]
    assert changed[view.args[0]].op == "clone.default" and changed[view.args[0]].meta.is_contiguous
    plan = plans[-1]
    assert plan.variant == "fused-cl"
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_a_view_the_fake_tensors_accept_but_real_ones_refuse_gives_no_channels_last_graph(tmp_path):
    # fuzz seed 75000, model 400 (shrunk): the first convolution's (1, 2, 1, 1, 2) output is channels-last, strides
    # (4, 1, 4, 4, 2), where flatten's view(1, 4) fails; the fake tensors the layouts propagate on took it, and the
    # CPU check's interpreter then raised on the variant
    body = """
def __init__(self):
    super().__init__()
    self.m1 = nn.Conv3d(1, 2, 3, padding=1)
    self.m2 = nn.Conv3d(2, 1, 3, stride=3, padding=2, dilation=2, bias=False)
    self.to(torch.float16)  # the bias stays in the convolution node (in fp32 a rewrite moves it to an add)

def forward(self, x):
    v1 = self.m1(x)
    return torch.flatten(v1, 1), self.m2(v1), v1
"""
    problem = load_problem(write_problem(tmp_path, "flat_cl", body,
                                          "[torch.randn(1, 1, 1, 1, 2, dtype=torch.float16)]"))
    model = build_model(problem).eval()
    graph = rewrite(capture(problem, model))
    changed = channels_last_graph(graph)
    if changed is not None:  # torch 2.14's CPU convolution keeps this fp16 output contiguous: the view is valid
        for node in changed.nodes:
            if node.op == "view.default":
                src = changed[node.args[0]].meta
                probe = torch.empty_strided(src.shape, src.stride, dtype=src.dtype, device="meta")
                probe.view(node.args[1])  # raises where the graph holds a view a real tensor refuses
    plans = plan_variants(graph)
    assert changed is not None or "fused-cl" not in [p.variant for p in plans]
    assert all(check.ok for check in check_plans(problem, model, graph, plans))


def test_a_pooling_of_the_channels_last_graph_is_a_kernel_writing_channels_last(tmp_path):
    # the pool reads and writes channels-last, the ReLU that a rewrite moved behind it (max then relu) inside
    problem, model, graph, plans = _plans(tmp_path, "self.fc(F.max_pool2d(y, 2).mean((2, 3)))")
    plan = plans[-1]
    (pool,) = [s for s in plan.generated if s.spec is not None and s.spec.kind == "max_pool"]
    assert pool.chain(plan.graph) == "max_pool2d_with_indices -> relu"
    assert pool.pools_channels_last and pool.out_strides == (16 * 36, 1, 16 * 6, 16)
    assert "channels-last in and out" in generate(plan).cuda
    assert emulated_against_interpreter(plan, tmp_path, ulps=16) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_a_vgg_stack_stays_channels_last_from_input_to_classifier(tmp_path):
    """VGG's pattern: convolution + ReLU pairs are cuDNN's conv+bias+ReLU call on channels-last operands (no pass
    of ours), the pools read and write channels-last, the last one writes the NCHW copy the flatten reads."""
    problem = load_problem(Path(__file__).parent / "fixtures" / "problems" / "zoo_vgg_cl.py")
    model = build_model(problem).eval()
    graph = rewrite(capture(problem, model))
    plan = plan_variants(graph)[-1]
    assert plan.variant == "fused-cl"
    relus = [s for s in plan.fused if s.anchor.family == "conv"]
    assert relus and all(s.anchor.fused_relu and not s.needs_kernel for s in relus)  # c1 (c2, c3: bias, relu pooled)
    pools = [s for s in plan.generated if s.spec is not None and s.spec.kind.endswith("pool")]
    assert [s.pools_channels_last for s in pools] == [True, True, False]  # the last writes the flatten's NCHW
    assert not [s for s in plan.unfused if "pool" in s.node.op]
    sources = generate(plan)
    check_bindings(plan, sources)
    assert emulated_against_interpreter(plan, tmp_path, ulps=16) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_the_channels_last_plan_is_made_with_measured_layouts_too(tmp_path):
    # on a GPU the optimizer plans with each convolution's measured layout: the variant must be judged there too
    _, _, graph, _ = _plans(tmp_path, POOLED)
    convs = [n.name for n in graph.nodes if n.op == "convolution.default"]
    plans = plan_variants(graph, "strict", conv_layouts=dict.fromkeys(convs, "nchw"))
    assert plans[-1].variant == "fused-cl"


def test_the_channels_last_plan_keeps_eager_fp32_convolutions_free_of_tf32(tmp_path):
    # where eager's NCHW call computes in full fp32 (measured), cuDNN may still pick a TF32 algorithm for the
    # channels-last operands: each of the variant's convolutions, fused or a torch call, runs with TF32 off
    # (H200: the graphed GPU test's fused-cl variant was 78x over the strict bound before)
    problem, _, graph, _ = _plans(tmp_path, POOLED)
    convs = [n.name for n in graph.nodes if n.op == "convolution.default"]
    plans = plan_variants(graph, "strict", conv_layouts=dict.fromkeys(convs, "nchw"), fp32_convs=frozenset(convs))
    cl = plans[-1]
    assert cl.variant == "fused-cl"
    flags = {s.anchor.node.name: s.anchor.fp32 for s in cl.fused if s.anchor.family == "conv"}
    flags.update({s.node.name: s.fp32 for s in cl.steps if isinstance(s, TorchStep)
                  and s.node.op == "convolution.default"})
    assert flags == dict.fromkeys(convs, True), flags
    source = emit_modelnew(problem, cl, generate(cl), "test")
    wrapped = [line for line in source.splitlines() if "= _without_tf32(lambda: " in line and "convolution" in line]
    assert len(wrapped) == len(convs), source
    assert "def _without_tf32" in source
    unmeasured = plan_variants(graph, "strict", conv_layouts=dict.fromkeys(convs, "nchw"))[-1]
    assert "_without_tf32(" not in emit_modelnew(problem, unmeasured, generate(unmeasured), "test")


SQUEEZE_EXCITE = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    self.bn = nn.BatchNorm2d(16)
    self.se = nn.Conv2d(16, 16, 1)
    with torch.no_grad():
        self.bn.running_var.uniform_(0.5, 2.0)

def forward(self, x):
    y = F.silu(self.bn(self.conv(x)))
    return y * torch.sigmoid(self.se(y.mean((2, 3), keepdim=True)))
"""


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_squeeze_excite_block_broadcasts_its_gate_in_channels_last_order(tmp_path, autocast):
    # EfficientNet's block: the gate (N, C, 1, 1) multiplies a channels-last activation and the product is the
    # model's output, copied back to NCHW; the kernels against the interpreter, the plan against the model
    path = write_problem(tmp_path, "se_block", SQUEEZE_EXCITE, "[torch.randn(2, 8, 10, 10)]")
    problem = load_problem(path)
    model = build_model(problem).eval()
    graph = rewrite(capture(problem, model, autocast=autocast))
    plan = plan_variants(graph, "bf16" if autocast else "strict")[-1]
    assert plan.variant == "fused-cl"
    # one kernel reads the channels-last activation and the broadcast gate, and writes the NCHW output (the copy
    # back to the model's layout is its last op)
    (gate,) = [s for s in plan.generated if s.out == plan.graph.outputs[0].name]
    assert gate.source.strides[1] == 1 and gate.permuted_out is None and gate.chain(plan.graph).endswith("clone")
    assert [o.strides[2:] for o in gate.prologue.operands] == [(0, 0)]
    assert emulated_against_interpreter(plan, tmp_path, ulps=1 if autocast else 16) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_a_group_norm_between_convolutions_reads_a_contiguous_copy(tmp_path):
    # CUDA's native_group_norm takes contiguous inputs only (the CPU's, which propagates the layouts, takes
    # channels-last too): the graph copies its input back to NCHW (found on a UNet block, whose file failed)
    _, _, graph, _ = _plans(tmp_path, "self.conv2(F.group_norm(y, 4))")
    cl = channels_last_graph(graph)
    (norm,) = [n for n in cl.nodes if n.op == "native_group_norm.default"]
    assert cl[norm.args[0]].meta.is_dense_contiguous
    assert cl[norm.args[0]].op == "clone.default"
    assert all(n.meta.stride[1] == 1 for n in cl.nodes if n.op == "convolution.default")  # channels-last still
