"""Library anchors (ops that run through cuBLAS/cuDNN and can take a fused epilogue) and the other op families.

The planner only builds epilogues behind the anchors listed here; every family below it is known vocabulary that
stays a torch call for now and is reported as unfused with its family name, so the summary says what is missing.
"""

from __future__ import annotations

# ATen overload -> anchor family.
ANCHOR_OPS: dict[str, str] = {
    "mm.default": "matmul",
    "addmm.default": "matmul",
    "convolution.default": "conv",
}

# Free views: never worth a kernel and never reported as unfused.
VIEW_OPS: frozenset[str] = frozenset(
    {"t.default", "view.default", "_unsafe_view.default", "reshape.default", "permute.default", "expand.default",
     "unsqueeze.default", "squeeze.dim", "alias.default", "detach.default", "transpose.int", "getitem",
     "slice.Tensor", "select.int", "narrow.default"}
)

# Reshapes that keep the element order: inside a kernel they rename a value (the flat index is unchanged).
RESHAPES: frozenset[str] = frozenset(
    {"view.default", "_unsafe_view.default", "reshape.default", "squeeze.dim", "squeeze.dims", "squeeze.default",
     "unsqueeze.default", "flatten.using_ints"}
)

# Families recognised for reporting; they are planned as torch calls until their kernels exist.
UNFUSED_FAMILIES: dict[str, str] = {
    "sum.dim_IntList": "reduction", "mean.dim": "reduction", "amax.default": "reduction", "amin.default": "reduction",
    "logsumexp.default": "reduction", "_softmax.default": "softmax", "_log_softmax.default": "softmax",
    "native_batch_norm.default": "normalisation", "_native_batch_norm_legit_functional.default": "normalisation",
    "native_group_norm.default": "normalisation", "native_layer_norm.default": "normalisation",
    "max_pool2d_with_indices.default": "pooling", "avg_pool2d.default": "pooling", "bmm.default": "matmul",
}


def family_of(op: str) -> str:
    """The op family used in the unfused report ("other" when unknown)."""
    return ANCHOR_OPS.get(op) or UNFUSED_FAMILIES.get(op) or ("view" if op in VIEW_OPS else "other")
