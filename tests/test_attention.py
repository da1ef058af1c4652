"""The attention rule and kernel family: SDPA nodes and hand-written attention become one flash-attention step
(kernelfuse.plan.attention), proven in float64 through the plan interpreter; the generated kernel, run on the CPU
through tests/fixtures/cuda_emulation.h and the emitted binding, matches eager on odd sizes (S and L not tile
multiples, causal, bool and additive masks, grouped-query heads, head dims 32 to 256); the flash kernels (bf16:
cp.async, ldmatrix, in blocks of 4 or 8 warps; fp32 3xTF32 and TF32) run there too."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import emulation_helpers
import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import emulated
from torch import nn

from kernelfuse.capture import capture_module
from kernelfuse.codegen import attention
from kernelfuse.codegen.attention import FlashConfig, flash_config, flash_warps, input_strides, uses_tensor_cores
from kernelfuse.plan import PlanOptions, interpret, make_plan
from kernelfuse.plan.attention import SDPA, attention_reference
from kernelfuse.plan.interpret import call_aten
from kernelfuse.plan.ir import AttnStep
from kernelfuse.rewrite import rewrite


class Fn(nn.Module):
    """A forward given as a function of (module, *inputs), with a causal buffer and a projection. Capture keeps
    scaled_dot_product_attention whole for classes whose source names it, as this docstring does."""

    def __init__(self, fn, width: int = 0, seq: int = 128):
        super().__init__()
        self.fn = fn
        self.register_buffer("tril", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))
        self.proj = nn.Linear(width, 3 * width) if width else None

    def forward(self, *xs):
        return self.fn(self, *xs)


def _sdpa(**kw):
    return lambda m, q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def _handwritten(mask: str, heads: int):
    """minGPT's attention: one projection split into q, k, v, heads moved forward, the result moved back."""
    def fn(m, x):
        b, t, c = x.shape
        q, k, v = m.proj(x).split(c, dim=2)
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if mask in ("causal", "relu"):
            att = att.masked_fill(m.tril[:, :, :t, :t] == 0, float("-inf"))
        elif mask == "add":
            att = att + m.tril[:, :, :t, :t]
        att = F.relu(att) if mask == "relu" else F.softmax(att, dim=-1)
        y = att @ v
        return y.transpose(1, 2).contiguous().view(b, t, c)
    return fn


def _bmm3d(m, q, k, v, mask):
    """Attention over a merged (batch * heads) dim with torch.bmm and a bool mask that empties some rows."""
    att = torch.bmm(q, k.transpose(1, 2)) * 0.3
    att = att.masked_fill(~mask, float("-inf"))  # row 1 of every batch attends to nothing: NaN, as eager gives
    return torch.bmm(torch.softmax(att, -1), v)


def _kv_cache(m, q, k, v):
    """transformers' cache on a first call: an empty tensor concatenated with the new keys and values, the heads
    moved forward by transposes (a copy each, read past by the kernel once the empty operand is gone)."""
    k, v = (torch.cat([t.new_zeros(0), t.transpose(1, 2)], -2) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _bool_mask(*shape: int, empty_row: bool = True) -> torch.Tensor:
    torch.manual_seed(3)
    m = torch.rand(*shape) > 0.3
    if empty_row:
        m[..., 1, :] = False  # SDPA: a row that attends to nothing gives zeros
    return m


CASES = {
    # name: (forward, inputs, expected attention kind)
    "sdpa_d32": (_sdpa(), [_randn(2, 3, 70, 32), _randn(2, 3, 70, 32), _randn(2, 3, 70, 32)], "sdpa"),
    "sdpa_causal_d64": (_sdpa(is_causal=True), [_randn(1, 2, 67, 64), _randn(1, 2, 67, 64), _randn(1, 2, 67, 64)],
                        "sdpa"),
    "sdpa_causal_s150_l170_d32": (_sdpa(is_causal=True), [_randn(1, 2, 150, 32), _randn(1, 2, 170, 32),
                                                          _randn(1, 2, 170, 32)], "sdpa"),  # several query tiles
    "sdpa_bool_mask_d40": (_sdpa(), [_randn(2, 2, 19, 40), _randn(2, 2, 77, 40), _randn(2, 2, 77, 40),
                                     _bool_mask(19, 77)], "sdpa"),
    "sdpa_add_mask_3d": (_sdpa(scale=0.2), [_randn(3, 5, 48), _randn(3, 70, 48), _randn(3, 70, 48),
                                           _randn(3, 5, 70)], "sdpa"),
    "sdpa_gqa_d128": (_sdpa(enable_gqa=True), [_randn(1, 4, 66, 128), _randn(1, 2, 66, 128),
                                               _randn(1, 2, 66, 128)], "sdpa"),
    "sdpa_strided_k_d32": (_sdpa(), [_randn(1, 2, 33, 32), _randn(1, 2, 32, 33).transpose(-2, -1),
                                     _randn(1, 2, 33, 32)], "sdpa"),  # k not contiguous along d: no 16-byte loads
    "sdpa_d256": (_sdpa(is_causal=True), [_randn(1, 1, 35, 256), _randn(1, 1, 35, 256), _randn(1, 1, 35, 256)],
                  "sdpa"),
    "sdpa_short_s2_d64": (_sdpa(), [_randn(6, 3, 2, 64), _randn(6, 3, 2, 64), _randn(6, 3, 2, 64)],
                          "sdpa"),  # a few tokens a row (KernelBench's ViT): fp32 blocks of 1 warp, 16-key tiles
    "sdpa_kv_cache_d64": (_kv_cache, [_randn(1, 2, 67, 64), _randn(1, 67, 2, 64), _randn(1, 67, 2, 64)], "sdpa"),
    "handwritten_causal_d96": (_handwritten("causal", 2), [_randn(2, 70, 192)], "hand-written"),
    "handwritten_add_d32": (_handwritten("add", 3), [_randn(1, 37, 96)], "hand-written"),
    "handwritten_relu_d64": (_handwritten("relu", 2), [_randn(2, 67, 128)], "hand-written"),
    "bmm_bool_mask": (_bmm3d, [_randn(4, 9, 16), _randn(4, 20, 16), _randn(4, 20, 16), _bool_mask(4, 9, 20)],
                      "hand-written"),
}


# Cases for the bf16 flash kernel's 128-query blocks only: the causal diagonal and ragged tails (S not a multiple of
# 128, L not of 64) over several query tiles at head dim 128
FLASH_CASES = {
    "sdpa_causal_s150_l170_d128": (_sdpa(is_causal=True), [_randn(1, 1, 150, 128), _randn(1, 1, 170, 128),
                                                           _randn(1, 1, 170, 128)], "sdpa"),
}


# bf16 head dims that are odd multiples of 8 (24, 40, 72: the scores' last k16 step half zero pad): the flash kernel
# (q, k and v contiguous along d), and the first tensor-core kernel with k strided along d (its element-wise loads)
# or q strided (its 16-byte key and value loads); causal, bool and additive masks, a hand-written drop mask, ragged
# S and L over several tiles
PADDED_CASES = {
    "sdpa_causal_s150_l170_d40": (_sdpa(is_causal=True), [_randn(1, 2, 150, 40), _randn(1, 2, 170, 40),
                                                          _randn(1, 2, 170, 40)], "sdpa"),
    "sdpa_causal_d72": (_sdpa(is_causal=True), [_randn(1, 2, 67, 72), _randn(1, 2, 67, 72), _randn(1, 2, 67, 72)],
                        "sdpa"),
    "sdpa_add_mask_d72": (_sdpa(), [_randn(2, 2, 37, 72), _randn(2, 2, 77, 72), _randn(2, 2, 77, 72),
                                    _randn(37, 77)], "sdpa"),
    "sdpa_bool_mask_d24": (_sdpa(), [_randn(1, 3, 33, 24), _randn(1, 3, 50, 24), _randn(1, 3, 50, 24),
                                     _bool_mask(33, 50)], "sdpa"),
    "handwritten_causal_d40": (_handwritten("causal", 2), [_randn(2, 70, 80)], "hand-written"),
    "sdpa_strided_k_causal_d40": (_sdpa(is_causal=True), [_randn(1, 2, 67, 40), _randn(1, 2, 40, 67).transpose(-2, -1),
                                                          _randn(1, 2, 67, 40)], "sdpa"),
    "sdpa_strided_q_bool_mask_d40": (_sdpa(), [_randn(2, 2, 40, 19).transpose(-2, -1), _randn(2, 2, 77, 40),
                                               _randn(2, 2, 77, 40), _bool_mask(19, 77)], "sdpa"),
    "sdpa_strided_q_causal_d72": (_sdpa(is_causal=True), [_randn(1, 2, 72, 70).transpose(-2, -1),
                                                          _randn(1, 2, 70, 72), _randn(1, 2, 70, 72)], "sdpa"),
    "sdpa_strided_k_add_mask_d72": (_sdpa(), [_randn(2, 2, 37, 72), _randn(2, 2, 72, 77).transpose(-2, -1),
                                              _randn(2, 2, 77, 72), _randn(37, 77)], "sdpa"),
    "sdpa_strided_q_d24": (_sdpa(), [_randn(2, 2, 24, 33).transpose(-2, -1), _randn(2, 2, 33, 24),
                                     _randn(2, 2, 33, 24)], "sdpa"),
}


# The bf16 flash kernel's tilings (FlashConfig): head dim 96 causal over several query tiles and ragged key tiles (170
# keys: 64 + 64 + 42, or five of 32 and 10), beside PADDED_CASES' head dim 40 with a causal and a bool mask
TILING_CASES = {
    "sdpa_causal_s150_l170_d96": (_sdpa(is_causal=True), [_randn(1, 1, 150, 96), _randn(1, 1, 170, 96),
                                                          _randn(1, 1, 170, 96)], "sdpa"),
}
# The tilings: 4 or 8 warps, 64- or 32-key tiles, the query fragments in registers or re-read from shared memory
# (there with registers capped at 128 a thread, as the probe times them); the tests take every one but the case's
# default, which the other tests run
FLASH_TILINGS = [FlashConfig(warps, keys, q_in_registers, 0 if q_in_registers else 16 // warps)
                 for warps in (4, 8) for keys in (64, 32) for q_in_registers in (True, False)]


def _planned(name: str, dtype: torch.dtype = torch.float32, values: torch.dtype | None = None):
    """(model, inputs, graph, plan) captured and planned in `dtype`; model and inputs in `values` if given."""
    fn, inputs, _ = {**CASES, **FLASH_CASES, **PADDED_CASES, **TILING_CASES}[name]
    width = inputs[0].shape[-1] if name.startswith("handwritten") else 0
    torch.manual_seed(0)
    model = Fn(fn, width).to(dtype)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    graph = rewrite(capture_module(model, inputs))
    if values is not None:
        model = model.to(values)
        inputs = [t.to(values) if t.is_floating_point() else t for t in inputs]
    return model, inputs, graph, make_plan(graph)


def _values(graph, model, inputs) -> dict[str, object]:
    """Every node's value, computed with the ATen ops themselves."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    env: dict[str, object] = {}
    for node in graph.nodes:
        if node.op == "input":
            env[node.name] = inputs[int(node.target)]
        elif node.op in ("param", "buffer"):
            env[node.name] = state[str(node.target)]
        else:
            env[node.name] = call_aten(node, env)
    return env


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_becomes_one_step_proven_in_float64(name):
    """The plan (one attention step, the rest torch calls and kernels), run in float64, computes the model."""
    model, inputs, graph, plan = _planned(name, values=torch.float64)
    assert [s.origin for s in plan.attention] == [CASES[name][2]], plan.summary()
    ops = {graph[n].op for n in plan.attention[0].replaces}
    assert not ops & {"clone.default", "expand.default"} or CASES[name][2] == "hand-written" or \
        (name == "sdpa_kv_cache_d64" and ops == {SDPA, "clone.default"})
    with torch.no_grad():
        expected = model(*inputs)
        got = interpret(plan, {**dict(model.named_parameters()), **dict(model.named_buffers())}, inputs)[0]
    assert got.shape == expected.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, equal_nan=True)


def test_a_copy_protecting_keys_from_a_later_in_place_op_is_kept():
    """The KV cache's copy, then the keys mutated in place: attention reads the copy, not the mutated keys."""
    def fn(m, q, k, v):
        kc, vc = (torch.cat([t.new_zeros(0), t.transpose(1, 2)], -2) for t in (k, v))
        k.mul_(2.0)
        return F.scaled_dot_product_attention(q, kc, vc, is_causal=True)

    torch.manual_seed(0)
    inputs = [_randn(1, 2, 67, 64), _randn(1, 67, 2, 64), _randn(1, 67, 2, 64)]
    model = Fn(fn)
    graph = rewrite(capture_module(model, [t.clone() for t in inputs]))
    plan = make_plan(graph)
    (step,) = plan.attention
    assert graph[step.k.ref].op == graph[step.v.ref].op == "clone.default"  # the copies, not the mutated keys
    model, inputs = model.double(), [t.double() for t in inputs]
    with torch.no_grad():
        expected = model(*[t.clone() for t in inputs])
        got = interpret(plan, {**dict(model.named_parameters()), **dict(model.named_buffers())},
                        [t.clone() for t in inputs])[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_handwritten_absorbs_every_copy_around_attention():
    """minGPT's form: the three copies feeding the bmms and the copy after them are the kernel's strides."""
    _, _, graph, plan = _planned("handwritten_causal_d96")
    step = plan.attention[0]
    assert step.mask_kind == "drop" and step.empty_nan and step.k.swap
    assert [graph[n].op for n in step.replaces].count("clone.default") == 4
    assert graph[step.out].op == "clone.default" and step.out_meta.shape == (2, 70, 2, 96)
    assert not any(s.node.op == "clone.default" for s in plan.unfused)


@pytest.mark.parametrize("name, variants", [("sdpa_d32", ["fused", "fused-sdpa"]),
                                            ("handwritten_causal_d96", ["fused", "fused-3xtf32", "fused-sdpa"]),
                                            ("handwritten_relu_d64", ["fused", "fused-3xtf32"])])
def test_attention_plans_get_their_measured_twins(name, variants):
    """3xTF32 for hand-written fp32 attention (exact FMA in the first plan), one torch SDPA call for softmax
    attention (ReLU attention has none)."""
    from kernelfuse.plan import plan_variants

    *_, graph, _ = _planned(name)
    assert [p.variant for p in plan_variants(graph)] == variants


def test_dropout_in_training_keeps_attention_unfused():
    def fn(m, q, k, v):
        att = torch.softmax(q @ k.transpose(-2, -1), -1)
        return F.dropout(att, 0.1, training=True) @ v

    q = torch.randn(1, 2, 8, 16)
    plan = make_plan(rewrite(capture_module(Fn(fn), [q, q.clone(), q.clone()])))
    assert not plan.attention
    sdpa = make_plan(rewrite(capture_module(Fn(_sdpa(dropout_p=0.1)), [q, q.clone(), q.clone()])))
    assert not sdpa.attention and "dropout" in sdpa.summary()


def test_head_dims_over_256_stay_sdpa_calls_with_the_reason():
    q = torch.randn(1, 2, 8, 320)
    plan = make_plan(rewrite(capture_module(Fn(_sdpa()), [q, q.clone(), q.clone()])))
    assert not plan.attention and "attention: head dim 320 over 256" in plan.summary()


def test_scores_read_elsewhere_keep_attention_unfused():
    def fn(m, q, k, v):
        att = torch.softmax(q @ k.transpose(-2, -1), -1)
        return att @ v, att

    q = torch.randn(1, 2, 8, 16)
    assert not make_plan(rewrite(capture_module(Fn(fn), [q, q.clone(), q.clone()]))).attention


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernel_matches_eager(name, tmp_path):
    """The generated kernel on the CPU (block threads as std::threads), called through the emitted binding: exact
    FMA for hand-written attention, 3xTF32 tensor cores (mma.sync emulated) for SDPA nodes with head dims <= 128."""
    model, inputs, graph, plan = _planned(name)
    step: AttnStep = plan.attention[0]
    assert step.math == ("3xtf32" if step.origin == "sdpa" else "fma")
    assert uses_tensor_cores(step) == (step.origin == "sdpa" and step.dims[5] <= 128)
    # the fp32 flash kernel wherever q, k and v are contiguous along d (the launcher also checks the bases)
    flash = uses_tensor_cores(step) and name != "sdpa_strided_k_d32"
    assert flash_warps(step, input_strides(step)) == (min(4, -(-step.dims[3] // 16)) if flash else 0)
    with torch.no_grad():
        env = _values(graph, model, inputs)
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
    model, inputs, graph, _ = _planned(name)
    plan = make_plan(graph, PlanOptions(matmul_tf32=True))
    step: AttnStep = plan.attention[0]
    assert step.math == "tf32" and uses_tensor_cores(step)
    with torch.no_grad():
        env = _values(graph, model, inputs)
    emu = emulated(plan, tmp_path)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emu.kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2, equal_nan=True)
    assert (got - reference).abs().nan_to_num(0).max() > 1e-6  # TF32 rounding shows: not the FMA kernel


TENSOR_CORE_CASES = sorted([*(n for n in CASES if not n.endswith("d256")), *PADDED_CASES])  # head dims 16..128


@pytest.fixture
def poisoned_shared(tmp_path, monkeypatch):
    """The emulation with every block's dynamic shared memory NaN-filled (fp32 and bf16 alike) before its threads
    start: a kernel that computes with shared memory it never wrote (a head dim's pad columns left unzeroed) gives
    NaN where the static buffer's leftovers (zeros at first) would hide it."""
    define = "#define KF_DYNAMIC_SHARED(name) alignas(16) static float name[227 * 1024 / 4]"
    text = emulation_helpers.EMULATION.read_text()
    assert define in text
    header = tmp_path / "cuda_emulation_poisoned.h"
    header.write_text(text.replace(define, f"{define}; kf_emu_poison(name, sizeof(name))") + """
inline void kf_emu_poison(float* smem, std::size_t bytes) {
  if (threadIdx.x == 0) std::memset(smem, 0xff, bytes);
  __syncthreads();
}
""")
    monkeypatch.setattr(emulation_helpers, "EMULATION", header)


@pytest.mark.parametrize("name", TENSOR_CORE_CASES)
def test_emulated_bf16_tensor_core_kernel_matches_the_reference(name, tmp_path, poisoned_shared):
    """bf16 on tensor cores: mma.sync m16n8k16, ldmatrix and cp.async emulated from their PTX layouts, against the
    float64 reference of the same bf16 inputs (probabilities rounded to bf16 for the second product: bf16
    tolerance). q, k and v contiguous along d take the flash kernel (4 warps of 16 query rows a block at these
    sizes); q or k strided along d the first tensor-core kernel. Head dims that are odd multiples of 8 (24, 40, 72)
    run there too, over zero pad columns in shared memory that starts NaN-filled here."""
    model, inputs, graph, plan = _planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert uses_tensor_cores(step)
    assert flash_warps(step, input_strides(step)) == (0 if "strided" in name else 4)
    with torch.no_grad():
        env = _values(graph, model, inputs)
    emu = emulated(plan, tmp_path)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emu.kernels, step.kernel)(*args)
    assert got.dtype == torch.bfloat16 and got.stride() == env[step.out].stride()
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


FLASH_128_QUERY_CASES = ["handwritten_causal_d96", "handwritten_relu_d64", "sdpa_causal_s150_l170_d32", "sdpa_gqa_d128",
                         "sdpa_causal_s150_l170_d40", *FLASH_CASES]


@pytest.mark.parametrize("device", ["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", FLASH_128_QUERY_CASES)
def test_bf16_flash_kernel_with_128_query_blocks(name, device, tmp_path, monkeypatch, poisoned_shared):
    """The flash kernel's 128-query blocks: 8 warps of 16 rows (chosen where they fill every SM: here with the SM
    count patched to 1). Warps whose rows are all past S or before a causal tile's first key sit tiles out, a bool
    mask skips tiles; head dim 40 (5 copies a row: 256 threads leave one idle) over zero pad columns."""
    monkeypatch.setattr(attention, "SMS", 1)
    model, inputs, graph, plan = _planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert flash_warps(step, input_strides(step)) == 8
    if device == "cuda":
        from kernelfuse.codegen import generate
        from kernelfuse.emit.module import load_kernels

        kernels = load_kernels(generate(plan), f"attention_flash8_{name}")
        model, inputs = model.cuda(), [t.cuda() for t in inputs]
    else:
        kernels = emulated(plan, tmp_path).kernels
    with torch.no_grad():
        env = _values(graph, model, inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(kernels, step.kernel)(*args)
    reference = attention_reference(step, *args[:3], args[3] if len(args) > 3 else None)
    torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


def test_flash_config_default_is_the_launch_bounds_rule():
    """The default tiling renders the template arguments the kernel had before its tiling was a FlashConfig: 64-key
    tiles, the query in registers, __launch_bounds__'s (D <= 64 ? 16 : 8) / WARPS blocks; min_blocks overrides it."""
    assert [FlashConfig(w).template_args(d) for w in (4, 8) for d in (40, 64, 96)] == [
        "4, 64, true, 4", "4, 64, true, 4", "4, 64, true, 2", "8, 64, true, 2", "8, 64, true, 2", "8, 64, true, 1"]
    assert FlashConfig(8, 32, False, 2).template_args(96) == "8, 32, false, 2"
    assert FlashConfig(0).template_args(96) == "0, 64, true, 0"  # not the flash kernel: the arguments go unused


@pytest.mark.parametrize(("name", "want"), [("sdpa_causal_s150_l170_d96", FlashConfig(4, 64, False, 4)),
                                             ("sdpa_causal_s150_l170_d40", FlashConfig(4)),
                                             ("sdpa_causal_d64", FlashConfig(4))])
def test_flash_config_reads_the_query_from_shared_memory_above_head_dim_64(name, want):
    """Head dims 65-96 re-read the query fragments from shared memory at 128 registers (two blocks of 8 warps an SM
    instead of one); up to 64 they stay in registers."""
    *_, plan = _planned(name, torch.bfloat16)
    (step,) = plan.steps
    assert flash_config(step, input_strides(step)) == want


def _tiled_plan(name: str, monkeypatch):
    """(model, inputs, graph, plan, tilings) for bf16 `name`: the plan's attention once per FLASH_TILINGS tiling but
    the case's default, each its own kernel of one file (tilings: kernel name -> tiling; flash_config patched to
    give each kernel its tiling)."""
    model, inputs, graph, plan = _planned(name, torch.bfloat16)
    (step,) = plan.steps
    default = flash_config(step, input_strides(step))
    tilings = {f"{step.kernel}_t{i}": tiling for i, tiling in enumerate(t for t in FLASH_TILINGS if t != default)}
    monkeypatch.setattr(attention, "flash_config", lambda s, strides: tilings[s.kernel])
    return model, inputs, graph, replace(plan, steps=tuple(replace(step, kernel=k) for k in tilings)), tilings


TILED = ["sdpa_causal_s150_l170_d96", "sdpa_causal_s150_l170_d40", "sdpa_bool_mask_d40"]


@pytest.mark.parametrize("name", TILED)
def test_emulated_bf16_flash_tilings_match_the_reference(name, tmp_path, monkeypatch, poisoned_shared):
    """Every non-default tiling of the bf16 flash kernel (8 warps, 32-key tiles, the query fragments re-read by
    ldmatrix at each k-step) against the float64 reference: the causal diagonal and the tiles a warp sits out at
    either key tile, ragged last tiles, a bool mask with a row that attends to nothing, and head dim 40's zero pad
    columns (re-read with the query fragments) in shared memory that starts NaN-filled."""
    model, inputs, graph, plan, tilings = _tiled_plan(name, monkeypatch)
    with torch.no_grad():
        env = _values(graph, model, inputs)
    kernels = emulated(plan, tmp_path).kernels
    args = [env[i.ref.name] for i in plan.steps[0].inputs]
    reference = attention_reference(plan.steps[0], *args[:3], args[3] if len(args) > 3 else None).float()
    for step in plan.steps:
        tiling = tilings[step.kernel]
        got = getattr(kernels, step.kernel)(*args)
        torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2, equal_nan=True,
                                   msg=lambda m, t=tiling: f"{t}: {m}")


@pytest.mark.parametrize("name", [*TILED, "sdpa_causal_d64"])
def test_bf16_flash_tilings_build_with_nvcc_for_sm90(name, tmp_path, monkeypatch):
    """Every non-default tiling, one file, at head dims 96, 40 and 64: __launch_bounds__ with min_blocks, 32-key
    tiles, the query fragments read from shared memory build for sm_90."""
    import subprocess

    from test_nvcc_compile import _nvcc

    from kernelfuse.codegen import generate

    nvcc = _nvcc()
    *_, plan, tilings = _tiled_plan(name, monkeypatch)
    cu = tmp_path / "attention.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "-c", str(cu), "-o", str(tmp_path / "a.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for tiling in tilings.values():
        assert f"{tiling.template_args(plan.steps[0].dims[5])}>(p, " in cu.read_text()


_LDMATRIX_CHECK = r"""
static unsigned short tile[16 * 24];  // 16 x 16 bf16 words, rows padded to 24
static std::atomic<int> wrong{0};
inline unsigned int pair(int r0, int c0, int r1, int c1) {  // (r0, c0) low, (r1, c1) high
  return tile[r0 * 24 + c0] | (unsigned)tile[r1 * 24 + c1] << 16;
}
extern "C" int check() {
  for (int i = 0; i < 16 * 24; ++i) tile[i] = (unsigned short)(i * 7 + 1);
  kf_emu_launch(dim3(1), 32, [&] {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    unsigned int a[4], k[4], v[4];
    // the flash kernel's addressing: the tile as A (16 x 16), as keys (two groups of 8 rows, k16 along the row),
    // as values (k16 down the rows, two groups of 8 columns)
    kf_ldmatrix_x4(a, tile + lane % 16 * 24 + lane / 16 * 8);
    kf_ldmatrix_x4(k, tile + (lane % 8 + lane / 16 * 8) * 24 + lane / 8 % 2 * 8);
    kf_ldmatrix_x4_trans(v, tile + lane % 16 * 24 + lane / 16 * 8);
    // mma.m16n8k16's fragments (PTX ISA): A a0..a7 = (g, 2t..+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..);
    // B b0..b3 = (k 2t..+1, n g), (k 2t + 8.., n g); keys are B[k][n] = tile[n][k], values B[k][n] = tile[k][n]
    const unsigned int want[12] = {
        pair(g, 2 * t, g, 2 * t + 1), pair(g + 8, 2 * t, g + 8, 2 * t + 1),
        pair(g, 2 * t + 8, g, 2 * t + 9), pair(g + 8, 2 * t + 8, g + 8, 2 * t + 9),
        pair(g, 2 * t, g, 2 * t + 1), pair(g, 2 * t + 8, g, 2 * t + 9),
        pair(g + 8, 2 * t, g + 8, 2 * t + 1), pair(g + 8, 2 * t + 8, g + 8, 2 * t + 9),
        pair(2 * t, g, 2 * t + 1, g), pair(2 * t + 8, g, 2 * t + 9, g),
        pair(2 * t, g + 8, 2 * t + 1, g + 8), pair(2 * t + 8, g + 8, 2 * t + 9, g + 8)};
    for (int i = 0; i < 4; ++i) wrong += (a[i] != want[i]) + (k[i] != want[4 + i]) + (v[i] != want[8 + i]);
  });
  return wrong;
}
"""


def test_emulated_ldmatrix_gives_the_mma_fragments(tmp_path):
    """The emulated ldmatrix x4 (and .trans), addressed as the flash kernel addresses it, yields the mma.sync
    m16n8k16 operand fragments built directly from the PTX ISA's layouts."""
    import ctypes
    import shutil
    import subprocess

    from emulation_helpers import EMULATION

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) on PATH")
    cpp, lib = tmp_path / "ldmatrix.cpp", tmp_path / "ldmatrix.so"
    cpp.write_text(f'#include "{EMULATION}"\n{_LDMATRIX_CHECK}')
    result = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread", str(cpp), "-o", str(lib)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ctypes.CDLL(str(lib)).check() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernel_matches_eager(name, dtype, tmp_path):
    """On the GPU, through the emitted file's binding: fp32 within the strict rule, bf16 (tensor cores where the head
    dim allows) within 2e-2 of the float64 reference."""
    from kernelfuse.codegen import generate
    from kernelfuse.emit.module import load_kernels

    model, inputs, graph, plan = _planned(name, dtype)
    step = plan.attention[0]
    kernels = load_kernels(generate(plan), f"attention_{name}_{str(dtype)[6:]}")
    model = model.cuda()
    with torch.no_grad():
        env = _values(graph, model, [t.cuda() for t in inputs])
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

    model, inputs, graph, plan = _planned(name, torch.bfloat16)
    step: AttnStep = plan.attention[0]
    assert uses_tensor_cores(step) and step.dims[5] in (40, 72)
    kernels = load_kernels(generate(plan), f"attention_padded_{name}")
    model, inputs = model.cuda(), [t.cuda() for t in inputs]
    with torch.no_grad():
        env = _values(graph, model, inputs)
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


@pytest.mark.parametrize("name", sorted(n for n in CASES if "relu" not in n))
def test_library_variant_forward_matches_eager(name):
    """The `-sdpa` variant's emitted forward (one torch SDPA call on the same views, its result laid out as the
    step's output, NaN rows where the hand-written mask empties a row) run on the CPU against the model."""
    import types

    from kernelfuse.emit.calltext import call_text
    from kernelfuse.emit.forward import forward_source

    model, inputs, graph, _ = _planned(name)
    plan = make_plan(graph, PlanOptions(attention="library"))
    assert plan.variant.endswith("-sdpa") and [a.impl for a in plan.attention] == ["library"]
    assert not plan.generated and not plan.fused, plan.summary()  # no kernel of ours: the forward runs on the CPU
    call = call_text(plan.graph.call_spec, str(inspect.signature(model.forward))[1:-1])
    namespace: dict = {"torch": torch}
    exec(forward_source(plan, call, has_kernels=False, guarded=False), namespace)  # noqa: S102 - emitted code
    for fn in [v for v in namespace.values() if isinstance(v, types.FunctionType)]:
        setattr(model, fn.__name__, types.MethodType(fn, model))
    with torch.no_grad():
        expected, got = Fn.forward(model, *inputs), model.forward(*inputs)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


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
    *_, graph, _ = _planned(name, dtype)
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
              _bool_mask(1, 2, 9, 9, empty_row=False), _bool_mask(1, 2, 9, 9, empty_row=False),
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
        env = _values(graph, Fn(fn), inputs)
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
        env = _values(graph, Fn(_shifted_windows), inputs)
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
    model, inputs, graph, plan = _planned("sdpa_d32", dtype)
    step: AttnStep = plan.attention[0]
    inputs[1][0, 1, 5, 3] = float("nan")  # batch 0, head 1: every query reads key 5
    with torch.no_grad():
        env = _values(graph, model, inputs)
    args = [env[i.ref.name] for i in step.inputs]
    got = getattr(emulated(plan, tmp_path).kernels, step.kernel)(*args)
    reference = attention_reference(step, *args, None)
    assert got[0, 1].isnan().all() and reference[0, 1].isnan().all() and env[step.out][0, 1].isnan().all()
    assert not got[1].isnan().any() and not got[0, 0].isnan().any()
