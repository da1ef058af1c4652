"""The generated attention kernels: run on the CPU through tests/fixtures/cuda_emulation.h and the emitted binding,
they match eager and the float64 reference on odd sizes (S and L not tile multiples, causal, bool and additive
masks, grouped-query heads, head dims 32 to 256), fp32 under the tf32 policy too; on a GPU in fp32 and bf16 (head
dims 40 and 72 against torch's SDPA); built with nvcc for sm_90 with every mask kind in every dtype; bf16 autocast's
fp32 softmax and Swin's shifted-window mask each one kernel; a NaN key giving NaN rows, not a masked row's zeros.
The attention rule's tests are in tests/test_attention_plan.py; the bf16 tensor-core and flash kernels' own in
tests/test_attention_flash.py; the cases in tests/attention_cases.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_cases import CASES, PADDED_CASES, Fn, bool_mask, planned, sdpa_fn
from emulation_helpers import emulated, node_values

from kernelfuse.capture import capture_module
from kernelfuse.codegen.attention import flash_warps, input_strides, uses_tensor_cores
from kernelfuse.plan import PlanOptions, interpret, make_plan
from kernelfuse.plan.attention_views import attention_reference
from kernelfuse.plan.ir import AttnStep
from kernelfuse.rewrite import rewrite


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernel_matches_eager(name, tmp_path):
    """The generated kernel on the CPU (block threads as std::threads), called through the emitted binding: exact
    FMA for hand-written attention, 3xTF32 tensor cores (mma.sync emulated) for SDPA nodes with head dims <= 128."""
    model, inputs, graph, plan = planned(name)
    step: AttnStep = plan.attention[0]
    assert step.math == ("3xtf32" if step.origin == "sdpa" else "fma")
    assert uses_tensor_cores(step) == (step.origin == "sdpa" and step.dims[5] <= 128)
    # the fp32 flash kernel wherever q, k and v are contiguous along d (the launcher also checks the bases)
    flash = uses_tensor_cores(step) and name != "sdpa_strided_k_d32"
    assert flash_warps(step, input_strides(step)) == (min(4, -(-step.dims[3] // 16)) if flash else 0)
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    emu = emulated(plan, tmp_path)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emu.kernels, step.kernel)(*args)
    expected = env[step.out]
    assert got.shape == expected.shape and got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, equal_nan=True)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got, reference, rtol=2e-5, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.endswith("d256")))
def test_emulated_tf32_policy_kernel_matches_the_reference(name, tmp_path):
    """fp32 under the tf32 policy: one TF32 product on tensor cores (head dims in steps of 8, 40 included)."""
    model, inputs, graph, _ = planned(name)
    plan = make_plan(graph, PlanOptions(matmul_tf32=True))
    step: AttnStep = plan.attention[0]
    assert step.math == "tf32" and uses_tensor_cores(step)
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    emu = emulated(plan, tmp_path)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emu.kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2, equal_nan=True)
    assert (got - reference).abs().nan_to_num(0).max() > 1e-6  # TF32 rounding shows: not the FMA kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernel_matches_eager(name, dtype, tmp_path):
    """On the GPU, through the emitted file's binding: fp32 within the strict rule, bf16 (tensor cores where the head
    dim allows) within 2e-2 of the float64 reference."""
    from kernelfuse.codegen import generate
    from kernelfuse.emit.module import load_kernels

    model, inputs, graph, plan = planned(name, dtype)
    step = plan.attention[0]
    kernels = load_kernels(generate(plan), f"attention_{name}_{str(dtype)[6:]}")
    model = model.cuda()
    with torch.no_grad():
        env = node_values(graph, model, [t.cuda() for t in inputs])
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    if dtype == torch.float32:  # the strict rule against eager, and as close to float64 as eager's unfused form
        torch.testing.assert_close(got, env[step.out], rtol=1e-4, atol=1e-4, equal_nan=True)
        torch.testing.assert_close(got, reference, rtol=2e-5, atol=2e-5, equal_nan=True)
    else:  # bf16 eager rounds its scores to bf16: the float64 reference of the same inputs is the fair judge
        torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(n for n in {**CASES, **PADDED_CASES}
                                        if n.startswith("sdpa") and n.endswith(("d40", "d72"))))
def test_gpu_bf16_padded_head_dims_match_torch_sdpa(name):
    """bf16 at head dims 40 and 72 (odd multiples of 8, padded to the k16 steps inside the kernel) on the GPU: the
    flash kernel, or the first tensor-core kernel where q or k is strided along d, within bf16 tolerance of the
    float64 reference and of torch's own SDPA on CUDA (its flash or memory-efficient backend: fp32 scores,
    probabilities rounded to bf16, as ours)."""
    from kernelfuse.codegen import generate
    from kernelfuse.emit.module import load_kernels

    model, inputs, graph, plan = planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert uses_tensor_cores(step) and step.dims[5] in (40, 72)
    kernels = load_kernels(generate(plan), f"attention_padded_{name}")
    model, inputs = model.cuda(), [t.cuda() for t in inputs]
    with torch.no_grad():
        env = node_values(graph, model, inputs)
        sdpa = model(*inputs)  # F.scaled_dot_product_attention on the same CUDA tensors
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
    assert got.shape == sdpa.shape and got.dtype == sdpa.dtype == torch.bfloat16
    if "bool_mask" in name:  # the row that attends to nothing: torch's CPU SDPA (and ours, above) gives zeros there,
        # its CUDA backends do not (measured on an H200, torch 2.11); compare the other rows
        attends = args[3].expand(got.shape[:-1] + args[3].shape[-1:]).any(-1, keepdim=True)
        got, sdpa = got * attends, sdpa * attends
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=3e-2, atol=3e-2, equal_nan=True)


@pytest.mark.parametrize("name, dtype, tf32", [("handwritten_relu_d64", torch.bfloat16, False),
                                               ("sdpa_gqa_d128", torch.bfloat16, False),
                                               ("sdpa_gqa_d128", torch.float32, False),
                                               ("sdpa_bool_mask_d40", torch.bfloat16, False),
                                               ("sdpa_causal_d72", torch.bfloat16, False),
                                               ("sdpa_strided_k_add_mask_d72", torch.bfloat16, False),
                                               ("sdpa_d256", torch.bfloat16, False),
                                               ("handwritten_causal_d96", torch.float32, True)])
def test_kernels_build_with_nvcc_for_sm90(name, dtype, tf32, tmp_path):
    """The tensor-core kernels (mma.sync needs sm_80+: bf16, head dims 40 and 72 over a zero pad included; fp32's
    flash kernel in 3xTF32 (strict, SDPA) and TF32 (the tf32 policy)) and the FMA kernel on bf16 (head dim 256)
    build."""
    import subprocess

    from test_nvcc_compile import _nvcc

    from kernelfuse.codegen import generate

    nvcc = _nvcc()
    *_, graph, _ = planned(name, dtype)
    plan = make_plan(graph, PlanOptions(matmul_tf32=tf32))
    cu = tmp_path / "attention.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("kf_attention<" not in cu.read_text()) == uses_tensor_cores(plan.attention[0])


def _every_kind(m, qd, q32, keepd, keep32, addd, add32):
    """Every mask kind at head dim d (qd: the FMA kernel, fp32 SDPA's 3xTF32 and bf16's padded tensor cores where d is
    a multiple of 8) and on tensor cores (32, bf16 and fp32 SDPA)."""
    drop32 = torch.bmm(q32[0], q32[0].transpose(1, 2)).masked_fill(~keep32[0, 0], float("-inf"))
    dropd = torch.bmm(qd[0], qd[0].transpose(1, 2)).masked_fill(~keepd[0, 0], float("-inf"))
    return (F.scaled_dot_product_attention(qd, qd, qd), F.scaled_dot_product_attention(qd, qd, qd, keepd),
            F.scaled_dot_product_attention(qd, qd, qd, addd), F.scaled_dot_product_attention(q32, q32, q32, keep32),
            F.scaled_dot_product_attention(q32, q32, q32, add32),
            F.scaled_dot_product_attention(q32, q32, q32, is_causal=True),
            torch.bmm(torch.softmax(drop32, -1), q32[0]), torch.bmm(torch.relu(dropd), qd[0]))


@pytest.mark.parametrize("dtype, d", [(torch.float32, 40), (torch.bfloat16, 40), (torch.bfloat16, 36),
                                      (torch.float16, 40)])
def test_every_mask_kind_builds_with_nvcc_in_every_dtype(dtype, d, tmp_path):
    """Each kernel template instantiated with each mask type builds (a bf16 additive mask compared with 0 once
    broke the bf16 build on the GPU): bf16 at head dim 40 on the padded tensor-core kernels, at 36 on the FMA
    kernel."""
    import subprocess

    from test_nvcc_compile import _nvcc

    from kernelfuse.codegen import generate

    nvcc = _nvcc()
    inputs = [torch.randn(1, 2, 9, d, dtype=dtype), torch.randn(1, 2, 9, 32, dtype=dtype),
              bool_mask(1, 2, 9, 9, empty_row=False), bool_mask(1, 2, 9, 9, empty_row=False),
              torch.randn(1, 2, 9, 9, dtype=dtype), torch.randn(1, 2, 9, 9, dtype=dtype)]
    plan = make_plan(rewrite(capture_module(Fn(_every_kind), inputs)))
    assert sorted((a.mask_kind, a.activation) for a in plan.attention) == sorted(
        [("none", "softmax"), ("keep", "softmax"), ("add", "softmax"), ("keep", "softmax"), ("add", "softmax"),
         ("none", "softmax"), ("drop", "softmax"), ("drop", "relu")]), plan.summary()
    if dtype == torch.bfloat16:
        assert {uses_tensor_cores(a) for a in plan.attention if a.dims[5] == d} == {d % 8 == 0}
    cu = tmp_path / "attention.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O1", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def _autocast_window(m, q, k, v, bias):
    """Swin's window attention as bf16 autocast runs it: bf16 scores plus an fp32 relative-position bias (the add
    is fp32), softmax in fp32, the probabilities cast to bf16 for the second product."""
    att = (q * 0.25) @ k.transpose(-2, -1)
    att = torch.softmax(att + bias, dim=-1)
    return att.to(torch.bfloat16) @ v


def _autocast_plain(m, q, k, v):
    """An attention whose softmax autocast widens: bf16 scores cast to fp32, the probabilities back to bf16."""
    return torch.softmax((q @ k.transpose(-2, -1)).float() * 0.3, dim=-1).to(torch.bfloat16) @ v


@pytest.mark.parametrize("fn, extra", [(_autocast_window, True), (_autocast_plain, False)])
def test_bf16_attention_with_fp32_softmax_is_one_kernel(fn, extra, tmp_path):
    """Under bf16 autocast the scores meet an fp32 mask (or a cast) and the softmax runs in fp32, its result cast
    to bf16 for the second product: the casts join the attention (the kernel scores in fp32 and rounds the
    probabilities to bf16), the fp32 bias is the additive mask. The emulated bf16 flash kernel against the float64
    reference and eager; the -sdpa variant keeps the kernel where torch's SDPA would refuse the fp32 mask."""
    torch.manual_seed(0)
    qkv = [torch.randn(3, 2, 37, 32).to(torch.bfloat16) for _ in range(3)]
    inputs = [*qkv, torch.randn(2, 37, 37)] if extra else qkv
    graph = rewrite(capture_module(Fn(fn), inputs))
    plan = make_plan(graph)
    assert len(plan.attention) == 1, plan.summary()
    step: AttnStep = plan.attention[0]
    assert step.out_meta.dtype == torch.bfloat16 and uses_tensor_cores(step)
    assert (step.mask_kind, step.mask.meta.dtype if step.mask else None) == \
        (("add", torch.float32) if extra else ("none", None))
    assert not [n for n in graph.nodes if n.op == "_to_copy.default" and n.name not in step.replaces]
    if extra:
        library = make_plan(graph, PlanOptions(attention="library"))
        assert library.attention[0].impl == "kernel"
    with torch.no_grad():
        env = node_values(graph, Fn(fn), inputs)
        expected = Fn(fn)(*inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emulated(plan, tmp_path).kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if extra else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


def _shifted_windows(m, q, k, v, bias, windows):
    """Swin's shifted-window attention (torchvision's form): the relative-position bias added, the scores viewed as
    (images, windows, heads, S, L) for the window mask, viewed back; q, k, v of bf16 under autocast's shape (the
    adds then in fp32, the probabilities cast back)."""
    att = (q * 0.3) @ k.transpose(-2, -1)
    att = att + bias.unsqueeze(0)
    att = att.view(-1, windows.shape[0], *att.shape[1:]) + windows.unsqueeze(1).unsqueeze(0)
    att = torch.softmax(att.view(-1, *att.shape[2:]), dim=-1)
    return att.to(q.dtype) @ v


@pytest.mark.parametrize("dtype, option", [(torch.float32, "kernel"), (torch.float32, "split"),
                                           (torch.bfloat16, "kernel")])
def test_shifted_window_mask_is_part_of_the_attention(dtype, option, tmp_path):
    """The window mask (one per window of every image, merged into the batch) is a second additive mask that batch
    b reads at window b % windows: one kernel (fp32 FMA, fp32 3xTF32 flash, bf16 flash with fp32 masks), against
    the float64 reference and eager; the -sdpa variant keeps the kernel."""
    torch.manual_seed(0)
    qkv = [torch.randn(6, 2, 37, 32).to(dtype) for _ in range(3)]
    windows = torch.where(torch.rand(3, 37, 37) > 0.3, 0.0, -100.0)
    inputs = [*qkv, torch.randn(2, 37, 37), windows]
    graph = rewrite(capture_module(Fn(_shifted_windows), inputs))
    plan = make_plan(graph, PlanOptions(attention=option))
    assert len(plan.attention) == 1, plan.summary()
    step: AttnStep = plan.attention[0]
    assert (step.window_count, step.mask_kind, step.windows.meta.shape) == (3, "add", (1, 3, 1, 37, 37))
    assert "3-window mask" in plan.summary()
    assert make_plan(graph, PlanOptions(attention="library")).attention[0].impl == "kernel"
    with torch.no_grad():
        env = node_values(graph, Fn(_shifted_windows), inputs)
        expected = Fn(_shifted_windows)(*inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emulated(plan, tmp_path).kernels, step.kernel)(*args)
    reference = attention_reference(step, *args)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol * 1.5, atol=tol * 1.5)
    model = Fn(_shifted_windows)  # the CPU check's plan interpreter computes the same reference
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    torch.testing.assert_close(interpret(plan, state, inputs)[0], reference, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_key_gives_nan_rows_not_the_masked_rows_zeros(dtype, tmp_path):
    """SDPA gives zeros for a row whose every key is masked, but NaN for a row that reads a NaN: the kernels (fp32
    3xTF32 and bf16 flash, emulated) and the interpreter's reference tell the two apart by the row sum (exactly 0,
    or NaN) where both once wrote zeros."""
    model, inputs, graph, plan = planned("sdpa_d32", dtype)
    step: AttnStep = plan.attention[0]
    inputs[1][0, 1, 5, 3] = float("nan")  # batch 0, head 1: every query reads key 5
    with torch.no_grad():
        env = node_values(graph, model, inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emulated(plan, tmp_path).kernels, step.kernel)(*args)
    reference = attention_reference(step, *args, None)
    assert got[0, 1].isnan().all() and reference[0, 1].isnan().all() and env[step.out][0, 1].isnan().all()
    assert not got[1].isnan().any() and not got[0, 0].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_3xtf32_attention_over_long_rows_is_within_the_float64_rule(dim):
    """Strict fp32 SDPA on tensor cores (3xTF32) over 4096 keys: each key tile's products, and at head dims above 64
    each 32 columns of the scores, summed in a fresh accumulator and added with round-to-nearest, since the tensor
    cores' fp32 accumulation truncates. Carried through every tile, the output drifted toward zero (twice the error
    of torch's fp32 SDPA at 1024 keys; Llama's attention failed the float64 rule). The largest error against float64
    is within the judge's rule: twice that of torch's own fp32 SDPA. (The truncation inside a tile remains: the
    errors are still mostly of one sign, measured on an H200 at stop 53.)"""
    from kernelfuse.codegen import generate
    from kernelfuse.emit.module import load_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 4096, dim) for _ in range(3))
    v = v + 1.0  # outputs away from zero: a drift toward it shows as a signed error
    model = Fn(sdpa_fn())
    plan = make_plan(rewrite(capture_module(model, [q, k, v])))
    step: AttnStep = plan.attention[0]
    assert step.math == "3xtf32" and uses_tensor_cores(step)
    kernels = load_kernels(generate(plan), f"attention_3xtf32_long_d{dim}")
    q, k, v = (t.cuda() for t in (q, k, v))
    with torch.no_grad():
        got = getattr(kernels, step.kernel)(q, k, v)
        torchs = F.scaled_dot_product_attention(q, k, v)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ours, theirs = float((got.double() - exact).abs().max()), float((torchs.double() - exact).abs().max())
    assert ours <= 2 * theirs, (ours, theirs)
