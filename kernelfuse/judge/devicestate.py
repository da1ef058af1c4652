"""Device state a forward call must leave as it found it: precision flags, the current stream, L2 persistence.

The import-time check (worker.py) sees flags set when the candidate is imported; a candidate can also set them
inside forward, after the judge looked. Precision flags left lowered change every later float32 call; a different
current stream moves the judge's timing events off the stream the work runs on; an L2 persisting-cache limit or an
access-policy window on the stream keeps data in L2 across the judge's flush. Captured before a call and compared
after it (after every correctness call and every timed call).

The L2 settings are read through the CUDA runtime already loaded by torch (ctypes); where it cannot be found they
read "n/a" and are not compared.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from kernelfuse.verify import NumericsFlags

CUDA_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
CUDA_STREAM_ATTR_ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow
CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


@dataclass(frozen=True)
class DeviceState:
    """Flags, current stream handle, persisting-L2 limit (bytes) and the stream's access-policy window bytes."""

    flags: NumericsFlags
    stream: int | None
    l2_persisting: str
    access_window: str

    @classmethod
    def capture(cls, device: torch.device) -> DeviceState:
        if device.type != "cuda":
            return cls(NumericsFlags.capture(), None, "n/a", "n/a")
        stream = torch.cuda.current_stream(device).cuda_stream
        return cls(NumericsFlags.capture(), stream, _l2_limit(), _access_window(stream))

    def changes_from(self, before: DeviceState, strict: bool) -> list[str]:
        """What changed that the judge does not accept: lowered precision (strict policy), stream, L2 settings."""
        changes = self.flags.lowers_precision_from(before.flags) if strict else []
        if self.stream != before.stream:
            changes.append(f"current CUDA stream: {before.stream:#x} -> {self.stream:#x}" if before.stream is not None
                           and self.stream is not None else "current CUDA stream changed")
        for name, old, new in (("persisting L2 cache limit", before.l2_persisting, self.l2_persisting),
                               ("stream access-policy window bytes", before.access_window, self.access_window)):
            if "n/a" not in (old, new) and old != new:
                changes.append(f"{name}: {old} -> {new}")
        return changes


@lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL | None:
    for name in CUDART_NAMES:
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _l2_limit() -> str:
    lib = _cudart()
    if lib is None:
        return "n/a"
    value = ctypes.c_size_t(0)
    try:
        err = lib.cudaDeviceGetLimit(ctypes.byref(value), ctypes.c_int(CUDA_LIMIT_PERSISTING_L2))
    except AttributeError:
        return "n/a"
    return str(value.value) if err == 0 else "n/a"


def _access_window(stream: int) -> str:
    """num_bytes of the stream's access-policy window (the union starts with base_ptr, then num_bytes)."""
    lib = _cudart()
    if lib is None:
        return "n/a"
    buf = (ctypes.c_uint64 * 16)()
    try:
        err = lib.cudaStreamGetAttribute(ctypes.c_void_p(stream), ctypes.c_int(CUDA_STREAM_ATTR_ACCESS_POLICY_WINDOW),
                                         ctypes.byref(buf))
    except AttributeError:
        return "n/a"
    return str(int(buf[1])) if err == 0 else "n/a"
