"""Same seed, same weights: check the candidate's parameters and buffers against the reference's by name and value.

The contract (DESIGN.md) is the same names, shapes and creation order, so `torch.manual_seed(s); ModelNew(...)`
draws the same weights as `Model(...)`. A mismatch is reported as such, not left to surface as an output mismatch.
What the check compares is what the seed produces: every parameter and persistent buffer of the reference must be
there with the same value. Names only the candidate has (a non-persistent constant, a prepacked copy) and the
reference's non-persistent buffers leave the weights equal: they are noted, and the output decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateCheck:
    """Differences between two models' named parameters and buffers (empty tuples: they match)."""

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    shape: tuple[str, ...] = ()
    value: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()  # of `missing`: the reference's non-persistent buffers (no seeded weights)

    @property
    def ok(self) -> bool:
        """Same seed, same weights: nothing seeded is missing, and shared names hold the same values."""
        return not (set(self.missing) - set(self.derived) or self.shape or self.value)

    def summary(self) -> str:
        """One line naming what differs, or "parameters and buffers match" (with the names only one side has)."""
        if self.ok:
            others = self.missing + self.extra
            if not others:
                return "parameters and buffers match"
            return (f"parameters and buffers match; names only one side has ({', '.join(others[:4])}"
                    f"{' ...' if len(others) > 4 else ''}) leave the weights equal: the output decides")
        parts = []
        for label, names in (("missing", self.missing), ("extra", self.extra), ("shape differs", self.shape),
                             ("value differs", self.value)):
            if names:
                shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                parts.append(f"{label}: {shown}")
        return "parameters/buffers differ from the reference's: " + "; ".join(parts)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    named.update({name: buf for name, buf in model.named_buffers() if buf is not None})
    return named


def compare_state(reference: torch.nn.Module, candidate: torch.nn.Module) -> StateCheck:
    """Compare parameters and buffers by name, shape and exact value (same seed must give the same bits)."""
    ref, new = _state(reference), _state(candidate)
    persistent = set(reference.state_dict())
    shape, value = [], []
    for name in ref.keys() & new.keys():
        a, b = ref[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            shape.append(f"{name} {list(b.shape)} vs {list(a.shape)}")
        elif not torch.equal(a.detach().cpu(), b.detach().cpu()):
            value.append(name)
    return StateCheck(
        missing=tuple(n for n in ref if n not in new),
        extra=tuple(n for n in new if n not in ref),
        shape=tuple(sorted(shape)),
        value=tuple(sorted(value)),
        derived=tuple(n for n in ref if n not in new and n not in persistent),
    )
