"""What a failed trace means, in one line: the user's own line of forward, and what to change where the cause is
known (a branch on a tensor's value, an output sized by values); else torch's exception, named."""

from __future__ import annotations

import traceback

from kernelfuse.errors import CaptureError

# Calls that mean "the forward branches on a tensor's value": make_fx cannot record one graph for them.
DATA_DEPENDENT = ("_local_scalar_dense", "data-dependent", "Data dependent", "DataDependentOutputException")
# ...and ops whose output size depends on the values (nonzero, masked_select, unique, boolean-mask indexing)
DATA_SIZED = ("DynamicOutputShapeException",)


def capture_error(err: Exception, what: str) -> CaptureError:
    """One line naming the user's own line; a branch on a value or a value-sized output says what to change."""
    line = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if frame.filename == what:
            line = f" at line {frame.lineno} ({(frame.line or '?').strip()})"
            break
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if any(k in f"{type(err).__name__} {err}" for k in DATA_DEPENDENT):
        return CaptureError(f"{what}: forward branches on a tensor's value{line}: kernelfuse traces one graph "
                            "for all inputs (compute both branches with torch.where, or move the test out of forward)")
    if any(k in type(err).__name__ for k in DATA_SIZED):
        return CaptureError(f"{what}: an output's size depends on the input's values{line} ({text}: nonzero, "
                            "boolean-mask indexing, a mixture-of-experts router's token choice): kernelfuse traces "
                            "fixed shapes (use fixed-size ops such as torch.where, or optimize the model's dense "
                            "submodules)")
    return CaptureError(f"{what}: could not trace forward to ATen ops{line}: {type(err).__name__}: {text}")
