"""The attention rule: SDPA nodes and hand-written attention become one flash-attention step
(kernelfuse.plan.attention), proven in float64 through the plan interpreter; keys and values repeated per query
head read in place as grouped-query heads, a copy kept where an in-place op follows, minGPT's copies absorbed, the
plans' measured twins, attention left unfused (dropout in training, head dims over 256, scores read elsewhere), and
the `-sdpa` library variant's emitted forward against eager on the CPU. The generated kernels' tests are in
tests/test_attention_kernels.py; the cases in tests/attention_cases.py."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from attention_cases import CASES, Fn, planned, randn, repeat_kv, sdpa_fn

from kernelfuse.capture import capture_module
from kernelfuse.plan import PlanOptions, interpret, make_plan
from kernelfuse.plan.attention import SDPA
from kernelfuse.rewrite import rewrite


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_becomes_one_step_proven_in_float64(name):
    """The plan (one attention step, the rest torch calls and kernels), run in float64, computes the model."""
    model, inputs, graph, plan = planned(name, values=torch.float64)
    assert [s.origin for s in plan.attention] == [CASES[name][2]], plan.summary()
    ops = {graph[n].op for n in plan.attention[0].replaces}
    assert not ops & {"clone.default", "expand.default"} or CASES[name][2] == "hand-written" or \
        (name == "sdpakv_cache_d64" and ops == {SDPA, "clone.default"}) or \
        (name == "sdpa_repeat_kv_d32" and ops == {SDPA, "clone.default", "expand.default", "unsqueeze.default",
                                                   "_unsafe_view.default"} and plan.attention[0].dims[1:3] == (6, 2))
    with torch.no_grad():
        expected = model(*inputs)
        got = interpret(plan, {**dict(model.named_parameters()), **dict(model.named_buffers())}, inputs)[0]
    assert got.shape == expected.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, equal_nan=True)


def test_repeated_heads_are_read_in_place_only_where_the_attention_alone_reads_the_copy():
    """Keys and values repeated per query head (transformers' repeat_kv) are read as grouped-query heads by the
    kernel; torch's SDPA call (the library variant) reads the copies, and so does the kernel where the repeated keys
    are also returned or the values are not repeated alike."""
    def shared(m, q, k, v):
        b, hk, length, d = k.shape
        kr, vr = (t[:, :, None].expand(b, hk, 3, length, d).reshape(b, 3 * hk, length, d) for t in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr), kr

    def unlike(m, q, k, v):
        b, hk, length, d = k.shape
        kr = k[:, :, None].expand(b, hk, 3, length, d).reshape(b, 3 * hk, length, d)
        vr = v[:, :, None].expand(b, 3 * hk, 1, length, d).reshape(b, 3 * hk, length, d)
        return F.scaled_dot_product_attention(q, kr, vr)

    repeated = [randn(1, 6, 20, 16), randn(1, 2, 20, 16), randn(1, 2, 20, 16)]
    graph = rewrite(capture_module(Fn(repeat_kv), repeated))
    assert make_plan(graph).attention[0].dims[1:3] == (6, 2)
    # torch's SDPA call keeps reading the copies: with enable_gqa, fp32 SDPA falls back to its math backend
    library = make_plan(graph, PlanOptions(attention="library")).attention[0]
    assert library.impl == "library" and library.dims[1:3] == (6, 6)
    for fn, v_heads in ((shared, 2), (unlike, 6)):
        inputs = [randn(1, 6, 20, 16), randn(1, 2, 20, 16), randn(1, v_heads, 20, 16)]
        plan = make_plan(rewrite(capture_module(Fn(fn), inputs)))
        (step,) = plan.attention
        assert step.dims[1:3] == (6, 6) and plan.graph[step.k.ref].meta.shape[1] == 6, fn.__name__


def test_a_copy_protecting_keys_from_a_later_in_place_op_is_kept():
    """The KV cache's copy, then the keys mutated in place: attention reads the copy, not the mutated keys."""
    def fn(m, q, k, v):
        kc, vc = (torch.cat([t.new_zeros(0), t.transpose(1, 2)], -2) for t in (k, v))
        k.mul_(2.0)
        return F.scaled_dot_product_attention(q, kc, vc, is_causal=True)

    torch.manual_seed(0)
    inputs = [randn(1, 2, 67, 64), randn(1, 67, 2, 64), randn(1, 67, 2, 64)]
    model = Fn(fn)
    graph = rewrite(capture_module(model, [t.clone() for t in inputs]))
    plan = make_plan(graph)
    (step,) = plan.attention
    assert graph[step.k.ref].op == graph[step.v.ref].op == "clone.default"  # the copies, not the mutated keys
    model, inputs = model.double(), [t.double() for t in inputs]
    with torch.no_grad():
        expected = model(*[t.clone() for t in inputs])
        got = interpret(plan, {**dict(model.named_parameters()), **dict(model.named_buffers())},
                        [t.clone() for t in inputs])[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_handwritten_absorbs_every_copy_around_attention():
    """minGPT's form: the three copies feeding the bmms and the copy after them are the kernel's strides."""
    _, _, graph, plan = planned("handwritten_causal_d96")
    step = plan.attention[0]
    assert step.mask_kind == "drop" and step.empty_nan and step.k.swap
    assert [graph[n].op for n in step.replaces].count("clone.default") == 4
    assert graph[step.out].op == "clone.default" and step.out_meta.shape == (2, 70, 2, 96)
    assert not any(s.node.op == "clone.default" for s in plan.unfused)


@pytest.mark.parametrize("name, variants", [("sdpa_d32", ["fused", "fused-sdpa"]),
                                            ("handwritten_causal_d96", ["fused", "fused-3xtf32", "fused-sdpa"]),
                                            ("handwritten_relu_d64", ["fused", "fused-3xtf32"])])
def test_attention_plans_get_their_measured_twins(name, variants):
    """3xTF32 for hand-written fp32 attention (exact FMA in the first plan), one torch SDPA call for softmax
    attention (ReLU attention has none)."""
    from kernelfuse.plan import plan_variants

    *_, graph, _ = planned(name)
    assert [p.variant for p in plan_variants(graph)] == variants


def test_dropout_in_training_keeps_attention_unfused():
    def fn(m, q, k, v):
        att = torch.softmax(q @ k.transpose(-2, -1), -1)
        return F.dropout(att, 0.1, training=True) @ v

    q = torch.randn(1, 2, 8, 16)
    plan = make_plan(rewrite(capture_module(Fn(fn), [q, q.clone(), q.clone()])))
    assert not plan.attention
    sdpa = make_plan(rewrite(capture_module(Fn(sdpa_fn(dropout_p=0.1)), [q, q.clone(), q.clone()])))
    assert not sdpa.attention and "dropout" in sdpa.summary()


def test_head_dims_over_256_stay_sdpa_calls_with_the_reason():
    q = torch.randn(1, 2, 8, 320)
    plan = make_plan(rewrite(capture_module(Fn(sdpa_fn()), [q, q.clone(), q.clone()])))
    assert not plan.attention and "attention: head dim 320 over 256" in plan.summary()


def test_scores_read_elsewhere_keep_attention_unfused():
    def fn(m, q, k, v):
        att = torch.softmax(q @ k.transpose(-2, -1), -1)
        return att @ v, att

    q = torch.randn(1, 2, 8, 16)
    assert not make_plan(rewrite(capture_module(Fn(fn), [q, q.clone(), q.clone()]))).attention


# (the library variant of repeated heads keeps their copies, kernels of ours: test_repeated_heads_are_read_...;
# torch's SDPA has no soft cap: such a step keeps our kernel in it)
@pytest.mark.parametrize("name", sorted(n for n in CASES if "relu" not in n and "softcap" not in n and
                                      n != "sdpa_repeat_kv_d32"))
def test_library_variant_forward_matches_eager(name):
    """The `-sdpa` variant's emitted forward (one torch SDPA call on the same views, its result laid out as the
    step's output, NaN rows where the hand-written mask empties a row) run on the CPU against the model."""
    import types

    from kernelfuse.emit.calltext import call_text
    from kernelfuse.emit.forward import forward_source

    model, inputs, graph, _ = planned(name)
    plan = make_plan(graph, PlanOptions(attention="library"))
    assert plan.variant.endswith("-sdpa") and [a.impl for a in plan.attention] == ["library"]
    assert not plan.generated and not plan.fused, plan.summary()  # no kernel of ours: the forward runs on the CPU
    call = call_text(plan.graph.call_spec, str(inspect.signature(model.forward))[1:-1])
    namespace: dict = {"torch": torch}
    exec(forward_source(plan, call, has_kernels=False, guarded=False), namespace)  # noqa: S102 - emitted code
    for fn in [v for v in namespace.values() if isinstance(v, types.FunctionType)]:
        setattr(model, fn.__name__, types.MethodType(fn, model))
    with torch.no_grad():
        expected, got = Fn.forward(model, *inputs), model.forward(*inputs)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
