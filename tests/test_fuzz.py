"""The differential fuzzer: its generator, shrinker and CLI, a fixed-seed batch of random models through the
CPU checks, an nvcc sample, and the regression files of the bugs it found."""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

import kernelfuse.fuzz.cli as fuzz_cli
import kernelfuse.fuzz.device as device
from kernelfuse.capture import build_model, capture
from kernelfuse.fuzz.generate import InputSpec, ModelSpec, OpSpec, generate, materialize, render
from kernelfuse.fuzz.layers import ATTENTION_FORMS
from kernelfuse.fuzz.ops import KINDS
from kernelfuse.fuzz.run import Outcome, run_problem
from kernelfuse.fuzz.shrink import shrink
from kernelfuse.load import load_problem
from kernelfuse.plan import Plan, TorchStep, make_plan, optimizer_variants
from kernelfuse.rewrite import apply_rules, rewrite

REGRESSIONS = sorted((Path(__file__).parent / "fixtures" / "problems" / "fuzz").glob("*.py"))
BATCH = 300


def _write(tmp_path: Path, spec: ModelSpec) -> Path:
    path = tmp_path / f"{spec.name}.py"
    path.write_text(render(spec))
    return path


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
    windows) are what the planner fuses: one attention kernel each, the fuzzer's CPU checks passing."""
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


# models of the batch below known to be ill-conditioned, each kept as an open regression file (OPEN) with its
# diagnosis: seed 0 model 149 is tests/fixtures/problems/fuzz/batch_norm_of_constant_channel.py
ILL_CONDITIONED = {"fuzz_s0_i149"}


def test_fixed_seed_batch_passes_the_cpu_checks(tmp_path, capsys):
    """300 random models through the whole pipeline and the CPU checks (interpreter vs eager on the models' own
    inputs, the emitted files run): no crash, and no mismatch but the known ill-conditioned models'."""
    fuzz_cli.main(["--count", str(BATCH), "--seed", "0", "--cpu-only", "--out", str(tmp_path / "fail")])
    lines = capsys.readouterr().out.strip().splitlines()
    failed = {line.split()[1].rstrip(":") for line in lines if line.startswith("FAIL ")}
    assert failed <= ILL_CONDITIONED, "\n".join(lines[-30:])
    assert lines[-1] == f"{BATCH} models, {len(failed)} mismatches, 0 crashes", "\n".join(lines[-30:])


def test_a_failure_is_shrunk_written_and_fails_the_run(tmp_path, capsys, monkeypatch):
    """A crash in a model with a softmax: exit 1, the last line counts it, and the file written holds a shrunk
    model (the softmax alone) whose header says the failure."""
    real = fuzz_cli._Checker.classify

    def fake(checker, path: Path):  # noqa: ANN001
        run = real(checker, path)
        if "softmax(" in path.read_text():
            run.outcome = Outcome("crash", "plan", "ValueError: planted")
        return run

    monkeypatch.setattr(fuzz_cli._Checker, "classify", fake)
    code = fuzz_cli.main(["--count", "40", "--seed", "3", "--cpu-only", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    crashes = int(out[-1].split(", ")[2].split()[0])
    assert code == 1 and crashes >= 1 and out[-1].startswith("40 models, 0 mismatches")
    assert len(list(tmp_path.glob("*_crash.py"))) == crashes  # each failing model as generated, when found
    written = list(tmp_path.glob("*_crash_min.py"))
    assert len(written) == 1  # one distinct failure, one shrunk file
    text = written[0].read_text()
    assert "FAILURE (crash at plan): ValueError: planted" in text
    assert text.count(" = ") - text.count("self.") <= 2  # forward: the softmax (plus its input line)
    load_problem(written[0])


_KILLER = """import os, signal
import torch
import torch.nn as nn

CALLS = [0]


class Model(nn.Module):
    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] > {after}:
            os.kill(os.getpid(), signal.SIGSEGV)
        return x * 2


def get_inputs():
    return [torch.randn(4)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(("after", "status", "stage"), [(0, "invalid", "eager"), (1, "crash", "process")])
def test_a_model_that_kills_the_process_is_classified_and_the_run_goes_on(tmp_path, after, status, stage):
    """A segfault (seen inside torch itself) ends only the stages' child process. Where eager's own forward kills
    a fresh process the model is invalid; where only kernelfuse's stages did (here: the second forward call, the
    capture), it is a crash. The next model gets a fresh child."""
    killer = tmp_path / "killer.py"
    killer.write_text(_KILLER.format(after=after))
    checker = fuzz_cli._Checker(tmp_path, None, False)
    try:
        dead = checker.classify(killer).outcome
        fine = checker.classify(_write(tmp_path, generate(0, 0))).outcome
    finally:
        checker.close()
    assert (dead.status, dead.stage) == (status, stage), dead.describe()
    assert "SIGSEGV" in dead.reason
    assert fine.status in ("ok", "unsupported"), fine.describe()


def test_models_are_drawn_in_the_child_as_in_process(tmp_path):
    """Drawing runs each op on real tensors (torch itself has segfaulted there: seed 32000, model 5382, on
    torch 2.14.1's CPU build), so the child draws; its spec is the one drawn here."""
    checker = fuzz_cli._Checker(tmp_path, None, False)
    try:
        assert [checker.generate(7, i) for i in range(3)] == [generate(7, i) for i in range(3)]
    finally:
        checker.close()


def test_time_limit_stops_early(tmp_path, capsys):
    code = fuzz_cli.main(["--count", "100000", "--seed", "0", "--cpu-only", "--time", "0", "--out", str(tmp_path)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == "0 models, 0 mismatches, 0 crashes"
    assert code == 0


OPEN: dict[str, str] = {  # regression files not passing yet: expected failures, by file stem
    "batch_norm_of_constant_channel": "ill-conditioned: a training batch norm of a constant channel amplifies the "
                                      "channels-last convolution's one-ulp differences past the float64 rule",
}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=OPEN[p.stem]))
                                  if p.stem in OPEN else p for p in REGRESSIONS], ids=[p.stem for p in REGRESSIONS])
def test_fuzz_regression_passes(path):
    run = run_problem(path)
    assert run.outcome.status == "ok", run.outcome.describe()
    nvcc = device.find_nvcc()
    if nvcc is None:
        return
    errors = device.compile_all([e.cuda for e in run.emitted if e.cuda], nvcc)
    assert errors == {}


@pytest.mark.gpu
@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_fuzz_regression_matches_eager_on_the_gpu(path, tmp_path):
    """Every regression file's every emitted variant, built and run on the GPU against eager (the fuzzer's GPU
    check: the judge's tolerance or its float64 rule), planned as the fuzzer plans on a GPU (each convolution's
    layout and TF32 use measured: unmeasured, a channels-last variant rounds to TF32 where eager did not, which the
    optimizer's judge would reject)."""
    run = run_problem(path, measure_layouts=True)
    assert run.outcome.status == "ok", run.outcome.describe()
    for e in run.emitted:
        emitted = tmp_path / f"{path.stem}_{e.variant.replace('-', '_')}_new.py"
        emitted.write_text(e.text)
        assert device.gpu_check(path, emitted) == "", e.variant


def test_nvcc_compiles_a_sample_of_random_models(monkeypatch):
    nvcc = device.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    monkeypatch.setattr(device, "CACHE", Path(tempfile.mkdtemp(prefix="kf_fuzz_cache_")))  # compile for real
    sources: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        i = 0
        while len(sources) < 10:
            run = run_problem(_write(Path(tmp), generate(11, i)))
            i += 1
            assert run.outcome.status in ("ok", "unsupported"), run.outcome.describe()
            sources += [e.cuda for e in run.emitted if e.cuda][:1]
    errors = device.compile_all(sources, nvcc)
    assert len(list(device.CACHE.glob("*.ok"))) == len(set(sources)) - len(errors)
    assert errors == {}


def test_gpu_pool_answers_every_task_and_replaces_a_dead_worker(tmp_path):
    """The pool's protocol, runnable without a GPU: one answer per task, in order; a model that kills its worker
    costs only its own answer (here: no CUDA, so every other answer says what raised)."""
    dies = tmp_path / "dies.py"
    dies.write_text("import os\nos._exit(3)\n")
    fine = _write(tmp_path, generate(0, 0))
    pool = device.GpuPool(tmp_path, jobs=1)
    try:
        answers = pool.check_all([(fine, fine), (dies, fine), (fine, fine)])
    finally:
        pool.close()
    assert len(answers) == 3 and all(answers)
    assert "worker died" in answers[1] and "exit 3" in answers[1]
    if not torch.cuda.is_available():
        assert answers[0].startswith("the emitted file raised on the GPU") and answers[2] == answers[0]


@pytest.mark.gpu
def test_random_models_match_eager_on_the_gpu(tmp_path, capsys):
    """64 random models built and run on the GPU against eager (the judge's tolerance or its float64 rule)."""
    code = fuzz_cli.main(["--count", "64", "--seed", "0", "--shrink-time", "0", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "GPU build and forward" in lines[0]
    assert lines[-1] == "64 models, 0 mismatches, 0 crashes", "\n".join(lines[-20:])
    assert code == 0


def test_a_clean_refusal_is_unsupported_not_a_crash(tmp_path):
    """Data-dependent control flow cannot be captured: kernelfuse says so (a KernelfuseError), which the fuzzer
    counts apart from failures."""
    path = tmp_path / "branchy.py"
    path.write_text("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
                    "        return x * 2 if x.sum() > 0 else x\n\n\ndef get_inputs():\n"
                    "    return [torch.randn(4)]\n\n\ndef get_init_inputs():\n    return []\n")
    outcome = run_problem(path).outcome
    assert (outcome.status, outcome.stage) == ("unsupported", "capture") and not outcome.failed, outcome.describe()


_DRIFTING = """import torch
import torch.nn as nn

CALLS = [0]


class Model(nn.Module):
    def forward(self, x):
        CALLS[0] += 1
        return {value}


def get_inputs():
    return [torch.randn(4)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(("value", "status"), [
    ("x * 2 + CALLS[0]", "invalid"),  # a module-level counter: a copy of the model shares it
    ("x * 2 + torch.empty(16384)[8000:8004]", "invalid"),  # memory never written, as torch's bf16 Conv3d read
    ("x * 2", "ok"),
], ids=["counter", "uninitialised", "deterministic"])
def test_an_eager_reference_that_differs_between_identical_calls_makes_the_model_invalid(tmp_path, value, status):
    """Eager, called twice on the same inputs, weights and seed, must give the same values (NaN where NaN):
    torch's own CPU bf16 Conv3d has not (it read uninitialised memory: seed 85000, model 192), and a mismatch
    against such a reference says nothing about kernelfuse. A deterministic model is checked as before."""
    path = tmp_path / "drifting.py"
    path.write_text(_DRIFTING.format(value=value))
    outcome = run_problem(path).outcome
    assert outcome.status == status and not outcome.failed, outcome.describe()
    if status == "invalid":
        assert outcome.stage == "eager", outcome.describe()
        assert outcome.reason.startswith("eager reference not deterministic: two identical eager calls differ (")


def test_the_cpu_checks_reference_divides_by_a_number_as_cuda_does():
    """x / c on CUDA is x * (1/c) with 1/c in float32; the CPU check's reference computes the same, and only that
    (a division by a tensor stays a division)."""
    from kernelfuse.verify.cuda_eager import CudaScalarDivision

    x, y = torch.randn(4096), torch.rand(4096) + 0.5
    with CudaScalarDivision():
        by_number, by_tensor = x / 3.0, x / y
    inverse = torch.tensor(1.0) / torch.tensor(3.0)
    assert torch.equal(by_number, x * inverse.item()) and not torch.equal(by_number, x / 3.0)
    assert torch.equal(by_tensor, x / y)


def test_an_fp32_output_of_a_half_precision_model_is_judged_at_the_half_tolerance():
    # `x + x.float()` in a bf16 model returns fp32 computed from bf16 roundings: the inputs' dtype counts too
    from kernelfuse.fuzz.run import loosest_tolerance
    table = {torch.bfloat16: 1e-2}
    assert loosest_tolerance([torch.ones(2, dtype=torch.bfloat16), torch.ones(2)], table, 1e-5) == 1e-2
    assert loosest_tolerance([torch.ones(2), (torch.ones(2), [torch.ones(1)])], table, 1e-5) == 1e-5
    assert loosest_tolerance([3, None], table, 1e-5) == 1e-5
