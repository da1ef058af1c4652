"""The differential fuzzer's generator and shrinker: models deterministic per seed and index, covering the vocabulary
(every op kind, dtype, layout and special value); its attention forms, growing concatenations and CNN stacks
planned as the optimizer plans them (one attention kernel, one shared cat buffer, a channels-last graph with
cuDNN's conv+bias+ReLU); generated files valid problems whose recorded shapes are eager's; the shrinker reaching
the one failing op and keeping a dead value the failure needs. The runner and CLI: tests/test_fuzz_runner.py; the
regression files: tests/test_fuzz_regressions.py."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from fuzz_helpers import BATCH, _write

from kernelfuse.capture import build_model, capture
from kernelfuse.fuzz.generate import InputSpec, ModelSpec, OpSpec, generate, materialize, render
from kernelfuse.fuzz.layers import ATTENTION_FORMS
from kernelfuse.fuzz.ops import KINDS
from kernelfuse.fuzz.run import run_problem
from kernelfuse.fuzz.shrink import shrink
from kernelfuse.load import load_problem
from kernelfuse.plan import Plan, TorchStep, make_plan, optimizer_variants
from kernelfuse.rewrite import apply_rules, rewrite


def test_generator_is_deterministic_per_seed_and_index():
    assert render(generate(5, 17)) == render(generate(5, 17))
    assert render(generate(5, 17)) != render(generate(5, 18))
    assert render(generate(5, 17)) != render(generate(6, 17))


def test_generated_models_cover_the_vocabulary():
    specs = [generate(0, i) for i in range(BATCH)]
    kinds = Counter(op.kind for s in specs for op in s.ops)
    assert set(kinds) == set(KINDS), f"never drawn: {set(KINDS) - set(kinds)}"
    assert {s.dtype for s in specs} == {"float32", "float16", "bfloat16"}
    assert {s.training for s in specs} == {True, False}
    assert {i.layout for s in specs for i in s.inputs} == {"contiguous", "transposed", "sliced", "permuted"}
    assert {i.special for s in specs for i in s.inputs} == {"", "nan", "inf", "large"}
    assert any(len(set(op.args)) == 2 for s in specs for op in s.ops), "no op reads two model values"
    assert any(dict(op.params).get("fn") == "gated" for s in specs for op in s.ops), "no gated MLP"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_each_attention_form_of_the_vocabulary_becomes_one_kernel(form, dtype, tmp_path):
    """The vocabulary's attention forms (SDPA, minGPT's, with a bias, autocast's fp32 softmax, Swin's shifted
    windows; with these parameters the hand-written ones soft-capped over key/value heads repeated as
    transformers' eager attention does) are what the planner fuses: one attention kernel each, the fuzzer's CPU
    checks passing."""
    params = (("form", form), ("heads", 2), ("windows", 2))
    spec = ModelSpec(0, 0, dtype, False, (InputSpec((4, 9, 16)),), (OpSpec("attention", (0,), params),), (1,))
    path = _write(tmp_path, spec)
    run = run_problem(path)
    assert run.outcome.status == "ok", run.outcome.describe()
    text = run.emitted[0].text if run.emitted else ""
    assert text.count("(flash attention)") == 1, text[:2000]


def test_the_cat_chain_kind_runs_in_eager_and_a_dense_block_shares_one_buffer(tmp_path):
    """The growing concatenation (kernelfuse.fuzz.catchain), drawn for several seeds (both forms, several dims and
    pieces): eager runs each rendered model at the shape drawn. A list-form draw of a DenseNet block (a 1x1
    convolution, then reductions, along the channels) is planned as one shared buffer (kernelfuse.plan.catbuffer):
    the first concatenation allocates the last one's buffer, each copies only its new piece."""
    def chain(seed: int, shape: tuple[int, ...], params: dict) -> tuple[Path, tuple[int, ...]]:
        op = OpSpec("cat_chain", (0,), tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
        spec = ModelSpec(0, seed, "float32", False, (InputSpec(shape),), (op,), (1,))
        return _write(tmp_path, spec), materialize(spec).shapes[1]

    draws = [(s, (2, 6, 3, 4) if s % 2 else (5, 7), KINDS["cat_chain"].draw(random.Random(s), [])) for s in range(8)]
    assert {p["nested"] for _, _, p in draws} == {True, False}
    for seed, shape, params in draws:
        path, out_shape = chain(seed, shape, params)
        problem = load_problem(path)
        with torch.no_grad():
            assert tuple(problem.make_model()(*problem.make_inputs(0)).shape) == out_shape
    params = {**draws[0][2], "k": 3, "d": 1, "nested": False, "pieces": [5, 0, 1, 2], "grow": [2, 1, 1, 1], "leak": ""}
    problem = load_problem(chain(8, (2, 6, 3, 4), params)[0])
    plan = make_plan(rewrite(capture(problem, build_model(problem))))
    shared = [(s.into.buffer, s.into.first, [o for _, o in s.into.copies]) for s in plan.steps
              if isinstance(s, TorchStep) and s.into is not None]
    assert shared == [("cat_2", True, [0, 6]), ("cat_2", False, [8]), ("cat_2", False, [9])], plan.summary()


def _cnn_stack(tmp_path: Path, seed: int, shape: tuple[int, ...], params: dict, training: bool = False
               ) -> tuple[Path, tuple[int, ...]]:
    op = OpSpec("cnn_stack", (0,), tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    spec = ModelSpec(0, seed, "float32", training, (InputSpec(shape),), (op,), (1,))
    return _write(tmp_path, spec), materialize(spec).shapes[1]


def _channels_last_plan(path: Path) -> Plan | None:
    problem = load_problem(path)
    plans = optimizer_variants(apply_rules(capture(problem, build_model(problem))).graph)
    return next((p for p in plans if p.variant == "fused-cl"), None)


def test_the_cnn_stack_kind_runs_in_eager_and_reaches_the_channels_last_graph(tmp_path):
    """The CNN body (kernelfuse.fuzz.cnnstack), drawn for several seeds on 4-d and 5-d inputs (maps of 1-16
    positions a side, both modes): eager runs each rendered model at the shape drawn. One drawn body of 2-d stages
    (conv -> ReLU, conv -> ReLU -> average pool, conv -> batch norm -> ReLU -> max pool, then a flatten for a
    linear layer) is planned with a channels-last graph (`fused-cl`) whose inner pool writes channels-last, whose
    convolutions followed by a ReLU they alone read are cuDNN's conv+bias+ReLU, and whose flatten reads a
    contiguous copy; the fuzzer's CPU checks pass. With the first convolution's output also read elsewhere (the
    leak), its ReLU stays apart."""
    shapes = [(2, 3, 8, 8), (1, 1, 1, 16), (3, 12, 5, 7), (2, 2, 4, 6, 6), (16, 3, 4, 4), (1, 2, 1, 3, 9)]
    draws = [(s, shapes[s % len(shapes)], KINDS["cnn_stack"].draw(random.Random(s), [])) for s in range(12)]
    assert {p["tail"] for _, _, p in draws} >= {"flatten", "view", "map"}
    for seed, shape, params in draws:
        path, out_shape = _cnn_stack(tmp_path, seed, shape, params, training=seed % 2 == 1)
        problem = load_problem(path)
        with torch.no_grad():
            assert tuple(problem.make_model()(*problem.make_inputs(0)).shape) == out_shape

    params = {**draws[0][2], "stages": 3, "out": [6, 8, 5, 1], "k": [3, 3, 1, 1], "pad": [1, 1, 0, 0],
              "stride": [1, 1, 1, 1], "groups": [1, 2, 1, 1], "bias": [True, False, True, True],
              "after": ["r", "rp", "brp", ""], "relu": [0, 1, 2, 0], "pool": ["max", "avg", "max", "max"],
              "pk": [2, 3, 2, 2], "ps": [0, 1, 0, 0], "pp": [0, 1, 0, 0], "ceil": [False, True, True, False],
              "cip": [False, False, False, False], "leak": False, "tail": "flatten", "classes": 10}
    path, _ = _cnn_stack(tmp_path, 99, (2, 3, 8, 8), params)
    plan = _channels_last_plan(path)
    assert plan is not None
    pools = [s for s in plan.generated if s.spec is not None and s.spec.kind in ("max_pool", "avg_pool")]
    # the average pool writes channels-last; the max pool's kernel takes in the flatten's copy: it writes NCHW
    assert [s.pools_channels_last for s in pools] == [True, False], plan.summary()
    fused_relu = [s for s in plan.fused if s.anchor.fused_relu]
    assert len(fused_relu) == 2, plan.summary()
    assert any(n.name.endswith("_contiguous") and n.op == "clone.default" for n in plan.graph.nodes), plan.summary()
    run = run_problem(path)
    assert run.outcome.status == "ok", run.outcome.describe()
    leaking = _channels_last_plan(_cnn_stack(tmp_path, 100, (2, 3, 8, 8), {**params, "leak": True, "at": 0})[0])
    assert leaking is not None
    assert [s.anchor.node.name for s in leaking.fused if s.anchor.fused_relu] == \
        [s.anchor.node.name for s in fused_relu[1:]], leaking.summary()


def test_the_generator_draws_models_whose_channels_last_plan_has_a_pool_and_a_conv_relu(tmp_path):
    """Among a seed's first models, one with the cnn_stack kind gets a `fused-cl` plan holding both a pool that
    writes channels-last and cuDNN's conv+bias+ReLU on channels-last operands (19 of that seed's first 1000 do)."""
    for index in range(400):
        spec = generate(93000, index)
        if not any(op.kind == "cnn_stack" for op in spec.ops):
            continue
        plan = _channels_last_plan(_write(tmp_path, spec))
        if plan is not None and any(s.pools_channels_last for s in plan.generated) \
                and any(s.anchor.fused_relu for s in plan.fused):
            return
    pytest.fail("no model of seed 93000's first 400 has both")


def test_generated_files_are_valid_problems(tmp_path):
    """Each file loads, eager runs it on its own inputs (dtype, strides, NaN where drawn), every op's value is
    used and the shapes the generator recorded are eager's."""
    for i in range(12):
        spec = generate(1, i)
        problem = load_problem(_write(tmp_path, spec))
        inputs = problem.make_inputs(0)
        assert [tuple(t.shape) for t in inputs] == [x.shape for x in spec.inputs]
        assert all(t.dtype == getattr(torch, spec.dtype) for t in inputs)
        model = problem.make_model()
        assert model.training == spec.training
        with torch.no_grad():
            out = model(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        shapes = materialize(spec).shapes
        assert [tuple(o.shape) for o in outs] == [shapes[o] for o in spec.outputs]


def test_shrinker_reaches_the_one_op_that_fails():
    spec = next(s for s in (generate(2, i) for i in range(50)) if len(s.ops) >= 6
                and any(op.kind == "reduce" for op in s.ops))
    small = shrink(spec, lambda s: any(op.kind == "reduce" for op in s.ops))
    assert [op.kind for op in small.ops] == ["reduce"]
    assert len(small.inputs) == 1 and small.dtype == "float32" and not small.training
    assert small.inputs[0].layout == "contiguous" and not small.inputs[0].special
    materialize(small)  # still a valid model


def _dead(spec: ModelSpec) -> list[int]:
    """Ops whose value nothing reads and no output returns."""
    n = len(spec.inputs)
    return [k for k in range(len(spec.ops))
            if n + k not in spec.outputs and all(n + k not in op.args for op in spec.ops)]


def test_shrinker_keeps_a_dead_value_the_failure_needs():
    """A value nothing reads can be what breaks the planner (the trimmed-view bug): pruning dead ops is only a
    candidate, never forced on every step."""
    spec = next(s for s in (generate(7, i) for i in range(500)) if _dead(s))  # the first with a dead value
    small = shrink(spec, lambda s: bool(_dead(s)))
    assert _dead(small) and len(small.ops) < len(spec.ops)
