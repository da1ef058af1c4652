"""Python API: `kernelfuse.optimize(model, example_inputs)` -> a module running fused kernels, checked first."""

from __future__ import annotations

import contextlib
import warnings

import torch

from kernelfuse.capture import capture_module, module_state
from kernelfuse.capture.signature import bind, forward_signature
from kernelfuse.codegen import generate, generate_checked
from kernelfuse.emit.modelnew import reserved_parameter
from kernelfuse.emit.module import build_module
from kernelfuse.errors import Fallback, Unsupported, one_line
from kernelfuse.fallback import plans_with_fallbacks, run_stage
from kernelfuse.plan import interpret, plan_variants
from kernelfuse.rewrite import apply_rules
from kernelfuse.shapes import ShapeSpecialised, shape_key
from kernelfuse.verify.float64 import no_less_accurate
from kernelfuse.verify.policy import get_policy


def optimize(model: torch.nn.Module, example_inputs: list | tuple, precision: str = "strict", *,
             max_shapes: int = 1) -> torch.nn.Module:
    """Return a module computing `model`'s forward with fused kernels, or `model` itself when that cannot be had.

    The plan is captured on fake tensors, interpreted with torch ops against `model` on `example_inputs`, built
    and then compared with `model` on the same inputs under the precision policy's tolerance. Any failure
    returns the original `model` with a warning that says why: never a wrong module. For a verdict with trials,
    the float64 check and timings use `kernelfuse eval` on a problem file. `example_inputs`: forward's positional
    arguments, as for a problem's get_inputs() (tensors, numbers, None, tuples, lists and dicts of tensors).

    Kernels are specialised to the example inputs' shapes. With `max_shapes` > 1 the module builds (and checks)
    another specialisation on the first call of each new shape, up to that many (kernelfuse.shapes); past them a
    new shape runs the original ops, warned once and counted in `kernelfuse_stats()`.
    """
    if max_shapes < 1:
        raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
    fused = _optimize_once(model, list(example_inputs), precision)
    if max_shapes == 1 or fused is model:
        return fused

    def build(args: tuple, kwargs: dict) -> torch.nn.Module:
        """Another shape's module, from a call's own arguments (forward's positional ones only)."""
        if kwargs:
            warnings.warn("kernelfuse: a call with keyword arguments is specialised on its positional ones only; "
                          "running the original ops for its shape", stacklevel=3)
            return model
        return _optimize_once(model, list(args), precision)

    # the original ops as the fused module's own fallback runs them (a bf16 plan's: under autocast)
    return ShapeSpecialised(model, build, max_shapes, (shape_key(list(example_inputs)), fused),
                            original=getattr(fused, "_reference_forward", model))


def _optimize_once(model: torch.nn.Module, inputs: list, precision: str) -> torch.nn.Module:
    """`optimize` for the example inputs' shapes alone."""
    policy = get_policy(precision)
    try:
        clash = reserved_parameter(list(forward_signature(model).parameters))
        if clash:
            raise Unsupported(Fallback("capture", f"{type(model).__name__}.forward", clash))
        # called inside CUDA autocast (Dynamo's backend), the module's outputs stay autocast's dtypes; called
        # without it, a bf16 plan returns float32 where the model does
        inside = policy.autocast is not None and torch.is_autocast_enabled("cuda")
        rewritten = apply_rules(capture_module(model, inputs, autocast=policy.autocast, widen_outputs=not inside))
    except Unsupported as why:
        warnings.warn(f"kernelfuse: {why}; returning the model unchanged", stacklevel=3)
        return model
    except Exception as err:  # noqa: BLE001 - no graph, no kernels: the model as it is, with why
        warnings.warn(f"kernelfuse: the forward could not be captured ({one_line(err)}); returning the model "
                      "unchanged", stacklevel=3)
        return model
    graph = rewritten.graph
    call = graph.call_spec
    tensors = bind(model, inputs, "example inputs")[1]
    plans, fallbacks = plans_with_fallbacks(graph, lambda keep: plan_variants(graph, precision, keep=keep),
                                            lambda plan: run_stage("codegen", generate_checked, plan))
    for fallback in (*rewritten.failed, *fallbacks):
        warnings.warn(f"kernelfuse: {fallback.describe()}", stacklevel=3)
    plans = [p for p in plans if p.launches_kernels]
    if not plans:
        warnings.warn("kernelfuse: nothing to fuse in this model; returning it unchanged", stacklevel=3)
        return model
    if not all(t.is_cuda for t in tensors) or not torch.cuda.is_available():
        warnings.warn("kernelfuse: example inputs are not on a CUDA device; returning the model unchanged",
                      stacklevel=3)
        return model
    state = dict(module_state(model))  # parameters, buffers and plain tensor attributes, as captured
    with torch.no_grad():
        with _autocast(policy.autocast):
            expected = call.run(model, tensors)
        # under bf16 the plan carries autocast's casts: it runs with autocast off, and its accuracy is measured
        # against the model in fp32 where roundings drift apart past the tolerance (the CPU check's rule)
        fp32 = [None] * len(expected)
        if policy.autocast is not None:
            with _autocast(False):
                fp32 = call.run(model, tensors)
        for plan in plans:
            with _autocast(None if policy.autocast is None else False):
                interpreted = interpret(plan, state, tensors)
                try:
                    fused = build_module(model, plan, generate(plan))
                except Exception as err:  # noqa: BLE001 - a build failure means: keep the original model
                    warnings.warn(f"kernelfuse: building {plan.variant} failed ({type(err).__name__}: {err})",
                                  stacklevel=3)
                    continue
                got = call.output.tensors(fused(*inputs))
            if all(_matches(e, i, policy.atol, r) and _matches(e, g, policy.atol, r)
                   for e, i, g, r in zip(expected, interpreted, got, fp32, strict=True)):
                return fused
    warnings.warn("kernelfuse: no fused plan matched the model on the example inputs; returning it unchanged",
                  stacklevel=3)
    return model


def _autocast(dtype: torch.dtype | bool | None) -> contextlib.AbstractContextManager:
    """CUDA autocast to `dtype`; False: autocast off (a plan that carries its casts); None: as the caller has it."""
    if dtype is None:
        return contextlib.nullcontext()
    if dtype is False:
        return torch.autocast("cuda", enabled=False)
    return torch.autocast("cuda", dtype=dtype)


def _matches(expected: object, got: object, tol: float, fp32: object) -> bool:
    """Within `tol` of the model's output, or (under autocast, `fp32` being the model's output without it) no
    less accurate than autocast's own result against that."""
    if _close(expected, got, tol):
        return True
    return fp32 is not None and _comparable(expected, got) and \
        no_less_accurate(got.float(), expected.float(), fp32)  # type: ignore[union-attr]


def _comparable(expected: object, got: object) -> bool:
    """Two tensors of one shape and dtype, or a float32 result where autocast's is bf16/fp16 (a bf16 plan called
    without autocast returns what the model returns without it)."""
    return isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == expected.shape \
        and (got.dtype == expected.dtype or
             (got.dtype == torch.float32 and expected.dtype in (torch.bfloat16, torch.float16)))


def _close(a: object, b: object, tol: float) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    return _comparable(a, b) and torch.allclose(a.to(b.dtype), b, atol=tol, rtol=tol, equal_nan=True)
