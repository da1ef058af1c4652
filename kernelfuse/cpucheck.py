"""The CPU check: interpret each plan with torch ops against the original model, on the real weights.

A plan is specialised to the captured shapes (views and group norms carry the batch size as constants), so the
check does not cut the batch of a captured plan. It re-captures the forward at a small batch and re-plans it with
the same planner and policy; when that graph and plan have the same structure as the shipped one (same ATen op
sequence, same fusion summary), the small plan is checked. Otherwise the shipped plan itself is checked at full
shape when that fits in `FULL_SHAPE_LIMIT_BYTES`. Where neither can run the result says "skipped" and why: a
skipped check never counts as a pass. Every check is time-bounded.
"""

from __future__ import annotations

import copy
import math
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch

from kernelfuse.capture import Graph, capture
from kernelfuse.capture.signature import CallSpec
from kernelfuse.capture.trace import module_state
from kernelfuse.load import Problem
from kernelfuse.plan import Plan, interpret, make_plan, torch_calls_plan
from kernelfuse.plan.interpret import RANDOM_OPS, run_env
from kernelfuse.rewrite import rewrite
from kernelfuse.verify.cuda_eager import CapturedLayouts, CudaConvolutionBias, CudaScalarDivision
from kernelfuse.verify.float64 import as_accurate_as, max_abs_error, no_less_accurate

CHECK_BATCH = 2
CHECK_TIMEOUT_S = 30.0
FULL_SHAPE_LIMIT_BYTES = 2 * 1024**3
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # the rest (fp32, fp64, integers): 1e-5
DEFAULT_TOLERANCE = 1e-5
FLOAT64_COPY_LIMIT_BYTES = 512 * 1024**2
COMPARE_CHUNK = 1 << 22  # elements compared at a time: float64 copies of a 400 MB output would need 3.5 GB
# Eager's other legitimate runs, by (CUDA's arithmetic, the captured layouts), and what a pass against one says:
# tried in turn where a plan's values differ from plain eager's, each run only once a comparison needs it
RETRIES = {(True, False): "CUDA's divisions by a number and convolution biases",
           (False, True): "the layouts the capture recorded",
           (True, True): "CUDA's divisions and convolution biases, in the layouts the capture recorded"}


@dataclass(frozen=True)
class CpuCheck:
    variant: str
    ok: bool
    max_abs_err: float | None
    note: str
    skipped: bool = False  # could not run (reason in `note`): neither a pass nor a failure

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else "ok" if self.ok else "FAILED"


class _Skip(Exception):
    """The check cannot run here; the message is the reason."""


class _Timeout(BaseException):
    """Raised by the timer: a BaseException, so no `except Exception` on the way turns it into a failure."""


def check_plans(problem: Problem, model: torch.nn.Module, graph: Graph, plans: list[Plan],
                prepare: Callable[[Graph], Graph] = rewrite, timeout_s: float = CHECK_TIMEOUT_S) -> list[CpuCheck]:
    """One CpuCheck per plan. `graph`: the graph the plans were made from, `prepare` applied to its capture (the
    same rewrite rules make the small-batch twin); `model`: the problem's module, with its real weights."""
    try:
        with _time_limit(timeout_s):
            return _run_all(model, _checkable(problem, model, graph, plans, prepare), plans)
    except _Skip as why:
        return [CpuCheck(p.variant, False, None, f"skipped: {why}", skipped=True) for p in plans]
    except Exception as err:  # noqa: BLE001 - a check that cannot run is skipped, never a pass
        why = f"the check ran out of memory ({_first_line(err)[-80:]})" if _out_of_memory(err) else \
            f"the check itself raised {type(err).__name__}: {_first_line(err)[:120]} (a kernelfuse bug)"
        return [CpuCheck(p.variant, False, None, f"skipped: {why}", skipped=True) for p in plans]
    except _Timeout:
        return [CpuCheck(p.variant, False, None, f"skipped: the check ran past its {timeout_s:.0f} s limit",
                         skipped=True) for p in plans]


def check_plans_on(model: torch.nn.Module, plans: list[Plan], inputs: list[torch.Tensor]) -> list[CpuCheck]:
    """Each plan interpreted on these very inputs (the problem's own, with their strides and any NaN or Inf)
    against the model, at the plans' captured shapes; the fuzzer's check."""
    return _run_all(model, [(p, inputs) for p in plans], plans)


def _checkable(problem: Problem, model: torch.nn.Module, graph: Graph, plans: list[Plan],
               prepare: Callable[[Graph], Graph]) -> list[tuple[Plan, list[torch.Tensor]]]:
    """For each plan, the plan to interpret and its inputs: a re-planned small-batch twin, or itself at full shape."""
    if any(t.is_meta for _, t in module_state(model)):
        raise _Skip("the model's parameters exceed 2 GB: built on the meta device, no weights to check with")
    small = _small_twins(problem, model, graph, plans, prepare)
    if small is not None:
        return small
    full = sum(n.meta.numel * n.meta.dtype.itemsize for n in graph.nodes if n.meta is not None)
    if full > FULL_SHAPE_LIMIT_BYTES:
        raise _Skip(f"the graph is not batch-independent and needs {full / 2**30:.1f} GB at full shape "
                    f"(limit {FULL_SHAPE_LIMIT_BYTES / 2**30:.0f} GB)")
    inputs = random_inputs(graph)
    return [(p, inputs) for p in plans]


def _small_twins(problem: Problem, model: torch.nn.Module, graph: Graph, plans: list[Plan],
                 prepare: Callable[[Graph], Graph]) -> list[tuple[Plan, list[torch.Tensor]]] | None:
    """Plans re-made by the same planner on a small-batch capture, if their structure is the shipped plans'."""
    if all(not n.meta.shape or n.meta.shape[0] <= CHECK_BATCH for n in graph.inputs):
        return None  # already small: check the plans themselves
    for min_rank in (1, 2):  # every input's batch, or only the matrices' (a vector may broadcast along a row)
        try:
            small_graph = prepare(capture(problem, model, batch=CHECK_BATCH, min_rank=min_rank,
                                          autocast=graph.autocast))
            if [n.op for n in small_graph.nodes] != [n.op for n in graph.nodes]:
                continue
            twins = [make_plan(small_graph, p.options) if p.options is not None else None for p in plans]
        except Exception:  # noqa: BLE001 - no small twin (a user error or a stage's bug there): check at full shape
            continue
        if all(t is not None and t.summary() == p.summary() for t, p in zip(twins, plans, strict=True)):
            inputs = random_inputs(small_graph)
            return [(t, inputs) for t in twins]
    return None


def _run_all(model: torch.nn.Module, checkable: list[tuple[Plan, list[torch.Tensor]]],
             shipped: list[Plan]) -> list[CpuCheck]:
    """Run the model once per distinct input set and interpret every plan against it, on the same state. Where a
    plan's values differ, the RETRIES' references are tried in turn; the float64 rule, where none matches, judges
    the plan against the eager run it is closest to (the one whose arithmetic and layouts it follows)."""
    state = dict(module_state(model))
    before = {k: v.clone() for k, v in state.items() if not isinstance(v, torch.nn.Parameter)}
    expected: dict[object, object] = {}  # by id(inputs); by (cuda, layouts, id) once a comparison needs it
    checks = []
    for ship, (plan, inputs) in zip(shipped, checkable, strict=True):
        if plan.graph.autocast is not None:
            checks.append(_check_autocast(ship.variant, model, plan, state, before, inputs))
            continue
        if id(inputs) not in expected:
            expected[id(inputs)] = _run_model(model, plan.graph.call_spec, inputs, state, before)
        try:
            with torch.no_grad():
                torch.manual_seed(0)
                got = interpret(plan, {**state, **{k: v.clone() for k, v in before.items()}}, inputs)
        except Exception as err:  # noqa: BLE001 - the check reports, the pipeline decides
            if _out_of_memory(err):
                checks.append(CpuCheck(ship.variant, False, None, "skipped: the interpreter ran out of memory "
                                       f"({_first_line(err)[-80:]})", skipped=True))
            else:
                checks.append(CpuCheck(ship.variant, False, None,
                                       f"interpreter raised {type(err).__name__}: {_first_line(err)}"))
            continue
        check = compare(ship.variant, expected[id(inputs)], got, inputs)
        references = [expected[id(inputs)]]
        for (cuda, layouts), how in RETRIES.items():
            if check.ok or check.max_abs_err is None:  # a pass, or a wrong count, shape or dtype: no retry
                break
            key = (cuda, layouts, id(inputs))
            if key not in expected:
                try:
                    expected[key] = _run_model(model, plan.graph.call_spec, inputs, state, before, cuda, layouts)
                except _Skip:  # eager cannot run so (a view its layouts refuse): no such reference
                    expected[key] = None
            if expected[key] is None:
                continue
            references.append(expected[key])
            retry = compare(ship.variant, expected[key], got, inputs)
            if retry.ok:
                check = replace(retry, note=f"{retry.note} (against eager with {how})")
        if not check.ok and check.max_abs_err is not None and _float64_allowed(model, plan):
            closest = min(references, key=lambda reference: _distance(reference, got))
            check = _float64_rule(ship.variant, model, plan.graph.call_spec, inputs, closest, got) \
                or _rounded_rule(ship.variant, plan, state, before, inputs, closest, got) or check
        checks.append(check)
    return checks


def _check_autocast(variant: str, model: torch.nn.Module, plan: Plan, state: dict[str, torch.Tensor],
                    before: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> CpuCheck:
    """A plan of a graph captured under CUDA autocast (the bf16 policy) against that graph's own ops, run one by one
    on the CPU: the CPU's autocast casts other ops than CUDA's, so the model itself is no reference here. This
    checks the fusion; the GPU judge checks the whole against the model under CUDA autocast. The tolerance is the
    autocast dtype's: a fused kernel rounds each statement to bf16 as the ops do, but sums in another order, and
    where that difference grows with depth past the tolerance the accuracy rule decides (`_autocast_rule`)."""
    ops = torch_calls_plan(plan.graph)
    with torch.no_grad():
        reference = interpret(ops, {**state, **{k: v.clone() for k, v in before.items()}}, inputs)
        try:
            got = interpret(plan, {**state, **{k: v.clone() for k, v in before.items()}}, inputs)
        except Exception as err:  # noqa: BLE001 - the check reports, the pipeline decides
            return CpuCheck(variant, False, None, f"interpreter raised {type(err).__name__}: {_first_line(err)}")
    check = compare(variant, reference, got, inputs, TOLERANCE[plan.graph.autocast])
    if not check.ok and check.max_abs_err is not None:
        check = _autocast_rule(variant, model, plan, state, before, inputs, reference, got) or check
    return replace(check, note=f"{check.note} (against the captured autocast ops)")


def _autocast_rule(variant: str, model: torch.nn.Module, plan: Plan, state: dict[str, torch.Tensor],
                   before: dict[str, torch.Tensor], inputs: list[torch.Tensor], ops: object,
                   got: list[torch.Tensor]) -> CpuCheck | None:
    """The judge's bf16 rule on the CPU: two bf16 computations that round at other points differ by up to bf16's
    own error, which grows with depth (full-size GPT-2's fused plan: 0.025 from its ops, against 2e-2). The plan
    passes when, against the model run in fp32 (accurate far below bf16's error), it is no less accurate than the
    captured ops, in max and in mean error, with NaN and Inf where they have them. None where it is not."""
    try:
        exact = _run_model(model, plan.graph.call_spec, inputs, state, before)
    except _Skip:
        return None
    ops = list(ops) if isinstance(ops, (tuple, list)) else [ops]
    exact = list(exact) if isinstance(exact, (tuple, list)) else [exact]
    if not compare(variant, ops, got, inputs, math.inf).ok:  # count, shapes, dtypes, NaN and Inf positions
        return None
    if not no_less_accurate(got, ops, exact):
        return None
    err = max(max_abs_diff(g, o) for g, o in zip(got, ops, strict=True))
    return CpuCheck(variant, True, err, f"max abs error {err:.3g}, within the accuracy rule (no less accurate "
                    f"than the ops against an fp32 run: max {max_abs_error(got, exact):.3g} against "
                    f"{max_abs_error(ops, exact):.3g})")


def _distance(expected: object, got: list[torch.Tensor]) -> float:
    """The largest difference between a plan's outputs and an eager run's (NaN where NaN not counted); infinite
    where a shape differs."""
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    return max((max_abs_diff(g, e, ignore_nan=True) if isinstance(e, torch.Tensor) and e.shape == g.shape
                else math.inf for e, g in zip(expected, got, strict=True)), default=0.0)


def _float64_allowed(model: torch.nn.Module, plan: Plan) -> bool:
    """The float64 rule needs a deterministic graph (random masks differ between dtypes) and a model small
    enough to copy in float64."""
    size = sum(t.numel() for _, t in module_state(model))
    return size * 8 <= FLOAT64_COPY_LIMIT_BYTES and not any(
        any(word in n.op for word in RANDOM_OPS) for n in plan.graph.nodes)


def _float64_rule(variant: str, model: torch.nn.Module, call: CallSpec, inputs: list[torch.Tensor],
                  expected: object, got: list[torch.Tensor]) -> CpuCheck | None:
    """The judge's rule where eager itself rounds (a reordered reduction, a matmul done in float64 by a rewrite):
    NaN and Inf where eager has them, and against a float64 run of the model, over the positions where both are
    finite, no less accurate than eager in max and in mean error (`verify.float64.as_accurate_as`: err(plan) <=
    2 x err(eager) + 1e-6 x max|ref|). Non-finite values are compared by position, not subtracted: an output with
    an Inf or a NaN (log2 of a zero, a LayerNorm over a constant row) is judged on its finite elements, as the judge
    does. None when the rule does not pass either."""
    try:
        with torch.no_grad():
            ref_model = copy.deepcopy(model).double()
            torch.manual_seed(0)
            ref = call.run(ref_model, [t.double() if t.is_floating_point() else t for t in inputs])
    except Exception:  # noqa: BLE001 - no float64 run (an op without a float64 kernel): the plain result stands
        return None
    return _as_accurate_against(variant, ref, expected, got, "(no less accurate than eager against a float64 run)")


def _as_accurate_against(variant: str, ref: object, expected: object, got: list[torch.Tensor],
                         why: str) -> CpuCheck | None:
    """A pass where every output of the plan is `as_accurate_as` eager's against `ref`'s; else None."""
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    worst = 0.0
    for r, e, g in zip(ref, expected, got, strict=True):
        if not as_accurate_as(g, e, r):
            return None
        worst = max(worst, max_abs_diff(g, e, ignore_nan=True))
    return CpuCheck(variant, True, worst, f"max abs error {worst:.3g} vs eager, within the float64 rule {why}")


def _rounded_rule(variant: str, plan: Plan, state: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
                  inputs: list[torch.Tensor], expected: object, got: list[torch.Tensor]) -> CpuCheck | None:
    """The float64 rule against the graph's ops each computed in float64 and rounded once to its dtype, where the
    rule against the float64 model does not pass. Against the float64 model, the error of a low-precision model is
    mostly the roundings upstream, which eager and the plan share; an op that amplifies them (log2 near zero) can
    then put the plan past 2x eager's error where it computes its own step more accurately than eager does (fuzz
    seed 78000, model 305: bf16 attention computed exactly and rounded once, eager's rounding its probabilities).
    Against each op correctly rounded, the shared roundings cancel and each side's own arithmetic is measured.
    None when this rule does not pass either."""
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            env = run_env(torch_calls_plan(plan.graph), {**state, **{k: v.clone() for k, v in before.items()}},
                          inputs, rounded=True)
    except Exception:  # noqa: BLE001 - no such reference: the plain result stands
        return None
    return _as_accurate_against(variant, [env[r.name] for r in plan.graph.outputs], expected, got,
                                "against each op correctly rounded (no less accurate than eager there)")


def _run_model(model: torch.nn.Module, call: CallSpec, inputs: list[torch.Tensor], state: dict[str, torch.Tensor],
               before: dict[str, torch.Tensor], cuda: bool = False, layouts: bool = False) -> object:
    """The model's own output tensors under seed 0, called as captured (`inputs`: the graph's tensors); buffers it
    updates (BatchNorm statistics) are put back after. `cuda`: under CudaScalarDivision and CudaConvolutionBias,
    `layouts`: under CapturedLayouts (every op then passes through Python: DenseNet201's forward takes 4x as
    long, so only a failed comparison asks for them)."""
    try:  # the layouts mode outermost: it lays out what the ops the CUDA modes call return
        with torch.no_grad(), CapturedLayouts() if layouts else nullcontext(), \
                CudaConvolutionBias() if cuda else nullcontext(), CudaScalarDivision() if cuda else nullcontext():
            torch.manual_seed(0)
            return call.run(model, inputs)
    except Exception as err:  # noqa: BLE001 - the model itself cannot run on the CPU: nothing to compare with
        raise _Skip(f"the model does not run on the CPU at the check's shapes ({type(err).__name__}: "
                    f"{_first_line(err)})") from None
    finally:
        _restore(state, before)


def compare(variant: str, expected: object, got: list[torch.Tensor], inputs: list[torch.Tensor],
            tolerance: float | None = None) -> CpuCheck:
    """Same count, shapes and dtypes, values within the dtype's tolerance, or `tolerance` (NaN where NaN)."""
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if len(expected) != len(got):
        return CpuCheck(variant, False, None, f"{len(got)} outputs, model returns {len(expected)}")
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        if not isinstance(e, torch.Tensor) or e.shape != g.shape or e.dtype != g.dtype:
            what = f"output {tuple(g.shape)} {g.dtype} vs {getattr(e, 'shape', e)} {getattr(e, 'dtype', '')}"
            return CpuCheck(variant, False, None, what)
        tol = tolerance if tolerance is not None else TOLERANCE.get(e.dtype, DEFAULT_TOLERANCE)
        err = max_abs_diff(g, e, ignore_nan=True)
        if not all(torch.allclose(gc, ec, atol=tol, rtol=tol, equal_nan=True) for gc, ec in _chunks(g, e)):
            return CpuCheck(variant, False, err, f"mismatch, max abs error {err:.3g} (tolerance {tol:g})")
        worst = max(worst, err)
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    return CpuCheck(variant, True, worst, f"max abs error {worst:.3g} on inputs {shapes}")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor | None, ignore_nan: bool = False) -> float:
    """max |a - b| in float64 (max |a| when `b` is None), a chunk at a time so that a large output needs no float64
    copy; NaN if a difference is NaN, unless `ignore_nan` (then it counts 0, and an infinite one the largest
    float64). 0 for no elements."""
    worst = 0.0
    for ac, bc in _chunks(a, a if b is None else b):
        diff = ac.double().abs() if b is None else (ac.double() - bc.double()).abs()
        value = (diff.nan_to_num(0.0) if ignore_nan else diff).max().item()
        if math.isnan(value):
            return value
        worst = max(worst, value)
    return worst


def _chunks(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching slices of `COMPARE_CHUNK` elements of two tensors of one shape, in row-major order."""
    a, b = a.reshape(-1), b.reshape(-1)
    for i in range(0, a.numel(), COMPARE_CHUNK):
        yield a[i:i + COMPARE_CHUNK], b[i:i + COMPARE_CHUNK]


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "can't allocate memory" in str(err)


def random_inputs(graph: Graph) -> list[torch.Tensor]:
    """Inputs with the graph's shapes and dtypes: uniform [0, 1) floats, zeros otherwise."""
    return [torch.rand(n.meta.shape, dtype=n.meta.dtype) if n.meta.dtype.is_floating_point
            else torch.zeros(n.meta.shape, dtype=n.meta.dtype) for n in graph.inputs]


def _restore(state: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Put back buffers the model's forward updated in place (BatchNorm running statistics in training mode)."""
    with torch.no_grad():
        for k, v in before.items():
            if state[k].shape == v.shape:
                state[k].copy_(v)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _Timeout in the main thread after `seconds` (between torch calls); no limit in other threads."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise _Timeout

    previous: Callable | int | None = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
