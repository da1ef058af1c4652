"""What every kernel family shares: C type names, index limits and the broadcast-operand offset expression."""

from __future__ import annotations

import torch

from kernelfuse.capture import contiguous_strides

C_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
AT_TYPES = {torch.float32: "at::kFloat", torch.float16: "at::kHalf", torch.bfloat16: "at::kBFloat16"}
INT32_LIMIT = 2**31 - 1


def ints(values: tuple[int, ...]) -> str:
    """`1, 2, 3`: a C++ initializer list's body."""
    return ", ".join(str(v) for v in values)


def offset_expr(strides: tuple[int, ...], shape: tuple[int, ...], var: str = "i") -> str:
    """C expression for an operand's element offset at logical (contiguous) output index `i`.

    Adjacent output dimensions whose operand strides chain (or are both broadcast) are merged first, so a
    per-channel bias over NCHW becomes `(i / HW) % C`, a row bias `i % N`, a same-shape operand just `i`.
    """
    out_strides = contiguous_strides(shape)
    groups: list[list[int]] = []  # [size, operand stride, output stride]
    for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        if size == 1:
            continue
        if groups:
            last = groups[-1]
            if (stride == 0 and last[1] == 0) or (stride != 0 and last[1] == stride * size):
                last[0] *= size
                last[1] = stride
                last[2] = out_strides[d]
                continue
        groups.append([size, stride, out_strides[d]])
    terms = []
    for g, (size, stride, out_stride) in enumerate(groups):
        if stride == 0:
            continue
        term = var if out_stride == 1 else f"({var} / {out_stride})"
        if g > 0:  # the outermost group needs no modulo: i / out_stride < size already
            term = f"({term} % {size})"
        if stride != 1:
            term = f"{term} * {stride}"
        terms.append(term)
    return " + ".join(terms) if terms else "0"
