"""Python API: `kernelfuse.optimize(model, example_inputs)` -> a module running fused kernels, checked first."""

from __future__ import annotations

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
from kernelfuse.verify.policy import get_policy


def optimize(model: torch.nn.Module, example_inputs: list | tuple, precision: str = "strict") -> torch.nn.Module:
    """Return a module computing `model`'s forward with fused kernels, or `model` itself when that cannot be had.

    The plan is captured on fake tensors, interpreted with torch ops against `model` on `example_inputs`, built
    and then compared with `model` on the same inputs under the precision policy's tolerance. Any failure
    returns the original `model` with a warning that says why: never a wrong module. For a verdict with trials,
    the float64 check and timings use `kernelfuse eval` on a problem file. `example_inputs`: forward's positional
    arguments, as for a problem's get_inputs() (tensors, numbers, None, tuples, lists and dicts of tensors).
    """
    inputs = list(example_inputs)
    tol = get_policy(precision).atol
    try:
        clash = reserved_parameter(list(forward_signature(model).parameters))
        if clash:
            raise Unsupported(Fallback("capture", f"{type(model).__name__}.forward", clash))
        rewritten = apply_rules(capture_module(model, inputs))
    except Unsupported as why:
        warnings.warn(f"kernelfuse: {why}; returning the model unchanged", stacklevel=2)
        return model
    except Exception as err:  # noqa: BLE001 - no graph, no kernels: the model as it is, with why
        warnings.warn(f"kernelfuse: the forward could not be captured ({one_line(err)}); returning the model "
                      "unchanged", stacklevel=2)
        return model
    graph = rewritten.graph
    call = graph.call_spec
    tensors = bind(model, inputs, "example inputs")[1]
    plans, fallbacks = plans_with_fallbacks(graph, lambda keep: plan_variants(graph, precision, keep=keep),
                                            lambda plan: run_stage("codegen", generate_checked, plan))
    for fallback in (*rewritten.failed, *fallbacks):
        warnings.warn(f"kernelfuse: {fallback.describe()}", stacklevel=2)
    plans = [p for p in plans if p.launches_kernels]
    if not plans:
        warnings.warn("kernelfuse: nothing to fuse in this model; returning it unchanged", stacklevel=2)
        return model
    if not all(t.is_cuda for t in tensors) or not torch.cuda.is_available():
        warnings.warn("kernelfuse: example inputs are not on a CUDA device; returning the model unchanged",
                      stacklevel=2)
        return model
    state = dict(module_state(model))  # parameters, buffers and plain tensor attributes, as captured
    with torch.no_grad():
        expected = call.run(model, tensors)
        for plan in plans:
            interpreted = interpret(plan, state, tensors)
            try:
                fused = build_module(model, plan, generate(plan))
            except Exception as err:  # noqa: BLE001 - a build failure means: keep the original model
                warnings.warn(f"kernelfuse: building {plan.variant} failed ({type(err).__name__}: {err})",
                              stacklevel=2)
                continue
            got = call.output.tensors(fused(*inputs))
            if all(_close(e, i, tol) and _close(e, g, tol) for e, i, g in zip(expected, interpreted, got, strict=True)):
                return fused
    warnings.warn("kernelfuse: no fused plan matched the model on the example inputs; returning it unchanged",
                  stacklevel=2)
    return model


def _close(a: object, b: object, tol: float) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, atol=tol, rtol=tol, equal_nan=True)
