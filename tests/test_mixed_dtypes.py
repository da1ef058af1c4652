"""Pointwise kernels that mix float dtypes: a bf16 value meeting an fp32 one, and casts (`_to_copy`) inside.

Under CUDA autocast a model's graph is full of them: GPT-2's tanh GELU computes `pow` in fp32 between bf16 ops,
a bf16 Linear output is added to an fp32 residual, and a cast to bf16 precedes every Linear. One dtype per kernel
left each of these a torch call; now a pointwise kernel of its own loads each operand from its own type and
rounds each value to its own dtype, as eager rounds each op's output. Reductions keep one dtype.
"""

from __future__ import annotations

import math
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

from kernelfuse.capture import capture
from kernelfuse.codegen import BindingMismatch, check_bindings, dryrun, generate
from kernelfuse.cpucheck import check_plans
from kernelfuse.emit import emit_modelnew
from kernelfuse.fallback import plans_with_fallbacks, run_stage
from kernelfuse.load import load_problem
from kernelfuse.pipeline import build_model
from kernelfuse.plan import GenStep, plan_variants
from kernelfuse.rewrite import rewrite

GELU_MLP = f"""
def __init__(self):
    super().__init__()
    self.fc = nn.Linear(64, 256)
    self.proj = nn.Linear(256, 64)

def forward(self, x):
    h = self.fc(x)
    h = 0.5 * h * (1.0 + torch.tanh({math.sqrt(2.0 / math.pi)!r} * (h + 0.044715 * torch.pow(h, 3.0))))
    return x + self.proj(h)
"""


def _bf16_plan(tmp_path: Path, body: str = GELU_MLP):
    path = write_problem(tmp_path, "gelu_mlp", body, "[torch.randn(8, 32, 64)]")
    problem = load_problem(path)
    model = build_model(problem)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    return problem, model, graph, plan_variants(graph, "bf16")[0]


def _step_with(plan, op: str) -> GenStep:
    return next(s for s in plan.generated if any(st.aten == op for st in s.prologue.statements))


def test_gpt2_gelu_under_autocast_is_one_kernel_from_bf16_to_bf16(tmp_path):
    problem, model, graph, plan = _bf16_plan(tmp_path)
    gelu = _step_with(plan, "tanh.default")
    ops = [st.aten.split(".")[0] for st in gelu.prologue.statements]
    assert ops[0] == "mul" and ops[-1] == "_to_copy" and {"pow", "tanh", "_to_copy"} <= set(ops), ops
    assert gelu.source.meta.dtype == torch.bfloat16 and gelu.out_meta.dtype == torch.bfloat16
    dtypes = {st.aten.split(".")[0]: st.dtype for st in gelu.prologue.statements}
    assert dtypes["pow"] == torch.float32 and dtypes["tanh"] == torch.float32  # autocast's fp32 ops stay fp32
    # the residual: an fp32 input plus the bf16 Linear output, one kernel writing fp32
    residual = next(s for s in plan.generated if s.out == graph[graph.outputs[0]].name)
    assert residual.out_meta.dtype == torch.float32
    assert {residual.source.meta.dtype, *(o.meta.dtype for o in residual.prologue.operands)} == \
        {torch.float32, torch.bfloat16}
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check
    # a cast alone (a weight's, the input's before the first Linear) stays torch's copy: no kernel to build
    lone = [line for line in plan.summary().splitlines() if "_to_copy.default (a cast alone" in line]
    assert len(lone) == 5, plan.summary()  # two weights, two biases, the input


def test_mixed_kernel_source_reads_each_pointer_as_its_own_type(tmp_path):
    _, _, graph, plan = _bf16_plan(tmp_path)
    cuda = generate(plan).cuda
    residual = next(s for s in plan.generated if s.out == graph[graph.outputs[0]].name)
    signature = cuda[cuda.index(f"{residual.kernel}_kernel("):].split(")", 1)[0]
    assert "const float* __restrict__ src" in signature or "const __nv_bfloat16* __restrict__ src" in signature
    assert "__nv_bfloat16" in signature and "float* __restrict__ out" in signature, signature
    gelu = _step_with(plan, "tanh.default")
    body = cuda[cuda.index(f"{gelu.kernel}_kernel("):]
    body = body[:body.index("KF_EXPORT")]
    # each bf16 value is rounded to bf16, the fp32 ones are not: the pow, tanh and their neighbours
    assert body.count("kf_store<__nv_bfloat16>((p_acc_r * 0.5f))") == 1
    assert "tanhf(" in body and "kf_store<__nv_bfloat16>(tanhf" not in body


def test_binding_checks_each_tensor_against_its_own_dtype(tmp_path):
    _, _, graph, plan = _bf16_plan(tmp_path)
    binding = generate(plan).binding
    residual = next(s for s in plan.generated if s.out == graph[graph.outputs[0]].name)
    method = binding[binding.index(f"def {residual.kernel}(self"):]
    method = method[:method.index("return out")]
    assert "torch.float32)" in method and "torch.bfloat16)" in method, method


# GPT-2's order: the bf16 Linear output first, the fp32 residual second (`attn_output + residual`)
RESIDUAL_SECOND = GELU_MLP.replace("return x + self.proj(h)", "return self.proj(h) + x")


def test_a_bf16_source_plus_an_fp32_residual_allocates_fp32(tmp_path):
    # The binding allocated out from its source's dtype: bf16 here, for a kernel that writes fp32, so on the GPU
    # the kernel wrote past the buffer's end (GPT-2's bf16 file failed its next kernel's dtype check)
    _, _, graph, plan = _bf16_plan(tmp_path, RESIDUAL_SECOND)
    residual = next(s for s in plan.generated if s.out == graph[graph.outputs[0]].name)
    assert residual.source.meta.dtype == torch.bfloat16 and residual.out_meta.dtype == torch.float32
    sources = generate(plan)
    method = sources.binding[sources.binding.index(f"def {residual.kernel}(self"):]
    assert "new_empty((8, 32, 64), dtype=torch.float32)" in method[:method.index("return out")], method
    check_bindings(plan, sources)  # every kernel's method, dry-run on meta tensors


def test_the_binding_dry_run_catches_an_output_of_the_wrong_dtype(tmp_path):
    _, _, graph, plan = _bf16_plan(tmp_path, RESIDUAL_SECOND)
    sources = generate(plan)
    broken = replace(sources, binding=sources.binding.replace(", dtype=torch.float32)", ")"))
    assert broken.binding != sources.binding
    with pytest.raises(BindingMismatch, match="allocates torch.bfloat16 .* writes torch.float32"):
        check_bindings(plan, broken)


def test_a_failed_binding_dry_run_keeps_that_kernel_as_torch_calls(tmp_path, monkeypatch):
    # kernelfuse.fallback: the kernel whose binding fails is given up, the rest of the plan stays fused
    path = write_problem(tmp_path, "gelu_mlp", RESIDUAL_SECOND, "[torch.randn(8, 32, 64)]")
    graph = rewrite(capture(load_problem(path), autocast=torch.bfloat16))
    real = dryrun.check_bindings
    first = plan_variants(graph, "bf16")[0]
    blamed = next(s for s in first.generated if s.out == graph[graph.outputs[0]].name)

    def failing(plan, sources):
        for step in plan.generated:
            if step.out == blamed.out:
                raise BindingMismatch(f"{step.kernel}: injected")
        real(plan, sources)

    monkeypatch.setattr(dryrun, "check_bindings", failing)
    plans, fallbacks = plans_with_fallbacks(graph, lambda keep: plan_variants(graph, "bf16", keep=keep),
                                            lambda plan: run_stage("codegen", dryrun.generate_checked, plan))
    assert fallbacks and "injected" in fallbacks[0].describe()
    assert plans and all(blamed.out not in s.replaces for p in plans for s in p.generated)
    assert any(p.generated for p in plans)


CONV_BN_RELU = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(8, 16, 3, padding=1)
    self.bn = nn.BatchNorm2d(16)
    with torch.no_grad():
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.bn.weight.uniform_(0.5, 1.5)
        self.bn.bias.uniform_(-0.5, 0.5)

def forward(self, x):
    h = self.conv(x)  # bf16 under autocast: a residual of the norm's own dtype joins its kernel
    return torch.relu(self.bn(h) + h)
"""


def _conv_bn_plan(tmp_path: Path, training: bool = False):
    path = write_problem(tmp_path, "conv_bn_relu", CONV_BN_RELU, "[torch.randn(2, 8, 12, 12)]")
    problem = load_problem(path)
    model = build_model(problem).train(training)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    return problem, model, graph, plan_variants(graph, "bf16")[0]


def test_eval_batch_norm_under_autocast_reads_fp32_parameters_from_a_bf16_source(tmp_path):
    # autocast's capture gives `_native_batch_norm_legit_no_training` (bf16 input, fp32 weight, bias and running
    # statistics); it was left a torch call ("no kernel yet"), and ResNet-50 under bf16 kept 53 of them
    problem, model, graph, plan = _conv_bn_plan(tmp_path)
    (bn,) = [s for s in plan.generated if s.spec is not None and s.spec.kind == "affine_norm"]
    assert bn.spec.param_dtype == torch.float32 and bn.source.meta.dtype == torch.bfloat16
    assert [st.aten.split(".")[0] for st in bn.epilogue.statements] == ["add", "relu"]
    assert not any("batch_norm" in line for line in plan.summary().splitlines() if "unfused" in line)
    sources = generate(plan)
    signature = sources.cuda[sources.cuda.index(f"{bn.kernel}_kernel("):].split(")", 1)[0]
    assert "const __nv_bfloat16* __restrict__ src" in signature and "const float* __restrict__ weight" in signature
    assert "float* __restrict__ run_var" in signature and "__nv_bfloat16* __restrict__ out" in signature
    check_bindings(plan, sources)  # the binding checks the parameters as fp32, allocates bf16
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_eval_batch_norm_under_autocast_emulated_on_the_cpu_computes_what_the_ops_compute(tmp_path):
    _, _, _, plan = _conv_bn_plan(tmp_path)
    assert emulated_against_interpreter(plan, tmp_path) == 1


def test_training_batch_norm_under_autocast_stays_a_torch_call(tmp_path):
    # training mode updates fp32 running statistics from bf16 batch statistics: not built (one dtype there)
    _, _, _, plan = _conv_bn_plan(tmp_path, training=True)
    assert not any(s.spec is not None and s.spec.kind in ("norm", "affine_norm") for s in plan.generated)


@pytest.mark.gpu
def test_eval_batch_norm_under_autocast_matches_eager_on_the_gpu(tmp_path):
    problem, model, graph, plan = _conv_bn_plan(tmp_path)
    got, expected = _emitted_against_autocast_eager(problem, model.eval(), plan, torch.randn(2, 8, 12, 12), tmp_path)
    # the file is called without autocast: it returns the float32 the model returns without it
    assert (got.dtype, expected.dtype) == (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("body", [GELU_MLP, RESIDUAL_SECOND], ids=["residual_first", "residual_second"])
def test_mixed_dtype_kernels_emulated_on_the_cpu_compute_what_the_ops_compute(tmp_path, body):
    # the GELU with fp32 pow and tanh between bf16 roundings, and the bf16 + fp32 residual written as fp32 (its
    # binding allocating bf16 made the kernel write past the buffer: here the result would be wrong or crash)
    _, _, _, plan = _bf16_plan(tmp_path, body)
    assert emulated_against_interpreter(plan, tmp_path) == 2


NORM_THEN_LINEAR = """
def __init__(self):
    super().__init__()
    self.ln = nn.LayerNorm({n})
    self.fc = nn.Linear({n}, 16)
    self.proj = nn.Parameter(torch.randn({n}, 16))

def forward(self, x):
    return self.fc(self.ln(x)) + torch.softmax(x, -1) @ self.proj
"""


@pytest.mark.parametrize(("n", "rows", "family"), [(64, 256, "row"), (65536, 2, "split")])
def test_a_norm_and_a_softmax_store_autocasts_bf16_cast_themselves(tmp_path, n, rows, family):
    # autocast casts a LayerNorm's (and a softmax's) fp32 output to bf16 before the Linear: the row kernel
    # computes in fp32 and rounds once where it stores bf16, instead of a torch copy after it
    from kernelfuse.codegen.generated import _family

    path = write_problem(tmp_path, "norm_linear", NORM_THEN_LINEAR.format(n=n), f"[torch.randn({rows}, {n})]")
    problem = load_problem(path)
    model = build_model(problem)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    plan = plan_variants(graph, "bf16")[0]
    rows_steps = [s for s in plan.generated if s.spec is not None and s.spec.kind in ("norm", "softmax")]
    assert len(rows_steps) == 2, plan.summary()
    for step in rows_steps:
        assert step.source.meta.dtype == torch.float32 and step.out_meta.dtype == torch.bfloat16, step.kernel
        assert step.epilogue.statements[-1].aten == "_to_copy.default"
    norm = next(s for s in rows_steps if s.spec.kind == "norm")
    assert _family(norm) == family  # one row per group of threads, or each row split in chunks across blocks
    assert emulated_against_interpreter(plan, tmp_path) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


LINEAR_THEN_NORM = """
def __init__(self):
    super().__init__()
    self.fc = nn.Linear(32, {cols})
    self.ln = nn.LayerNorm({norm})
    with torch.no_grad():
        self.ln.weight.uniform_(0.5, 1.5)
        self.ln.bias.uniform_(-0.5, 0.5)

def forward(self, x):
    return self.ln(self.fc(x).permute({perm})) * 2.0
"""


@pytest.mark.parametrize(("rows", "cols", "perm", "family"), [(256, 64, "0, 1", "row"), (96, 48, "1, 0", "row"),
                                                            (2, 65536, "0, 1", "split")])
def test_a_norm_reads_autocasts_widened_bf16_source_itself(tmp_path, rows, cols, perm, family):
    # autocast casts a bf16 Linear output to fp32 before a LayerNorm: the norm's kernel reads the bf16 value and
    # computes in fp32 (the widened value is exact), instead of a torch copy before it; rows contiguous, strided
    # (over a permuted output, as ConvNeXt's), or split across blocks
    from kernelfuse.codegen.generated import _family
    from kernelfuse.plan.ir import TorchStep

    norm_size = cols if perm == "0, 1" else rows
    body = LINEAR_THEN_NORM.format(cols=cols, norm=norm_size, perm=perm)
    path = write_problem(tmp_path, "linear_norm", body, f"[torch.randn({rows}, 32)]")
    problem = load_problem(path)
    model = build_model(problem)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    plan = plan_variants(graph, "bf16")[0]
    (norm,) = [s for s in plan.generated if s.spec is not None and s.spec.kind == "norm"]
    assert norm.source.meta.dtype == torch.bfloat16 and norm.reads_as == torch.float32
    assert [st.aten for st in norm.prologue.statements] == ["_to_copy.default"]
    assert _family(norm) == family
    torch_casts = [s.node for s in plan.steps if isinstance(s, TorchStep) and s.node.op == "_to_copy.default"]
    assert all(graph[c.args[0]].op in ("input", "param") for c in torch_casts), plan.summary()  # weights, x only
    sources = generate(plan)
    assert "const __nv_bfloat16* __restrict__ src, const float* __restrict__ weight" in sources.cuda
    check_bindings(plan, sources)
    # fp32 out: the norm's Welford arithmetic and ATen's CPU one differ by a few ulps
    assert emulated_against_interpreter(plan, tmp_path, ulps=64) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


RMS_THEN_LINEAR = """
def __init__(self):
    super().__init__()
    self.weight = nn.Parameter(torch.rand(64) + 0.5)
    self.fc = nn.Linear(64, 32)

def forward(self, x):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return self.fc(self.weight * h)
"""


def test_an_rms_norm_stores_autocasts_bf16_cast_itself(tmp_path):
    # Llama's RMSNorm computes in fp32 and autocast casts its output to bf16 for the next Linear: the
    # reduce-then-broadcast kernel stores bf16, instead of a torch copy after it
    from kernelfuse.plan.ir import TorchStep

    path = write_problem(tmp_path, "rms_linear", RMS_THEN_LINEAR, "[torch.randn(4, 256, 64)]")  # 1024 rows
    problem = load_problem(path)
    model = build_model(problem)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    plan = plan_variants(graph, "bf16")[0]
    (rms,) = [s for s in plan.generated if s.mapped is not None]
    assert rms.source.meta.dtype == torch.float32 and rms.out_meta.dtype == torch.bfloat16
    assert rms.mapped.statements[-1].aten == "_to_copy.default"
    torch_casts = [s.node for s in plan.steps if isinstance(s, TorchStep) and s.node.op == "_to_copy.default"]
    assert not any(c.args[0].name in rms.replaces for c in torch_casts), plan.summary()
    check_bindings(plan, generate(plan))
    assert emulated_against_interpreter(plan, tmp_path) == len(plan.generated)
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


CASTS = """
def forward(self, x):
    y = (x.half() * 3.0).float() + x
    return torch.exp(y.to(torch.bfloat16)).float()
"""


def test_casts_in_an_fp32_model_fuse_and_match_eager_exactly(tmp_path):
    path = write_problem(tmp_path, "casts", CASTS, "[torch.randn(4, 256)]")
    problem, graph, plans = pipeline(path)
    (plan,) = plans
    assert plan.unfused == [], plan.summary()
    (step,) = plan.generated
    assert [st.dtype for st in step.prologue.statements][:2] == [torch.float16, torch.float16]
    assert_interpreter_matches(problem, plan)  # the ops themselves, one by one: bitwise equal


REDUCED = """
def forward(self, x):
    return (x.float() * 2.0).sum(-1)
"""


def test_a_reduction_keeps_one_dtype(tmp_path):
    path = write_problem(tmp_path, "reduced", REDUCED, "[torch.randn(8, 512).half()]")
    problem, graph, plans = pipeline(path)
    (plan,) = plans
    reduction = next(s for s in plan.generated if s.reduce_node is not None)
    assert all(st.aten != "_to_copy.default" for st in reduction.prologue.statements)
    assert reduction.source.meta.dtype == torch.float32
    assert_interpreter_matches(problem, plan)


MOVED = """
def forward(self, x):
    return x.to(torch.float16, memory_format=torch.channels_last) * 2.0
"""


def test_a_cast_that_also_changes_the_layout_is_no_pointwise_op(tmp_path):
    path = write_problem(tmp_path, "moved", MOVED, "[torch.randn(2, 3, 4, 5)]")
    _, graph, plans = pipeline(path)
    cast = next(n for n in graph.nodes if n.op == "_to_copy.default")
    assert all(cast.name not in s.replaces for s in plans[0].generated)
    assert any(cast.name in line and "memory_format" in line for line in plans[0].summary().splitlines()), \
        plans[0].summary()


WIDENED = """
def forward(self, x):
    return x.float() * 2.0
"""


def test_the_vector_path_packs_16_bytes_of_the_wider_type(tmp_path):
    # fp16 in, fp32 out: 4 elements per access (8 bytes read, 16 written), each pack of its own type
    path = write_problem(tmp_path, "widened", WIDENED, "[torch.randn(64, 256).half()]")
    problem, _, plans = pipeline(path)
    (plan,) = plans
    (step,) = plan.generated
    assert step.source.meta.dtype == torch.float16 and step.out_meta.dtype == torch.float32
    cuda = generate(plan).cuda
    assert "kf_pack<__half, VEC> p" in cuda and "kf_pack<float, VEC> q" in cuda
    assert f"{step.kernel}_kernel<4><<<" in cuda and f"{step.kernel}_kernel<8>" not in cuda
    assert_interpreter_matches(problem, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("body", [GELU_MLP, RESIDUAL_SECOND], ids=["residual_first", "residual_second"])
def test_mixed_dtype_kernels_match_eager_under_autocast_on_the_gpu(tmp_path, body):
    """The GELU MLP's bf16 plan run as an emitted file on the GPU: its bf16-in, bf16-out GELU kernel (fp32 pow and
    tanh inside) and its fp32 + bf16 residual kernel (either operand its source) give eager-under-autocast's
    result, through the kernels."""
    problem, model, graph, plan = _bf16_plan(tmp_path, body)
    assert any(_mixes(step) for step in plan.generated)
    torch.manual_seed(3)
    got, expected = _emitted_against_autocast_eager(problem, model, plan, torch.randn(8, 32, 64), tmp_path)
    assert got.dtype == expected.dtype == torch.float32


def _emitted_against_autocast_eager(problem, model, plan, x: torch.Tensor, tmp_path: Path) -> tuple:
    """The plan's emitted file on the GPU (no autocast: it carries its casts) and the model under CUDA bf16
    autocast, on `x`: (ours, eager's), after asserting the kernels served the call and the two agree to 1e-2."""
    path = tmp_path / f"{problem.name}_bf16.py"
    path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    fused = runpy.run_path(str(path))["ModelNew"]().cuda().train(model.training)
    fused.load_state_dict(model.state_dict())
    reference, x = model.cuda(), x.cuda()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = reference(x)
        got = fused(x)
    assert fused.kernelfuse_stats()["fused_calls"] == 1
    assert torch.allclose(got.float(), expected.float(), atol=1e-2, rtol=1e-2), (got - expected).abs().max().item()
    return got, expected


def _mixes(step: GenStep) -> bool:
    return len({st.dtype for st in step.prologue.statements if st.dtype is not None}) > 1
