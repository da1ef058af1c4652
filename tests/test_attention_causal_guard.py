"""A constant causal-shaped attention mask runs as causal, guarded (AttnStep.causal_guard).

minGPT's `att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)` over a lower-triangular buffer (and SDPA's bool or
additive masks made so) masks exactly what `is_causal` masks. The planner finds it from the buffer's value at
capture time; the emitted binding checks the mask the forward computes once per version of the buffers it is
made from, runs the causal kernel (no mask read, the key tiles past the diagonal skipped) where it is causal and the
masked kernel otherwise, and never checks inside a CUDA graph capture. Here: which masks get the guard, the
binding's verdict cache, and the emitted file run on the CPU (its kernels emulated) against eager before and after
the buffer is changed in place; on the GPU (marked gpu) the same in fp32 and bf16, graphed too.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from emulation_helpers import emulated
from optimizer_helpers import write_problem
from torch import nn

from kernelfuse.capture import capture, capture_module
from kernelfuse.codegen import generate
from kernelfuse.codegen.dryrun import binding_off_the_gpu
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.plan import make_plan
from kernelfuse.plan.attention_views import causal_mask_matches
from kernelfuse.rewrite import rewrite


class Masked(nn.Module):
    """Hand-written attention over a constant mask buffer (`how` picks the mask's form), or through
    scaled_dot_product_attention with it (`sdpa`)."""

    def __init__(self, how: str = "causal", seq: int = 16, width: int = 32, heads: int = 2):
        super().__init__()
        self.how, self.heads = how, heads
        ones = torch.ones(seq, seq)
        masks = {"causal": ones.tril(), "tril-1": ones.tril(-1), "band": ones.tril() * ones.triu(-3),
                 "ones": ones, "sdpa_keep": ones.tril(), "sdpa_add": torch.zeros(seq, seq).masked_fill(
                     ones.tril() == 0, float("-inf")), "relu": ones.tril(), "param": ones.tril()}
        if how == "param":
            self.bias = nn.Parameter(masks[how].view(1, 1, seq, seq), requires_grad=False)
        else:
            self.register_buffer("bias", masks[how].view(1, 1, seq, seq))
        self.proj = nn.Linear(width, 3 * width)

    def forward(self, x, gate=None):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.proj(x).split(c, dim=2))
        if self.how == "sdpa_keep":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :t, :t] == 1)
        elif self.how == "sdpa_add":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :t, :t])
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = self.bias[:, :, :t, :t] == 0
            if gate is not None:  # a mask that depends on an input
                mask = mask | (gate > 0)
            att = att.masked_fill(mask, float("-inf"))
            att = F.relu(att) if self.how == "relu" else F.softmax(att, dim=-1)
            y = att @ v
        return y.transpose(1, 2).contiguous().view(b, t, c)


def _plan(how: str, gate: bool = False, t: int = 13):
    torch.manual_seed(0)
    model = Masked(how)
    inputs = [torch.randn(2, t, 32)] + ([torch.randn(t, t)] if gate else [])
    graph = rewrite(capture_module(model, inputs))
    return model, inputs, graph, make_plan(graph)


# ---- the planner ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how, kind", [("causal", "drop"), ("relu", "drop"), ("sdpa_keep", "keep"),
                                       ("sdpa_add", "add")])
def test_a_causal_constant_mask_gets_the_guard(how, kind):
    _, _, graph, plan = _plan(how)
    (step,) = plan.attention
    assert step.mask is not None and step.mask_kind == kind and not step.causal
    assert [graph[n].target for n in step.causal_guard] == ["bias"]
    assert f"causal ({kind} mask verified causal at run time)" in plan.summary()
    causal = step.as_causal()
    assert causal.causal and causal.mask is None and causal.causal_guard is None


@pytest.mark.parametrize("how", ["tril-1", "band", "ones", "param"])
def test_a_constant_mask_that_is_not_causal_stays_a_mask(how):
    """Not causal (the diagonal masked too, a band, nothing masked), or a parameter's (a trained value)."""
    _, _, _, plan = _plan(how)
    (step,) = plan.attention
    assert step.mask_kind == "drop" and step.causal_guard is None and not step.causal
    assert "verified causal" not in plan.summary()


class PositionMask(nn.Module):
    """A causal keep mask built in forward from positions made on the input's device (transformers' Llama builds
    its SDPA mask so): no buffer at all, only literals and the input's shape."""

    def forward(self, x):
        b, h, t, d = x.shape
        pos = torch.arange(t, device=x.device)
        keep = pos[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=keep.expand(b, 1, t, t))


def test_a_causal_mask_made_from_positions_gets_the_guard_with_no_sources():
    plan = make_plan(rewrite(capture_module(PositionMask(), [torch.randn(2, 2, 13, 16)])))
    (step,) = plan.attention
    assert step.mask_kind == "keep" and step.causal_guard == ()  # the binding's verdict: one per mask size


def test_a_mask_that_depends_on_an_input_stays_a_mask():
    _, _, _, plan = _plan("causal", gate=True)
    (step,) = plan.attention
    assert step.mask_kind == "drop" and step.causal_guard is None


def test_no_guard_without_the_buffers_values_or_in_the_library_variant():
    """A graph without the capture's values (built by hand) keeps the mask; torch's SDPA call (the library
    variant) takes the mask as it is."""
    from kernelfuse.plan import PlanOptions

    _, _, graph, _ = _plan("causal")
    (step,) = make_plan(replace(graph, state_values=None)).attention
    assert step.causal_guard is None
    (step,) = make_plan(graph, PlanOptions(attention="library")).attention
    assert step.impl == "library" and step.causal_guard is None


def test_the_causal_pattern():
    keep = torch.ones(5, 7, dtype=torch.bool).tril()
    assert causal_mask_matches(~keep, "drop", 5, 7) and causal_mask_matches(keep.view(1, 1, 5, 7), "keep", 5, 7)
    assert causal_mask_matches(torch.zeros(5, 7).masked_fill(~keep, -math.inf), "add", 5, 7)
    assert not causal_mask_matches(keep, "drop", 5, 7) and not causal_mask_matches(~keep, "keep", 5, 7)
    assert not causal_mask_matches(torch.zeros(5, 7).masked_fill(~keep, -1e9), "add", 5, 7)
    assert not causal_mask_matches(torch.ones(5, 7, dtype=torch.bool).triu(2), "drop", 5, 7)
    per_head = (~keep).repeat(3, 1, 1)
    assert causal_mask_matches(per_head, "drop", 5, 7)
    per_head[1, 4, 0] = True
    assert not causal_mask_matches(per_head, "drop", 5, 7)


# ---- the binding's verdict --------------------------------------------------------------------------------------

def _library():
    """The emitted runtime's _KernelLibrary without a library behind it, its capture test and check counted."""
    namespace = binding_off_the_gpu("")
    checks = []
    check = namespace["causal_mask_matches"]
    namespace["causal_mask_matches"] = lambda *args: checks.append(1) or check(*args)
    lib = object.__new__(namespace["_KernelLibrary"])
    lib._causal_masks = {}
    lib.capturing = False
    lib._capturing = lambda t: lib.capturing
    return lib, checks


def test_the_verdict_is_cached_per_version_of_the_sources_and_never_found_in_a_capture():
    lib, checks = _library()
    bias = torch.ones(1, 1, 8, 8).tril()

    def verdict():
        return lib._causal_mask("a0", bias[:, :, :6, :6] == 0, (bias,), "drop", 6, 6)

    lib.capturing = True
    assert not verdict() and checks == []  # nothing found before the capture: the masked kernel, no check
    lib.capturing = False
    assert verdict() and verdict() and len(checks) == 1  # found once, then cached
    lib.capturing = True
    assert verdict() and len(checks) == 1  # a capture takes the verdict found before it
    lib.capturing = False
    with torch.no_grad():
        bias.fill_(1.0)  # in place: a new version
    assert not verdict() and len(checks) == 2
    with torch.no_grad():
        bias.copy_(torch.ones(1, 1, 8, 8).tril())
    lib.capturing = True
    assert not verdict() and len(checks) == 2  # changed since the last check: not checked inside a capture
    lib.capturing = False
    assert verdict() and len(checks) == 3
    other = torch.ones(1, 1, 8, 8).tril()  # another module's buffer: an entry of its own
    assert lib._causal_mask("a0", other[:, :, :6, :6] == 0, (other,), "drop", 6, 6) and len(checks) == 4
    assert verdict() and len(checks) == 4
    # a slice of another size of the same buffer version is another mask: checked, and cached beside the first
    assert lib._causal_mask("a0", bias[:, :, :4, :4] == 0, (bias,), "drop", 4, 4) and len(checks) == 5
    assert verdict() and len(checks) == 5
    checks.clear()
    # a mask of unknown origin, or made from an inference tensor: checked at every call, never in a capture
    assert lib._causal_mask("a0", bias[:, :, :6, :6] == 0, None, "drop", 6, 6) and len(checks) == 1
    with torch.inference_mode():
        frozen = torch.ones(1, 1, 8, 8).tril()
    assert lib._causal_mask("a0", frozen[:, :, :6, :6] == 0, (frozen,), "drop", 6, 6) and len(checks) == 2
    lib.capturing = True
    assert not lib._causal_mask("a0", frozen[:, :, :6, :6] == 0, (frozen,), "drop", 6, 6) and len(checks) == 2


# ---- the emitted file, its kernels emulated on the CPU ----------------------------------------------------------

MINGPT = """
def __init__(self):
    super().__init__()
    self.c_attn = nn.Linear(32, 96)
    self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

def forward(self, x):
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(32, dim=2)
    k = k.view(B, T, 2, 16).transpose(1, 2)
    q = q.view(B, T, 2, 16).transpose(1, 2)
    v = v.view(B, T, 2, 16).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / 4.0)
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
    att = F.softmax(att, dim=-1)
    y = att @ v
    return y.transpose(1, 2).contiguous().view(B, T, C)
"""


def test_emitted_file_runs_causal_until_the_buffer_changes(tmp_path):
    """The emitted ModelNew on the CPU (the attention kernels emulated, through the file's own binding): the causal
    kernel while the buffer is lower-triangular, the masked one after an in-place change (a strictly lower mask:
    each first row attends to nothing, NaN as eager; all ones: nothing masked), the causal one again once it is
    lower-triangular again; eager's results every time."""
    problem = load_problem(write_problem(tmp_path, "mingpt", MINGPT, "[torch.randn(2, 13, 32)]"))
    plan = make_plan(rewrite(capture(problem)))
    (step,) = plan.attention
    assert step.causal_guard is not None and step.math == "fma"
    sources = generate(plan)
    assert f"{step.kernel}_causal_launch" in sources.cuda and f"{step.kernel}_launch" in sources.cuda
    namespace: dict = {"__name__": "emitted"}
    exec(compile(emit_modelnew(problem, plan, sources, "test"), "emitted.py", "exec"), namespace)  # noqa: S102
    kernels = emulated(plan, tmp_path).kernels
    launched = []
    launch = kernels._launch
    kernels._launch = lambda function, *args: launched.append(function) or launch(function, *args)
    namespace["_extension"] = lambda: kernels
    namespace["_fallback_reason"] = lambda module, inputs: None  # the fused path on the CPU
    model = problem.make_model(seed=0)
    new = namespace["ModelNew"]()
    new.load_state_dict(model.state_dict())
    x = torch.randn(2, 13, 32)
    causal, masked = getattr(kernels, f"_{step.kernel}_causal"), getattr(kernels, f"_{step.kernel}")
    for bias, path in ((torch.ones(16, 16).tril(), causal), (torch.ones(16, 16).tril(-1), masked),
                       (torch.ones(16, 16), masked), (torch.ones(16, 16).tril(), causal)):
        with torch.no_grad():
            new.bias.copy_(bias.view(1, 1, 16, 16))
            model.bias.copy_(bias.view(1, 1, 16, 16))
            got, expected = new(x), model(x)
        assert launched[-1] is path
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, equal_nan=True)
    assert new.kernelfuse_stats()["fused_calls"] == 4


# ---- on the GPU -------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["kernels", "graphed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_causal_guard_matches_eager(dtype, graphed):
    """minGPT's attention (head dim 96, as KernelBench's level-3 44) through the in-process module on the GPU: the
    binding finds the mask causal (the verdict cached: the causal kernel ran) and the result matches eager (fp32
    eager on the same weights for bf16); after the buffer is changed in place (a band: the causal mask and a window
    of 40 keys) the masked kernel runs and still matches; graphed too (the warm-up call before each capture finds
    the verdict)."""
    import copy

    from kernelfuse.emit.module import build_module

    torch.manual_seed(0)
    model = Masked("causal", seq=300, width=192, heads=2).to(dtype)
    x = torch.randn(2, 257, 192, dtype=dtype)
    graph = rewrite(capture_module(model, [x]))
    plan = make_plan(graph)
    (step,) = plan.attention
    assert step.causal_guard is not None
    plan = plan.as_graphed() if graphed else plan
    model, x = model.cuda(), x.cuda()
    fused = build_module(model, plan, generate(plan))
    ext = type(fused).forward.__globals__["_extension"]()
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    ones = torch.ones(300, 300)
    for bias, verdict in ((ones.tril(), True), (ones.tril() * ones.triu(-40), False), (ones.tril(), True)):
        with torch.no_grad():
            model.bias.copy_(bias.view(1, 1, 300, 300))
            expected = copy.deepcopy(model).float()(x.float())
            for _ in range(3):  # graphed: a warm-up call, the capture, a replay
                got = fused(x)
                torch.testing.assert_close(got.float(), expected.float(), equal_nan=True, **tolerance)
        (entry,) = [v for k, v in ext._causal_masks.items() if k[0] == step.kernel]
        assert entry[2] is verdict and entry[1][0] is model.bias
    assert fused.kernelfuse_stats()["fused_calls"] == 9
