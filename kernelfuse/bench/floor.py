"""The floor estimate: no version runs much faster than max(FLOPs / peak rate, bytes / bandwidth).

FLOPs are counted by torch's FlopCounterMode (matrix products and convolutions; pointwise work counts as bytes).
Bytes are the fewest a version must move: inputs, parameters and buffers read once, outputs written once. The two
ceilings are measured on the device at hand (a large device-to-device copy; a large matrix product in the precision
the policy allows), as METHOD.md says, rather than taken from a datasheet. A candidate faster than the floor did not
do the work, or cached it: the judge warns, and well below it gives the verdict "implausible".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kernelfuse.bench.timer import Timer
from kernelfuse.verify.compare import flatten_outputs

SUSPICIOUS_FRACTION = 0.8  # runtime below this fraction of the floor is flagged


@dataclass(frozen=True)
class Ceilings:
    """Measured rates: FLOP/s of a large matrix product in `flop_kind`, bytes/s of a device copy (read + write)."""

    flops_per_s: float
    bytes_per_s: float
    flop_kind: str


@dataclass(frozen=True)
class Floor:
    """FLOPs and bytes of the problem, the two times they imply and the larger of them (the floor)."""

    flops: int
    bytes: int
    compute_ms: float
    memory_ms: float
    ceilings: Ceilings

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ms": self.ms, "bound": self.bound}

    def describe(self) -> str:
        return (f"{self.ms:.3f} ms ({self.bound}-bound: {self.flops / 1e9:.1f} GFLOP at "
                f"{self.ceilings.flops_per_s / 1e12:.0f} TFLOP/s {self.ceilings.flop_kind} = {self.compute_ms:.3f} ms; "
                f"{self.bytes / 1e9:.3f} GB at {self.ceilings.bytes_per_s / 1e12:.2f} TB/s = {self.memory_ms:.3f} ms)")


def _matvec_flops(*shapes: Any, out_shape: Any = None, **_: Any) -> int:
    """mv(A, x) and addmv(b, A, x): 2 * rows * cols (torch's counter has no formula for them)."""
    matrix = next(s for s in shapes if s is not None and len(s) == 2)
    return 2 * matrix[0] * matrix[1]


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of `fn`, as torch's FlopCounterMode counts them, matrix-vector products included (0 where
    it cannot)."""
    from torch.utils.flop_counter import FlopCounterMode

    matvec = {torch.ops.aten.mv: _matvec_flops, torch.ops.aten.addmv: _matvec_flops}
    try:
        with FlopCounterMode(display=False, custom_mapping=matvec) as counter:
            fn()
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op the counter cannot follow: the floor falls back to bytes
        return 0


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among `values` (nested tuples/lists/dicts allowed)."""
    return sum(t.numel() * t.element_size() for t in flatten_outputs(values) if isinstance(t, torch.Tensor))


def min_bytes(model: torch.nn.Module, inputs: list[Any], outputs: Any) -> int:
    """Inputs, parameters and buffers read once plus outputs written once."""
    state = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return tensor_bytes(list(inputs)) + tensor_bytes(state) + tensor_bytes(outputs)


def measure_ceilings(timer: Timer, flop_kind: str, size: int = 8192, copy_bytes: int = 1 << 30) -> Ceilings:
    """Measure copy bandwidth and matrix-product rate on the timer's (CUDA) device.

    `flop_kind` is "fp32" (true fp32), "tf32" or "bf16". TF32 flags are set for the product and restored. The fp32
    rate is the faster of cuBLAS's SGEMM and a third of its TF32 rate (fp32_accurate_rate).
    """
    device = timer.device
    copy_ms = _copy_ms(timer, copy_bytes)
    dtype = torch.bfloat16 if flop_kind == "bf16" else torch.float32
    a = torch.rand(size, size, device=device, dtype=dtype)
    b = torch.rand(size, size, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32

    def rate(tf32: bool) -> float:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        return 2.0 * size**3 / (timer.median_ms(lambda: torch.mm(a, b)) * 1e-3)

    try:
        flops, kind = rate(flop_kind == "tf32"), flop_kind
        if flop_kind == "fp32":
            flops, kind = fp32_accurate_rate(flops, rate(True))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return Ceilings(flops, 2.0 * copy_bytes / (copy_ms * 1e-3), kind)


def fp32_accurate_rate(sgemm_flops: float, tf32_flops: float) -> tuple[float, str]:
    """The fastest fp32-accurate product rate and its name: cuBLAS's SGEMM (the FMA pipe), or a third of the TF32
    tensor-core rate, which three TF32 products of split operands (3xTF32: kernelfuse's own GEMM, CUTLASS's
    fast-accurate mode) reach at fp32 accuracy. Without it a correct 3xTF32 kernel reads as faster than the floor
    (stop 45: level-2 GEMMs at 0.75x an SGEMM floor) and, well below, as implausible."""
    return (tf32_flops / 3, "fp32 (3xTF32)") if tf32_flops / 3 > sgemm_flops else (sgemm_flops, "fp32")


def _copy_ms(timer: Timer, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).fill_(1)
    dst = torch.empty_like(src)
    return timer.median_ms(lambda: dst.copy_(src))


def floor_estimate(flops: int, nbytes: int, ceilings: Ceilings) -> Floor:
    """The floor for `flops` and `nbytes` under `ceilings`."""
    compute_ms = 1e3 * flops / ceilings.flops_per_s if ceilings.flops_per_s > 0 else 0.0
    memory_ms = 1e3 * nbytes / ceilings.bytes_per_s if ceilings.bytes_per_s > 0 else 0.0
    return Floor(flops, nbytes, compute_ms, memory_ms, ceilings)


def capped_by(floor: Floor, achieved_ms: float) -> Floor:
    """The floor no higher than a time a baseline (eager, torch.compile) achieved: a baseline that ran faster than
    the floor proves the ceilings were measured low (clocks, a cold measurement), so they are raised to the rate it
    reached. Without this an honest candidate as fast as eager could read as 'faster than physics'."""
    if achieved_ms <= 0 or floor.ms <= achieved_ms:
        return floor
    scale = floor.ms / achieved_ms
    c = floor.ceilings
    return floor_estimate(floor.flops, floor.bytes, Ceilings(c.flops_per_s * scale, c.bytes_per_s * scale,
                                                             c.flop_kind))


def below_floor(runtime_ms: float, floor: Floor, fraction: float = SUSPICIOUS_FRACTION,
                label: str = "suspiciously fast") -> str | None:
    """A sentence when `runtime_ms` is below `fraction` x the floor; None otherwise (and for fraction <= 0).

    The judge warns below SUSPICIOUS_FRACTION and gives the verdict "implausible" below its `--implausible-margin`.
    """
    if fraction > 0 and floor.ms > 0 and runtime_ms < fraction * floor.ms:
        return (f"{label}: {runtime_ms:.3f} ms is {floor.ms / runtime_ms:.1f}x faster than the floor "
                f"estimate {floor.describe()}: the work may be skipped, cached or done outside the timed region")
    return None
