"""Ops that stay torch calls by decision, with the decision as the reason the plan reports (not a missing kernel).

Each entry says why the torch call is the right one: it moves no data, or ATen's kernel already moves each byte
once (the memory floor) so that a generated kernel of the lone op could only tie it. Where such an op sits in a
chain a kernel could fuse, the scheduler's own refusal reason is reported instead.
"""

from __future__ import annotations

KEPT_AS_TORCH: dict[str, str] = {
    "empty.memory_format": "allocation only (batch norm's reserve buffer): no data moved",
    "triu.default": "library at the floor: ATen's masked copy reads and writes each element once",
    "tril.default": "library at the floor: ATen's masked copy reads and writes each element once",
    "add_.Tensor": "in-place state update of a buffer (batch norm's step counter): one element",
}
