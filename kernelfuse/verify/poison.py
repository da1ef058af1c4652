"""Fill the CUDA caching allocator's free memory with NaN before a model runs.

A candidate that returns `torch.empty(...)` without writing every element, or that hands back memory the reference
freed (which still holds the right answer), passes a naive judge. Poisoning every free block of the caching
allocator (and a reserve at least as large as the outputs) with 0xFF bytes turns such elements into NaN for float
dtypes (-1 for integers), which the NaN-position rule reports.
"""

from __future__ import annotations

import torch

from kernelfuse.verify.memory import poison_budget

POISON_BYTE = 0xFF
MIN_RESERVE_TRY = 1 << 20  # below this a reserve that did not fit is given up


def poison_free_memory(device: torch.device, reserve_bytes: int = 0) -> int:
    """Fill every inactive caching-allocator block on `device` (and `reserve_bytes` more) with 0xFF; return bytes.

    The blocks are taken by exact-size allocations (the allocator's best fit returns a block of that size), filled,
    and released, so they go back to the cache poisoned. The reserve is cut to the device's free memory less a
    headroom (kernelfuse.verify.memory), and halved while it does not fit: on a problem whose outputs fill the GPU,
    poisoning what fits beats an out-of-memory verdict against the judge itself. No-op on the CPU.
    """
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    sizes = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if segment.get("device", index) == index
        for block in segment.get("blocks", ())
        if block.get("state") == "inactive" and block.get("size", 0) > 0
    ]
    held: list[torch.Tensor] = []
    total = 0
    with torch.cuda.device(index):
        for size in sorted(sizes, reverse=True):
            held.append(torch.empty(size, dtype=torch.uint8, device=device).fill_(POISON_BYTE))
            total += size
        reserve = poison_budget(reserve_bytes, device)
        while reserve >= MIN_RESERVE_TRY:
            try:
                held.append(torch.empty(reserve, dtype=torch.uint8, device=device).fill_(POISON_BYTE))
            except torch.OutOfMemoryError:  # fragmented or taken meanwhile: poison less
                reserve //= 2
                continue
            total += reserve
            break
    del held
    return total
