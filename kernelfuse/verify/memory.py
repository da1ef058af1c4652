"""How much memory the judge may take for its own copies, from what is free now, so the judge fits wherever the
model fits: the float64 reference goes to the device, to the host, or nowhere (then the trials compare with eager
under the policy's tolerance and the verdict says so), and the poison reserve never takes the model's room.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADROOM_BYTES = 512 << 20  # left free for the judge's own next allocations (comparisons, timing)
HEADROOM_FRACTION = 0.05  # ...and this fraction of the device: the allocator rounds and fragments
# A float64 run needs about twice the float32 run's peak memory (every tensor doubles); a little more for the
# temporaries an op makes in float64 only
FLOAT64_FACTOR = 2.2


@dataclass(frozen=True)
class Placement:
    """Where the float64 reference runs ("cuda", "cpu") or None, with why (a warning when not on the device)."""

    device: torch.device | None
    note: str | None


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes the judge may still allocate on `device`: the driver's free memory (within this process's share, where
    torch.cuda.set_per_process_memory_fraction set one) plus the blocks torch's caching allocator holds unused,
    less the headroom. None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)(index)
    free = min(free, max(0, int(fraction * total) - reserved))
    cached = reserved - torch.cuda.memory_allocated(index)
    return max(0, free + cached - HEADROOM_BYTES - int(HEADROOM_FRACTION * total))


def host_free_bytes() -> int | None:
    """MemAvailable from /proc/meminfo less the headroom (None where the system does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return max(0, int(line.split()[1]) * 1024 - HEADROOM_BYTES)
    except OSError:
        return None
    return None


def place_float64(need_bytes: int, device: torch.device) -> Placement:
    """The device when `need_bytes` fits there, else the host when it fits there, else nowhere."""
    free = device_free_bytes(device)
    if free is None or need_bytes <= free:
        return Placement(device, None)
    host = host_free_bytes()
    gib = need_bytes / 2**30
    if host is not None and need_bytes <= host:
        return Placement(torch.device("cpu"), f"the float64 reference needs about {gib:.1f} GiB, {free / 2**30:.1f} "
                         "GiB of device memory are free: it runs on the CPU (slower, same rule)")
    return Placement(None, f"the float64 reference needs about {gib:.1f} GiB: neither the device "
                     f"({free / 2**30:.1f} GiB free) nor the host ({(host or 0) / 2**30:.1f} GiB) holds it; the "
                     "trials compare with eager under the policy's tolerance only")


def float64_need(state_bytes: int, peak_bytes: int) -> int:
    """Bytes a float64 copy of the model and one float64 forward take, from the float32 model's state and the
    peak memory of one float32 forward (inputs, activations and outputs)."""
    return int(FLOAT64_FACTOR * (state_bytes + peak_bytes))


def poison_budget(wanted: int, device: torch.device) -> int:
    """The poison reserve: what the judge wants, cut to what is free (poisoning less beats running out)."""
    free = device_free_bytes(device)
    return wanted if free is None else max(0, min(wanted, free))
