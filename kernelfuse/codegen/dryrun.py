"""The emitted binding run without a GPU: each generated and attention kernel's method (an attention step that
calls torch's SDPA has none) is called on meta tensors laid out as the plan's graph holds its arguments, with the
launch skipped, and the output it allocates is compared with the one the kernel writes.

The CPU check interprets a plan's ops, not the file's Python side, and nvcc checks only the CUDA. A binding that
allocates another dtype than its kernel writes goes past both: GPT-2's residual add under bf16 (a bf16 source plus
an fp32 residual, written as fp32) allocated bf16, so the kernel wrote past the buffer's end on the GPU. Here such
a kernel fails at planning time and its nodes stay torch calls (kernelfuse.fallback).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from kernelfuse.codegen.binding import runtime_source
from kernelfuse.codegen.cuda import CudaSources, generate
from kernelfuse.codegen.iteration import tensor_args
from kernelfuse.plan import Plan
from kernelfuse.plan.ir import AttnStep, GenStep, TensorMeta


class BindingMismatch(AssertionError):
    """A kernel's binding allocates an output unlike the one its kernel writes (a kernelfuse bug)."""


def check_bindings(plan: Plan, sources: CudaSources) -> None:
    """Raise BindingMismatch (or the binding's own ValueError on an argument of an unexpected layout or dtype)
    for the first generated or attention kernel whose emitted method does not accept the graph's values or does
    not allocate the output its kernel writes."""
    kernels = _dry_kernels(sources.binding)
    steps: list[GenStep | AttnStep] = [*plan.generated, *(a for a in plan.attention if a.impl == "kernel")]
    for step in steps:
        arguments = [_meta_tensor(meta) for meta in _argument_metas(plan, step)]
        out = getattr(kernels, step.kernel)(*arguments)
        expected = step.out_meta
        if out.dtype != expected.dtype or tuple(out.shape) != tuple(expected.shape):
            raise BindingMismatch(f"{step.kernel}'s binding allocates {out.dtype} {list(out.shape)}, its kernel "
                                  f"writes {expected.dtype} {list(expected.shape)}")


def _argument_metas(plan: Plan, step: GenStep | AttnStep) -> list[TensorMeta]:
    """The layouts of the values the emitted forward passes to the kernel's method, in its parameter order."""
    if isinstance(step, AttnStep):
        return [inp.meta for inp in step.inputs]
    return [step.source.meta if name == "src" else plan.graph[ref].meta  # type: ignore[index]
            for name, ref in tensor_args(step)]


def _meta_tensor(meta: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def binding_off_the_gpu(binding: str) -> dict:
    """The namespace of an emitted binding (its run-time helpers and `_Kernels`) with the checks' device test
    ("must be a CUDA tensor") waived, the layout and dtype tests kept: for running it without a GPU (the dry run
    here, on meta tensors; the tests' CPU emulation of the kernels, on CPU tensors)."""
    namespace: dict = {"torch": torch, "ctypes": ctypes}
    exec(runtime_source() + binding, namespace)  # noqa: S102 - kernelfuse's own generated binding

    def device_waived(check: Callable[..., None]) -> Callable[..., None]:
        def run(t: torch.Tensor, *args: object) -> None:
            try:
                check(t, *args)
            except ValueError as err:
                if not str(err).endswith("must be a CUDA tensor"):
                    raise
        return run

    namespace["_check"] = device_waived(namespace["_check"])
    namespace["_check_dense"] = device_waived(namespace["_check_dense"])
    return namespace


def _dry_kernels(binding: str) -> object:
    """The emitted `_Kernels` class with no library behind it: checks and allocations run, launches do nothing."""
    namespace = binding_off_the_gpu(binding)

    class DryKernels(namespace["_Kernels"]):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:  # no library: the launchers are never looked up
            pass

        def __getattr__(self, name: str) -> None:  # a launcher attribute (`self._k3`) the skipped init declares
            if name.startswith("_"):
                return None
            raise AttributeError(name)

        def _launch(self, function: object, kernel: str, tensor: torch.Tensor, *args: object) -> None:
            return None

        def _conv_tma_ready(self, tensor: torch.Tensor) -> bool:  # no library: no TMA kernel runs
            return False

        def _causal_mask(self, *args: object) -> bool:  # meta tensors hold no values: the masked launcher's path
            return False

    return DryKernels()


def generate_checked(plan: Plan) -> CudaSources | None:
    """`generate(plan)`, its binding dry-run (check_bindings) before anything builds or ships it."""
    sources = generate(plan)
    if sources is not None:  # None: the plan launches no kernel of its own
        check_bindings(plan, sources)
    return sources
