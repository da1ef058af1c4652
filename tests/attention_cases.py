"""Attention test cases shared by tests/test_attention_plan.py, tests/test_attention_kernels.py and
tests/test_attention_flash.py: small models around SDPA and its hand-written form (odd sizes, masks, grouped-query
heads, head dims 16-256), captured and planned in a dtype, and every node's value computed with the ATen ops
themselves."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernelfuse.capture import capture_module
from kernelfuse.plan import make_plan
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


def sdpa_fn(**kw):
    return lambda m, q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def handwritten(mask: str, heads: int):
    """minGPT's attention: one projection split into q, k, v, heads moved forward, the result moved back."""
    def fn(m, x):
        b, t, c = x.shape
        q, k, v = m.proj(x).split(c, dim=2)
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if mask == "softcap":  # Gemma 2's soft cap (cap 2: 1 / cap exact in fp32, as the float64 proof needs; the
            att = torch.tanh(att / 2.0) * 2.0 + m.tril[:, :, :t, :t]  # tanh bends these scores), an additive mask
        if mask in ("causal", "relu"):
            att = att.masked_fill(m.tril[:, :, :t, :t] == 0, float("-inf"))
        elif mask == "add":
            att = att + m.tril[:, :, :t, :t]
        att = F.relu(att) if mask == "relu" else F.softmax(att, dim=-1)
        y = att @ v
        return y.transpose(1, 2).contiguous().view(b, t, c)
    return fn


def bmm3d(m, q, k, v, mask):
    """Attention over a merged (batch * heads) dim with torch.bmm and a bool mask that empties some rows."""
    att = torch.bmm(q, k.transpose(1, 2)) * 0.3
    att = att.masked_fill(~mask, float("-inf"))  # row 1 of every batch attends to nothing: NaN, as eager gives
    return torch.bmm(torch.softmax(att, -1), v)


def kv_cache(m, q, k, v):
    """transformers' cache on a first call: an empty tensor concatenated with the new keys and values, the heads
    moved forward by transposes (a copy each, read past by the kernel once the empty operand is gone)."""
    k, v = (torch.cat([t.new_zeros(0), t.transpose(1, 2)], -2) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def repeat_kv(m, q, k, v):
    """transformers' grouped-query attention through SDPA without enable_gqa: each key and value head repeated for
    its queries (an expand and a copy each), which the kernel reads past as grouped-query heads."""
    b, hk, length, d = k.shape
    rep = q.shape[1] // hk
    k, v = (t[:, :, None, :, :].expand(b, hk, rep, length, d).reshape(b, hk * rep, length, d) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager_gqa(softcap: bool):
    """transformers' eager attention (Llama, Gemma 2): keys and values repeated per query head (repeat_kv),
    `q @ kᵀ` scaled, Gemma 2's soft cap if asked, an additive mask, softmax, `@ v`."""
    def fn(m, q, k, v, mask):
        b, hk, length, d = k.shape
        rep = q.shape[1] // hk
        k, v = (t[:, :, None, :, :].expand(b, hk, rep, length, d).reshape(b, hk * rep, length, d) for t in (k, v))
        att = torch.matmul(q, k.transpose(2, 3)) * d**-0.5
        if softcap:
            att = torch.tanh(att / 2.0) * 2.0
        return torch.matmul(torch.softmax(att + mask, dim=-1), v)
    return fn


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def bool_mask(*shape: int, empty_row: bool = True) -> torch.Tensor:
    torch.manual_seed(3)
    m = torch.rand(*shape) > 0.3
    if empty_row:
        m[..., 1, :] = False  # SDPA: a row that attends to nothing gives zeros
    return m


CASES = {
    # name: (forward, inputs, expected attention kind)
    "sdpa_d32": (sdpa_fn(), [randn(2, 3, 70, 32), randn(2, 3, 70, 32), randn(2, 3, 70, 32)], "sdpa"),
    "sdpa_causal_d64": (sdpa_fn(is_causal=True), [randn(1, 2, 67, 64), randn(1, 2, 67, 64), randn(1, 2, 67, 64)],
                        "sdpa"),
    "sdpa_causal_s150_l170_d32": (sdpa_fn(is_causal=True), [randn(1, 2, 150, 32), randn(1, 2, 170, 32),
                                                          randn(1, 2, 170, 32)], "sdpa"),  # several query tiles
    "sdpa_bool_mask_d40": (sdpa_fn(), [randn(2, 2, 19, 40), randn(2, 2, 77, 40), randn(2, 2, 77, 40),
                                     bool_mask(19, 77)], "sdpa"),
    "sdpa_add_mask_3d": (sdpa_fn(scale=0.2), [randn(3, 5, 48), randn(3, 70, 48), randn(3, 70, 48),
                                           randn(3, 5, 70)], "sdpa"),
    "sdpa_gqa_d128": (sdpa_fn(enable_gqa=True), [randn(1, 4, 66, 128), randn(1, 2, 66, 128),
                                               randn(1, 2, 66, 128)], "sdpa"),
    "sdpa_mqa_broadcast_d64": (sdpa_fn(is_causal=True), [randn(2, 4, 45, 64), randn(2, 1, 45, 64),
                                                       randn(2, 1, 45, 64)], "sdpa"),  # one k/v head broadcast
    "sdpa_strided_k_d32": (sdpa_fn(), [randn(1, 2, 33, 32), randn(1, 2, 32, 33).transpose(-2, -1),
                                     randn(1, 2, 33, 32)], "sdpa"),  # k not contiguous along d: no 16-byte loads
    "sdpa_d256": (sdpa_fn(is_causal=True), [randn(1, 1, 35, 256), randn(1, 1, 35, 256), randn(1, 1, 35, 256)],
                  "sdpa"),
    "sdpa_short_s2_d64": (sdpa_fn(), [randn(6, 3, 2, 64), randn(6, 3, 2, 64), randn(6, 3, 2, 64)],
                          "sdpa"),  # a few tokens a row (KernelBench's ViT): fp32 blocks of 1 warp, 16-key tiles
    "sdpa_repeat_kv_d32": (repeat_kv, [randn(2, 6, 40, 32), randn(2, 2, 40, 32), randn(2, 2, 40, 32)], "sdpa"),
    "sdpakv_cache_d64": (kv_cache, [randn(1, 2, 67, 64), randn(1, 67, 2, 64), randn(1, 67, 2, 64)], "sdpa"),
    "handwritten_causal_d96": (handwritten("causal", 2), [randn(2, 70, 192)], "hand-written"),
    "handwritten_add_d32": (handwritten("add", 3), [randn(1, 37, 96)], "hand-written"),
    "handwritten_gqa_d32": (eager_gqa(False), [randn(2, 6, 21, 32), randn(2, 2, 21, 32), randn(2, 2, 21, 32),
                                              randn(2, 1, 21, 21)], "hand-written"),
    "handwritten_gqa_softcap_d64": (eager_gqa(True), [randn(1, 4, 40, 64), randn(1, 1, 40, 64),
                                                      randn(1, 1, 40, 64), randn(1, 1, 40, 40)], "hand-written"),
    "handwritten_softcap_d32": (handwritten("softcap", 3), [randn(2, 37, 96)], "hand-written"),
    "handwritten_relu_d64": (handwritten("relu", 2), [randn(2, 67, 128)], "hand-written"),
    "bmm_bool_mask": (bmm3d, [randn(4, 9, 16), randn(4, 20, 16), randn(4, 20, 16), bool_mask(4, 9, 20)],
                      "hand-written"),
}


# Cases for the bf16 flash kernel's 128-query blocks only: the causal diagonal and ragged tails (S not a multiple of
# 128, L not of 64) over several query tiles at head dim 128
FLASH_CASES = {
    "sdpa_causal_s150_l170_d128": (sdpa_fn(is_causal=True), [randn(1, 1, 150, 128), randn(1, 1, 170, 128),
                                                           randn(1, 1, 170, 128)], "sdpa"),
}


# bf16 head dims that are odd multiples of 8 (24, 40, 72: the scores' last k16 step half zero pad): the flash kernel
# (q, k and v contiguous along d), and the first tensor-core kernel with k strided along d (its element-wise loads)
# or q strided (its 16-byte key and value loads); causal, bool and additive masks, a hand-written drop mask, ragged
# S and L over several tiles
PADDED_CASES = {
    "sdpa_causal_s150_l170_d40": (sdpa_fn(is_causal=True), [randn(1, 2, 150, 40), randn(1, 2, 170, 40),
                                                          randn(1, 2, 170, 40)], "sdpa"),
    "sdpa_causal_d72": (sdpa_fn(is_causal=True), [randn(1, 2, 67, 72), randn(1, 2, 67, 72), randn(1, 2, 67, 72)],
                        "sdpa"),
    "sdpa_add_mask_d72": (sdpa_fn(), [randn(2, 2, 37, 72), randn(2, 2, 77, 72), randn(2, 2, 77, 72),
                                    randn(37, 77)], "sdpa"),
    "sdpa_bool_mask_d24": (sdpa_fn(), [randn(1, 3, 33, 24), randn(1, 3, 50, 24), randn(1, 3, 50, 24),
                                     bool_mask(33, 50)], "sdpa"),
    "handwritten_causal_d40": (handwritten("causal", 2), [randn(2, 70, 80)], "hand-written"),
    "sdpa_strided_k_causal_d40": (sdpa_fn(is_causal=True), [randn(1, 2, 67, 40), randn(1, 2, 40, 67).transpose(-2, -1),
                                                          randn(1, 2, 67, 40)], "sdpa"),
    "sdpa_strided_q_bool_mask_d40": (sdpa_fn(), [randn(2, 2, 40, 19).transpose(-2, -1), randn(2, 2, 77, 40),
                                               randn(2, 2, 77, 40), bool_mask(19, 77)], "sdpa"),
    "sdpa_strided_q_causal_d72": (sdpa_fn(is_causal=True), [randn(1, 2, 72, 70).transpose(-2, -1),
                                                          randn(1, 2, 70, 72), randn(1, 2, 70, 72)], "sdpa"),
    "sdpa_strided_k_add_mask_d72": (sdpa_fn(), [randn(2, 2, 37, 72), randn(2, 2, 72, 77).transpose(-2, -1),
                                              randn(2, 2, 77, 72), randn(37, 77)], "sdpa"),
    "sdpa_strided_q_d24": (sdpa_fn(), [randn(2, 2, 24, 33).transpose(-2, -1), randn(2, 2, 33, 24),
                                     randn(2, 2, 33, 24)], "sdpa"),
}


# The bf16 flash kernel's tilings (FlashConfig): head dim 96 causal over several query tiles and ragged key tiles (170
# keys: 64 + 64 + 42, or five of 32 and 10), beside PADDED_CASES' head dim 40 with a causal and a bool mask
TILING_CASES = {
    "sdpa_causal_s150_l170_d96": (sdpa_fn(is_causal=True), [randn(1, 1, 150, 96), randn(1, 1, 170, 96),
                                                          randn(1, 1, 170, 96)], "sdpa"),
}


def planned(name: str, dtype: torch.dtype = torch.float32, values: torch.dtype | None = None):
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
