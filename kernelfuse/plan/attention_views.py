"""How an attention step (kernelfuse.plan.ir.AttnStep) sees its inputs, and what it computes: the (batch, heads,
rows, cols) views the kernel reads through strides (kernelfuse.codegen.attention), and the float64 reference the
plan interpreter and the tests compare the kernel with."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernelfuse.capture import TensorMeta
from kernelfuse.plan.ir import AttnInput, AttnStep


def logical_view(t: torch.Tensor, inp: AttnInput, batch: int) -> torch.Tensor:
    """The (batch, heads, rows, cols) view of an input's value: Kᵀ swapped back, a merged batch split into
    (batch, heads). Works on meta tensors (the kernel's strides) and real ones (the interpreter's values)."""
    if inp.swap:
        t = t.transpose(-2, -1)
    return t.unflatten(0, (batch, t.shape[0] // batch)) if t.dim() == 3 else t


def mask_view(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The mask broadcast to (batch, heads, S, L) (stride 0 along broadcast dims)."""
    b, h, _, s, length, _ = dims
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t.expand(b, h, s, length)


def window_view(t: torch.Tensor, dims: tuple[int, ...], count: int) -> torch.Tensor:
    """A window mask (1, windows, heads or 1, S or 1, L or 1) as (windows, heads, S, L): batch b reads window
    b % windows."""
    _, h, _, s, length, _ = dims
    return t[0].expand(count, h, s, length)


def causal_mask_matches(mask: torch.Tensor, kind: str, rows: int, cols: int) -> bool:
    """Whether `mask`, broadcast over (..., rows, cols) scores, masks exactly the keys after each query's position
    (top-left aligned, SDPA's is_causal: query i attends key j where j <= i): a "drop" mask (masked_fill's) True
    exactly there, a "keep" mask (SDPA's bool mask) True exactly elsewhere, an additive mask -inf there and 0
    elsewhere. One comparison on the mask's device and a sync for its verdict. Copied into the emitted file (its
    attention bindings check a mask so before running it as causal: kernelfuse.codegen.binding)."""
    keep = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
    if kind == "drop":
        expected = ~keep
    elif kind == "keep":
        expected = keep
    else:
        expected = torch.zeros(rows, cols, dtype=mask.dtype, device=mask.device).masked_fill(~keep, float("-inf"))
    return bool((mask == expected).all())


def strides_of(meta: TensorMeta, view: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, ...]:
    """The element strides `view` gives a tensor laid out as `meta` (computed on a meta tensor)."""
    fake = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return tuple(int(s) for s in view(fake).stride())


def attention_reference(step: AttnStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, windows: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in plain float64 math, returned in q's dtype: the interpreter's and the tests'
    reference (given float64 values, the float64 proof of the planner rule)."""
    b, h, hk, s, length, _ = step.dims
    qf = logical_view(q, step.q, b).double()
    kf = logical_view(k, step.k, b).double().repeat_interleave(h // hk, dim=1)
    vf = logical_view(v, step.v, b).double().repeat_interleave(h // hk, dim=1)
    scores = (qf @ kf.transpose(-2, -1)) * step.scale
    if step.softcap is not None:
        scores = torch.tanh(scores * step.softcap[0]) * step.softcap[1]
    if step.causal:
        scores = scores.masked_fill(torch.ones(s, length, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if mask is not None:
        m = mask_view(mask, step.dims)
        if step.mask_kind == "add":
            scores = scores + m.double()
        else:
            scores = scores.masked_fill(m if step.mask_kind == "drop" else ~m, -math.inf)
    if windows is not None:
        w = window_view(windows, step.dims, step.window_count).double()
        scores = scores + w.repeat(b // step.window_count, 1, 1, 1)
    if step.activation == "relu":
        return output_layout((torch.relu(scores) @ vf).to(q.dtype), step)
    probs = torch.softmax(scores, dim=-1)
    if not step.empty_nan:  # SDPA: a row whose every key is masked gives zeros; a NaN score still gives NaN
        probs = probs.masked_fill((scores == -math.inf).all(-1, keepdim=True), 0.0)
    return output_layout((probs @ vf).to(q.dtype), step)


def output_layout(out: torch.Tensor, step: AttnStep) -> torch.Tensor:
    """The (batch, heads, S, D) result laid out as the step's output node holds it."""
    result = torch.empty_strided(step.out_meta.shape, step.out_meta.stride, dtype=out.dtype, device=out.device)
    target = torch.as_strided(result, out.shape, step.out_strides)
    target.copy_(out)
    return result
