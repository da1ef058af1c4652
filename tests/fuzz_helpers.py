"""Shared helpers for the differential fuzzer's tests: BATCH, the size of the fixed-seed batch (the vocabulary's
coverage is checked over it, and it runs through the CPU checks), and `_write`, a model spec rendered as a problem
file."""

from __future__ import annotations

from pathlib import Path

from kernelfuse.fuzz.generate import ModelSpec, render

BATCH = 300


def _write(tmp_path: Path, spec: ModelSpec) -> Path:
    path = tmp_path / f"{spec.name}.py"
    path.write_text(render(spec))
    return path
