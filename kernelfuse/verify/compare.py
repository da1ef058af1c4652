"""Compare a candidate's outputs with the reference's: structure, shape, dtype, NaN/Inf positions, tolerance.

Works on CPU and GPU tensors alike, so the rules are tested on the CPU. Errors are measured in float32 (float64
for float64 outputs) over the positions where both sides are finite; NaN and Inf must sit where the reference has
them, which is also how an output left unwritten over NaN-poisoned memory shows up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CHUNK = 1 << 24  # elements per reduction step: bounds the temporaries for GB-sized outputs


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one output structure with the reference's.

    `max_rel` is |out - ref| / max(|ref|, atol), so elements near zero do not inflate it. `n_unwritten` counts
    elements that are NaN where the reference is finite: the signature of memory the candidate never wrote when
    free memory was filled with NaN beforehand.
    """

    ok: bool
    reason: str | None
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    n_bad: int = 0
    n_unwritten: int = 0
    numel: int = 0


def flatten_outputs(out: Any) -> list[Any]:
    """Leaves of a (nested) tuple/list/dict output, in order; a single tensor is a one-leaf list."""
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in flatten_outputs(item)]
    if isinstance(out, dict):
        return [leaf for key in sorted(out, key=str) for leaf in flatten_outputs(out[key])]
    return [out]


def describe(out: Any) -> str:
    """`float32[1024, 8192]`-style summary of an output structure, for reasons and reports."""
    leaves = flatten_outputs(out)
    parts = [_describe_leaf(leaf) for leaf in leaves]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}"
    return type(leaf).__name__


def compare_outputs(ref: Any, out: Any, atol: float, rtol: float) -> Comparison:
    """Check `out` against `ref` like `torch.allclose(out, ref, atol, rtol)` plus shape, dtype and NaN/Inf rules.

    Returns the first failure as `reason` and error statistics over all leaves.
    """
    ref_leaves, out_leaves = flatten_outputs(ref), flatten_outputs(out)
    if len(ref_leaves) != len(out_leaves):
        return Comparison(False, f"output structure differs: expected {describe(ref)}, got {describe(out)}")
    stats = [_compare_leaf(r, o, atol, rtol, i if len(ref_leaves) > 1 else None) for i, (r, o) in
             enumerate(zip(ref_leaves, out_leaves, strict=True))]
    reason = next((s.reason for s in stats if s.reason), None)
    return Comparison(
        ok=reason is None,
        reason=reason,
        max_abs=max((s.max_abs for s in stats), default=0.0),
        max_rel=max((s.max_rel for s in stats), default=0.0),
        mean_abs=(sum(s.mean_abs * s.numel for s in stats) / max(1, sum(s.numel for s in stats))),
        n_bad=sum(s.n_bad for s in stats),
        n_unwritten=sum(s.n_unwritten for s in stats),
        numel=sum(s.numel for s in stats),
    )


def _compare_leaf(ref: Any, out: Any, atol: float, rtol: float, index: int | None) -> Comparison:
    where = "" if index is None else f"output {index}: "
    if not isinstance(ref, torch.Tensor):
        if isinstance(out, torch.Tensor) or out != ref:
            return Comparison(False, f"{where}expected {ref!r}, got {_describe_leaf(out)} {_short(out)}")
        return Comparison(True, None)
    if not isinstance(out, torch.Tensor):
        return Comparison(False, f"{where}expected a tensor {_describe_leaf(ref)}, got {type(out).__name__}")
    if out.shape != ref.shape:
        return Comparison(False, f"{where}shape {list(out.shape)} != expected {list(ref.shape)}")
    if out.dtype != ref.dtype:
        return Comparison(False, f"{where}dtype {out.dtype} != expected {ref.dtype}")
    if out.device != ref.device:
        out = out.to(ref.device)
    if ref.is_complex():
        ref, out = torch.view_as_real(ref), torch.view_as_real(out)
    if not (ref.is_floating_point()):
        n_bad = int((out != ref).sum())
        reason = f"{where}{n_bad} of {ref.numel()} elements differ (exact match required for {ref.dtype})"
        return Comparison(n_bad == 0, None if n_bad == 0 else reason, float(n_bad > 0), float(n_bad > 0), 0.0,
                          n_bad, 0, ref.numel())
    return _compare_float(ref, out, atol, rtol, where)


def _compare_float(ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float, where: str) -> Comparison:
    work = torch.float64 if ref.dtype == torch.float64 else torch.float32
    r_flat, o_flat = ref.detach().reshape(-1), out.detach().reshape(-1)
    max_abs = max_rel = total_abs = 0.0
    n_bad = n_unwritten = n_nan_pos = n_inf_pos = 0
    for start in range(0, r_flat.numel(), CHUNK):
        r = r_flat[start:start + CHUNK].to(work)
        o = o_flat[start:start + CHUNK].to(work)
        r_fin, o_fin = torch.isfinite(r), torch.isfinite(o)
        n_unwritten += int((torch.isnan(o) & r_fin).sum())
        n_nan_pos += int((torch.isnan(o) != torch.isnan(r)).sum())
        inf_differs = (torch.isinf(r) | torch.isinf(o)) & (o != r) & ~torch.isnan(o) & ~torch.isnan(r)
        n_inf_pos += int(inf_differs.sum())
        both = r_fin & o_fin
        diff = torch.where(both, (o - r).abs(), torch.zeros((), dtype=work, device=r.device))
        bound = atol + rtol * r.abs()
        n_bad += int((diff > torch.where(both, bound, torch.full_like(bound, float("inf")))).sum())
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / r.abs().clamp_min(atol)).max()))
            total_abs += float(diff.sum())
    numel = r_flat.numel()
    mean_abs = total_abs / max(1, numel)
    reason = None
    if n_nan_pos:
        reason = f"{where}NaN positions differ from the reference's at {n_nan_pos} of {numel} elements"
        if n_unwritten:
            reason += f" ({n_unwritten} NaN where the reference is finite)"
    elif n_inf_pos:
        reason = f"{where}Inf positions or signs differ from the reference's at {n_inf_pos} of {numel} elements"
    elif n_bad:
        reason = (f"{where}{n_bad} of {numel} elements outside atol={atol:g}, rtol={rtol:g} "
                  f"(max abs error {max_abs:.3g}, max rel error {max_rel:.3g})")
    return Comparison(reason is None, reason, max_abs, max_rel, mean_abs, n_bad, n_unwritten, numel)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
