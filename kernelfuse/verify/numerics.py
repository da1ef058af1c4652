"""Global numerics flags (TF32, reduced-precision reductions): captured, compared and pinned.

A candidate that flips `torch.backends.cuda.matmul.allow_tf32` at import lowers the reference's precision too, so a
naive judge sees two equally wrong answers agree. The judge captures the flags before importing the candidate, runs
the reference under them, runs the candidate under the flags it set, and reports what it changed.

Reads go through both the legacy and the new (`fp32_precision`) APIs; a read that raises (torch refuses a mix of the
two APIs) is recorded as "error", which itself counts as a change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_B = torch.backends


def _getters() -> dict[str, Callable[[], object]]:
    return {
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.backends.cuda.matmul.allow_tf32": lambda: _B.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: _B.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: _B.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: _B.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.fp32_precision": lambda: _B.fp32_precision,
        "torch.backends.cuda.matmul.fp32_precision": lambda: _B.cuda.matmul.fp32_precision,
        "torch.backends.cudnn.conv.fp32_precision": lambda: _B.cudnn.conv.fp32_precision,
    }


def _read(getter: Callable[[], object]) -> str:
    try:
        return str(getter())
    except AttributeError:
        return "n/a"
    except Exception:  # noqa: BLE001 - torch raises RuntimeError on a mix of legacy and new APIs
        return "error"


@dataclass(frozen=True)
class NumericsFlags:
    """The global flags that change float32 results, as strings, in a fixed order."""

    values: tuple[tuple[str, str], ...]

    @classmethod
    def capture(cls) -> NumericsFlags:
        return cls(tuple((name, _read(getter)) for name, getter in _getters().items()))

    def get(self, name: str) -> str:
        return dict(self.values).get(name, "n/a")

    def effective(self) -> dict[str, str]:
        """What the flags mean for float32 work: TF32 on or off per library, reduced-precision reductions.

        Raw strings differ between equivalent states ("none" vs "ieee"), so comparisons use these.
        """
        prec = self.get("torch.get_float32_matmul_precision()")
        cudnn = self.get("torch.backends.cudnn.allow_tf32")
        return {
            "matmul TF32": "error" if prec == "error" else str(prec != "highest"),
            "cuDNN TF32": cudnn,
            "fp16 reduced-precision reduction":
                self.get("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
            "bf16 reduced-precision reduction":
                self.get("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
        }

    def changes_from(self, before: NumericsFlags) -> list[str]:
        """`what: old -> new` for each effective setting that differs from `before`."""
        old, new = before.effective(), self.effective()
        return [f"{name}: {old[name]} -> {value}" for name, value in new.items() if old[name] != value]

    def lowers_precision_from(self, before: NumericsFlags) -> list[str]:
        """The changes that let float32 work run in lower precision (or make torch refuse to say)."""
        return [change for change in self.changes_from(before) if change.endswith(("True", "error"))]

    def apply(self) -> None:
        """Set the flags to these values: the new API first, then the legacy setters, which keep both in step."""
        v = dict(self.values)
        _try_set(lambda: setattr(_B, "fp32_precision", v["torch.backends.fp32_precision"]),
                 v["torch.backends.fp32_precision"])
        _try_set(lambda: setattr(_B.cuda.matmul, "fp32_precision", v["torch.backends.cuda.matmul.fp32_precision"]),
                 v["torch.backends.cuda.matmul.fp32_precision"])
        _try_set(lambda: setattr(_B.cudnn.conv, "fp32_precision", v["torch.backends.cudnn.conv.fp32_precision"]),
                 v["torch.backends.cudnn.conv.fp32_precision"])
        _try_set(lambda: torch.set_float32_matmul_precision(v["torch.get_float32_matmul_precision()"]),
                 v["torch.get_float32_matmul_precision()"])
        _try_set(lambda: setattr(_B.cudnn, "allow_tf32", v["torch.backends.cudnn.allow_tf32"] == "True"),
                 v["torch.backends.cudnn.allow_tf32"])
        for name in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
            value = v[f"torch.backends.cuda.matmul.{name}"]
            _try_set(lambda name=name, value=value: setattr(_B.cuda.matmul, name, value == "True"), value)


def _try_set(setter: Callable[[], None], value: str) -> None:
    if value in ("n/a", "error"):
        return
    try:
        setter()
    except Exception:  # noqa: BLE001 - an API missing in this torch version: nothing to restore
        pass


@contextmanager
def flags_applied(flags: NumericsFlags) -> Iterator[None]:
    """Run a block under `flags`, then put back whatever was set before."""
    saved = NumericsFlags.capture()
    flags.apply()
    try:
        yield
    finally:
        saved.apply()


def tf32_flags(base: NumericsFlags) -> NumericsFlags:
    """`base` with TF32 allowed for matrix products and convolutions (the tf32 policy's eager baseline)."""
    return _with_tf32(base, True)


def no_tf32_flags(base: NumericsFlags) -> NumericsFlags:
    """`base` with TF32 off everywhere: eager in true fp32, to find out whether the reference used TF32."""
    return _with_tf32(base, False)


def _with_tf32(base: NumericsFlags, on: bool) -> NumericsFlags:
    v = dict(base.values)
    v["torch.get_float32_matmul_precision()"] = "high" if on else "highest"
    v["torch.backends.cuda.matmul.allow_tf32"] = str(on)
    v["torch.backends.cudnn.allow_tf32"] = str(on)
    for name in ("torch.backends.cuda.matmul.fp32_precision", "torch.backends.cudnn.conv.fp32_precision"):
        if v[name] not in ("n/a", "error"):
            v[name] = "tf32" if on else "ieee"
    return NumericsFlags(tuple(v.items()))
