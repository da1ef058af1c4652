"""Candidates that pass while running no kernel of their own, and causes named truly (issue 7), on the CPU.

The static signals flag each bypass class; `--require-custom-kernel` fails it without running it (no kernel can
run on the CPU); the candidates that must keep their verdict (honest ones) keep it. The GPU half (kernel accounting,
custom_kernel_share) is in tests/test_judge_gpu.py.
"""

from __future__ import annotations

import ast
import os
import threading
from dataclasses import replace

import pytest
from judge_support import FIXTURE_CASES, TINY, candidate, evaluate_many, find_seed

from kernelfuse.judge import EvalOptions
from kernelfuse.judge.bypass import bypass_signals
from kernelfuse.judge.cli import main as eval_main
from kernelfuse.judge.guard import TORCH_DIR, compiler_threads, new_threads, python_threads, record_thread_origins
from kernelfuse.judge.options import parse_baselines

CPU = EvalOptions(device="cpu", baselines=("eager",), timing_reps=3, warmup=1, trials=3, timeout_s=120)
SIGNALLED = [c for c in FIXTURE_CASES if c.signal]
BYPASS = [c for c in FIXTURE_CASES if c.cls.startswith("7 ")]
NO_CACHE = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"


def signal_codes(path) -> set[str]:
    return {s.code for s in bypass_signals(ast.parse(path.read_text()))}


@pytest.mark.parametrize("case", SIGNALLED, ids=lambda c: c.label)
def test_each_bypass_raises_its_signal(case):
    assert case.signal in signal_codes(case.path)


@pytest.mark.parametrize("number", ["002", "004"])
def test_seed_replies_with_kernels_raise_no_signal(number):
    from kernelfuse.judge import extract_candidate

    path = find_seed(number)
    if path is None:
        pytest.skip("seed replies not found")
    assert bypass_signals(ast.parse(extract_candidate(path).source)) == ()


def test_emitted_kernelfuse_file_raises_no_signal(tmp_path):
    from kernelfuse.capture import capture
    from kernelfuse.load import load_problem
    from kernelfuse.pipeline import emit_file
    from kernelfuse.plan import plan_variants
    from kernelfuse.rewrite import rewrite

    problem = load_problem(TINY)
    plan = next(p for p in plan_variants(rewrite(capture(problem)), "strict") if p.fused or p.generated)
    assert bypass_signals(ast.parse(emit_file(problem, plan, "test"))) == ()


def test_signal_details():
    src = ("import torch\nfrom torch import compile as c\ntry:\n    import triton\nexcept ImportError:\n"
           "    raise\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return c(torch.relu)(x)\n")
    signals = bypass_signals(ast.parse(src), line_offset=10)
    assert [(s.code, s.line) for s in signals] == [("compiler", 19), ("no_kernel_source", 0)]
    triton = "import triton\n@triton.jit\ndef k(x):\n    pass\nclass ModelNew:\n    pass\n"
    assert bypass_signals(ast.parse(triton)) == ()


@pytest.fixture(scope="module")
def verdicts():
    jobs = {c.label: (TINY, c.path, replace(CPU, **dict(c.options))) for c in BYPASS}
    for name in ("bypass_pure_pytorch", "bypass_compile_in_forward", "extra_buffer_wrong", "exploit_zero_inputs_first",
                 "good"):
        jobs[f"{name} plain"] = (TINY, candidate(name), CPU)
    jobs["bf16 tf32"] = (TINY, candidate("exploit_bf16_matmul"), replace(CPU, precision="tf32"))
    jobs["zero timed"] = (TINY, candidate("exploit_zero_inputs_timed"), replace(CPU, timing_reps=20))
    # Inductor compiles cold (its cache would skip the compile workers whose threads are to be named)
    previous = os.environ.get(NO_CACHE)
    os.environ[NO_CACHE] = "1"
    try:
        return evaluate_many(jobs)
    finally:
        os.environ.pop(NO_CACHE) if previous is None else os.environ.update({NO_CACHE: previous})


@pytest.mark.parametrize("case", BYPASS, ids=lambda c: c.label)
def test_require_custom_kernel_fails_each_bypass_on_the_cpu(verdicts, case):
    v = verdicts[case.label]
    assert case.met_by(v.status, v.defence, v.reason), (v.status, v.defence, v.reason)
    assert v.exit_code == 1 and not v.correct and "static signals" in v.reason
    assert case.signal in {s["code"] for s in v.to_json()["signals"]}


def test_without_the_flag_a_bypass_is_correct_and_flagged(verdicts):
    v = verdicts["bypass_pure_pytorch plain"]
    assert v.correct and [s["code"] for s in v.signals] == ["no_kernel_source"]
    assert v.custom_kernel_share is None  # no GPU profiled it
    assert "signal      no_kernel_source" in v.format_table()


def test_torch_compile_in_forward_is_named_not_rejected_for_its_threads(verdicts):
    v = verdicts["bypass_compile_in_forward plain"]  # Inductor compiles on the CPU too (about 45 s here)
    assert v.correct, v.reason
    assert "compiler" in {s["code"] for s in v.signals}
    assert v.details.get("compiler_threads"), v.warnings  # its compile-worker pool started threads ...
    assert any("are torch.compile's (Inductor's compile workers)" in w for w in v.warnings)  # ... named as such


def test_honest_candidate_is_unchanged(verdicts):
    v = verdicts["good plain"]
    assert (v.status, v.defence) == ("ok", None) and v.params_match


@pytest.mark.parametrize("label", ["extra_buffer_wrong plain", "exploit_zero_inputs_first plain", "zero timed"])
def test_true_causes_meet_the_catalogue(verdicts, label):
    stem = {"zero timed": "exploit_zero_inputs_timed"}.get(label, label.removesuffix(" plain"))
    case = next(c for c in FIXTURE_CASES if c.label == stem)
    v = verdicts[label]
    assert case.met_by(v.status, v.defence, v.reason), (case.expected(), v.status, v.defence, v.reason)


def test_extra_zero_buffer_is_no_weight_mismatch(verdicts):
    v = verdicts["extra_buffer_wrong plain"]
    assert (v.status, v.defence) == ("incorrect", "mismatch"), v.reason
    assert v.params_match and "same seed" not in v.reason
    assert "offset" in v.details["params"]["summary"] and "the output decides" in v.details["params"]["summary"]


def test_zeroing_inputs_first_is_named_input_mutation(verdicts):
    v = verdicts["exploit_zero_inputs_first plain"]
    assert (v.status, v.defence) == ("incorrect", "inputs_modified") and "modified its input(s) [0]" in v.reason


def test_zeroing_inputs_while_timed_is_named_input_mutation(verdicts):
    v = verdicts["zero timed"]
    assert (v.status, v.defence) == ("incorrect", "inputs_modified"), v.reason
    assert v.reason.startswith("timed call") and "modified its input(s) [0]" in v.reason


def test_float64_rule_numbers_are_in_the_verdict(verdicts):
    ok = verdicts["good plain"].to_json()["float64_rule"]
    assert ok["passed"] and 0 <= ok["ratio"] <= 1 and ok["bound"] >= ok["ours_err"]
    assert ok["bound"] == pytest.approx(ok["slack_factor"] * ok["base_err"] + ok["slack_rel"] * ok["ref_scale"])
    assert 0 < ok["mean_ours_err"] <= ok["ours_err"] and 0 < ok["mean_base_err"] <= ok["base_err"]
    v = verdicts["bf16 tf32"]
    rule = v.float64_rule
    assert v.defence == "precision" and not rule["passed"] and rule["ratio"] > 1
    assert f"ours at {rule['ratio']:.3f} of the bound" in v.reason
    assert "of it" in v.format_table()


def test_require_flag_on_the_command_line(capsys):
    code = eval_main([str(TINY), str(candidate("bypass_subclass_reference")), "--device", "cpu",
                      "--require-custom-kernel"])
    assert code == 1 and "no custom kernel ran" in capsys.readouterr().out


def test_compile_worker_threads_are_named_not_escaping():
    record_thread_origins()
    before = python_threads()
    done = threading.Event()
    namespace = {"threading": threading, "done": done}
    fake = os.path.join(TORCH_DIR, "_inductor", "compile_worker", "fake_pool.py")
    exec(compile("def start():\n    t = threading.Thread(target=done.wait, name='fake-compile-worker')\n"
                 "    t.start()\n    return t\n", fake, "exec"), namespace)
    inductor = namespace["start"]()
    mine = threading.Thread(target=done.wait, name="candidate-thread")
    mine.start()
    try:
        assert compiler_threads(before) == ["fake-compile-worker"]
        assert new_threads(before) == ["candidate-thread"]
    finally:
        done.set()
        inductor.join()
        mine.join()


def test_baseline_names():
    assert parse_baselines("eager, compile-ro,compile-max") == ("eager", "compile-ro", "compile-max")
    with pytest.raises(ValueError, match="choose from eager,compile,compile-ro,compile-max"):
        parse_baselines("eager,jit")


def test_parameter_check_compares_what_the_seed_produces():
    import torch

    from kernelfuse.verify import compare_state

    class Net(torch.nn.Module):
        def __init__(self, extra: bool = False, mask: bool = True, stat: bool = True) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))
            if mask:
                self.register_buffer("mask", torch.ones(3), persistent=False)
            if stat:
                self.register_buffer("stat", torch.zeros(3))
            if extra:
                self.register_buffer("offset", torch.zeros(3), persistent=False)

    torch.manual_seed(0)
    ref = Net()
    for kwargs, ok in (({"extra": True}, True), ({"mask": False}, True), ({"stat": False}, False)):
        torch.manual_seed(0)
        check = compare_state(ref, Net(**kwargs))
        assert check.ok is ok, (kwargs, check)
        assert ("the output decides" in check.summary()) is ok
