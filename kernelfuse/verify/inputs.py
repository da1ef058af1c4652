"""Inputs: each model gets its own copy, and the copies are checked afterwards.

A candidate that zeroes or rewrites its inputs (to make later calls trivial, or to hide its answer) is caught by
comparing its copy, bit for bit, with what the reference's copy looked like after the reference ran: unchanged when
the reference leaves its inputs alone, changed the same way when the reference works in place.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kernelfuse.verify.compare import flatten_outputs


def inputs_to(inputs: list[Any], device: torch.device) -> list[Any]:
    """A private copy of `inputs` on `device`: tensors copied (never aliased), other values deep-copied."""
    return [x.detach().to(device, copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in inputs]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN with the same payload), shape and dtype included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.dtype == torch.bool or a.numel() == 0:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def changed_inputs(expected: list[Any], actual: list[Any]) -> list[int]:
    """Indices of tensor inputs whose contents differ bitwise from `expected`."""
    return [
        i for i, (e, a) in enumerate(zip(expected, actual, strict=False))
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and not same_bits(e, a)
    ]


def fingerprint(out: Any) -> tuple:
    """A cheap content fingerprint of an output (shape and float64 sums per leaf) to spot a stale, cached answer."""
    parts = []
    for leaf in flatten_outputs(out):
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            flat = leaf.detach().reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)]
            total, sampled = flat.sum(dtype=torch.float64), sample.sum(dtype=torch.float64)
            parts.append((tuple(leaf.shape), float(total), float(sampled)))
        else:
            parts.append((repr(leaf)[:64],))
    return tuple(parts)
