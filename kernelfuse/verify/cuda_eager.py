"""The CPU check's eager reference as CUDA eager computes it: torch dispatch modes under which the model's CPU run
rounds where ATen's CUDA kernels round (a division by a number, a convolution's bias) and lays new tensors out as
the capture recorded. The GPU eager that a file runs beside is the reference the check stands in for
(kernelfuse.cpucheck applies them; a plan is compared against them only where the plain reference refuses it)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from kernelfuse.rewrite.anchors import cuda_adds_bias_after


class CudaScalarDivision(TorchDispatchMode):
    """The model's divisions by a Python number as ATen's CUDA kernel computes them, x * (1/c) with 1/c rounded to
    float32 (the rewrite `div_by_scalar_to_mul` plans the same): the CPU's true division is up to an ulp away, and
    a later softmax or division by a near-zero sum amplifies that past any tolerance. The check's reference is the
    GPU eager the file will run beside."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is torch.ops.aten.div.Tensor and not kwargs and isinstance(args[1], (int, float)) \
                and not isinstance(args[1], bool) and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in (torch.float32, torch.float16, torch.bfloat16):
            inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(args[1]), dtype=torch.float32)
            return torch.ops.aten.mul.Tensor(args[0], inverse.item())
        return func(*args, **kwargs)


class CudaConvolutionBias(TorchDispatchMode):
    """A convolution's bias added after its product, as ATen's CUDA convolution adds it outside its depthwise
    kernels (cuDNN writes the product, then `output.add_(bias)`; the rewrite conv_bias_to_epilogue plans the
    same): the CPU's kernels take the bias into their own call, another rounding, which a later log or division
    near zero amplifies past any tolerance."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is torch.ops.aten.convolution.default and not kwargs and args[2] is not None \
                and args[0].is_floating_point() and cuda_adds_bias_after(args[6], args[8], args[0].shape[1]):
            product = func(args[0], args[1], None, *args[3:])
            return product + args[2].view((-1,) + (1,) * (product.dim() - 2))
        return func(*args, **kwargs)


class CapturedLayouts(TorchDispatchMode):
    """Each new tensor an op returns laid out as torch's meta kernels lay it out: the layouts the fake-tensor
    capture recorded, which the plan's kernels write (a generated kernel writes its permuted captured layout) and
    its torch calls then read. The CPU's kernels do not always agree (a CPU batch norm of a permuted input is
    contiguous, the meta one permuted), and a reduction over such a value sums in another order: visible where it
    cancels. The values stay eager's; a view or an in-place result keeps its source's layout."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        flat, spec = tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) for t in flat) or any(r.alias_info for r in func._schema.returns):
            return out

        def on_meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        try:
            laid = tree_flatten(func(*tree_map_only(torch.Tensor, on_meta, args),
                                     **tree_map_only(torch.Tensor, on_meta, kwargs or {})))[0]
        except Exception:  # noqa: BLE001 - no meta kernel for it: the CPU's layout stands
            return out
        if len(laid) != len(flat):
            return out
        return tree_unflatten([_laid_out_as(t, m) for t, m in zip(flat, laid, strict=True)], spec)


def _laid_out_as(value: object, meta: object) -> object:
    """`value` copied into `meta`'s strides where they differ (empty_like keeps them where they are dense)."""
    if not isinstance(value, torch.Tensor) or not isinstance(meta, torch.Tensor) or value.shape != meta.shape \
            or value.stride() == meta.stride():
        return value
    return torch.empty_like(meta, dtype=value.dtype, device=value.device).copy_(value)
