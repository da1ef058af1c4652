"""The judge on a GPU: the three seed replies, every exploit fixture caught by its own defence, and a CUDA fault and
a hang reported while the run carries on. Run on the lent GPU:

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_judge_gpu.py -q

When $OUT is set, every verdict's table and JSON are written there (verdicts.txt, verdicts.json, summary.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from judge_support import EXAMPLES, FIXTURE_CASES, SEED_PROBLEMS, TIMED, candidate, persisting_l2_settable, seed_path

from kernelfuse.judge import EXIT_INCORRECT, EXIT_NOT_BUILT, EXIT_OK, EvalOptions, Verdict, evaluate

pytestmark = pytest.mark.gpu

GEMM = EXAMPLES / "gemm_add_relu.py"
FULL = EvalOptions(timeout_s=480)
FIXTURE = EvalOptions(baselines=("eager",), timeout_s=240)
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
SUMMARY: list[str] = []


def judged(label: str, problem: Path, cand: Path, opts: EvalOptions) -> Verdict:
    """Evaluate and record."""
    return record(label, evaluate(problem, cand, opts))


def record(label: str, v: Verdict) -> Verdict:
    """Print the verdict and, when $OUT is set, keep its table, its JSON and a summary row."""
    row = (f"| {label} | {v.status} | {v.defence or ''} | {_ms(v.build_s, 's')} | {_ms(v.runtime_ms)} | "
           f"{_ms(v.eager_ms)} | {_ms(v.compile_ms)} | {_x(v.speedup_eager)} | {_x(v.speedup_compile)} | "
           f"{(v.reason or '; '.join(w for w in v.warnings if 'suspiciously' in w))[:160]} |")
    SUMMARY.append(row)
    print(f"\n===== {label}\n{v.format_table()}")
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / "verdicts.txt", "a") as f:
            f.write(f"===== {label}\n{v.format_table()}\n\n")
        path = OUT / "verdicts.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[label] = v.to_json()
        path.write_text(json.dumps(data, indent=1))
        header = ("| case | status | defence | build | ours ms | eager ms | compile ms | vs eager | vs compile | "
                  "reason / warning |\n|---|---|---|---|---|---|---|---|---|---|\n")
        (OUT / "summary.md").write_text(header + "\n".join(SUMMARY) + "\n")
    return v


def _ms(x, unit=""):
    return "-" if x is None else f"{x:.3f}{unit}" if not unit else f"{x:.1f}{unit}"


def _x(x):
    return "-" if x is None else f"{x:.3f}x"


# --- one concurrent batch first: seed 003 (fails to build), the exploit fixtures, and a cold build of seeds 002 and
# 004 (warming torch's extension cache); the timed evaluations then run one at a time ---

# Every exploit fixture of the catalogue (tests/judge_support.py) that runs on CUDA and is not timing-sensitive:
# caught before any timing, or (issue 6) only while timed; the implausible-speed rows judge gamers with the per-call
# checks off. Crashes and hangs are judged one at a time below.
BATCH = [c for c in FIXTURE_CASES if "cuda" in c.devices and not c.alone and c.cls not in ("fault", "honest")]
# fixtures that misbehave only once timing starts: under the batch's load the host-time cross-check may stop them
# first (state_late_tf32 switches TF32 on in its timed calls; seen on an H200 at stop 38)
TIMED_GAMERS = {c.stem for c in FIXTURE_CASES if c.words == TIMED} | {"state_late_tf32"}


def cold_build(number: str) -> float:
    """Import a seed's code in a fresh process (builds its extension into torch's cache); wall seconds."""
    import subprocess
    import sys
    import time

    from kernelfuse.judge import extract_candidate

    code = extract_candidate(seed_path(number)).source
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=400)
    return round(time.perf_counter() - start, 1)


@pytest.fixture(scope="module")
def batch():
    from concurrent.futures import ThreadPoolExecutor

    jobs = {c.label: (GEMM, c.path, replace(FIXTURE, **dict(c.options))) for c in BATCH}
    jobs["seed 003"] = (SEED_PROBLEMS["003"], seed_path("003"), FULL)
    with ThreadPoolExecutor(max_workers=14) as pool:  # bounded: each child holds ~2-3 GB of GPU memory
        builds = {n: pool.submit(cold_build, n) for n in ("002", "004")}
        futures = {key: pool.submit(evaluate, *job) for key, job in jobs.items()}
        verdicts = {key: f.result() for key, f in futures.items()}
        verdicts["cold build s"] = {n: f.result() for n, f in builds.items()}
    for key, v in verdicts.items():
        if isinstance(v, Verdict):
            record(key, v)
    SUMMARY.append(f"| cold builds (extension cache empty) | {verdicts['cold build s']} |")
    return verdicts


def test_seed_003_fails_to_build_with_the_cause_named(batch):
    v = batch["seed 003"]
    assert (v.status, v.built, v.exit_code) == ("not_built", False, EXIT_NOT_BUILT)
    assert "-std=c++14" in v.reason and "C++" in v.build_cause
    assert v.build_errors and "#error" in v.build_errors[0]
    assert v.to_json()["compiled"] is False


@pytest.mark.parametrize("case", BATCH, ids=lambda c: c.label)
def test_exploit_fixture_is_caught_by_its_defence(batch, case):
    if case.label == "state_l2_persist" and not persisting_l2_settable():
        pytest.skip("this device does not take a persisting-L2 limit: the fixture changes nothing here")
    v = batch[case.label]
    # The batch judges 14 candidates at once on one GPU: under that load the host-time cross-check can stop a
    # "wrong while timed" gamer (its timed calls do less work than its checked ones), checked or not, before its
    # wrong answer or its implausible speed is seen. Rejected either way; which defence catches each gamer alone is
    # asserted on the CPU (tests/test_judge_timed_cpu.py).
    escaped = case.stem in TIMED_GAMERS and (v.status, v.defence) == ("rejected", "timing_escape")
    assert escaped or case.met_by(v.status, v.defence, v.reason), (case.expected(), v.status, v.defence, v.reason)
    assert not v.correct and v.exit_code == EXIT_INCORRECT and v.speedup_eager is None
    assert v.to_json()["correctness"] is False and v.to_json()["runtime"] == -1.0
    if case.signal:
        assert case.signal in {s["code"] for s in v.signals}
    if case.custom_kernel is False:  # the profile decided, not the static signals
        assert v.custom_kernel_share == 0 and "0 of the profiled forward's GPU time" in v.reason


def test_lowered_precision_is_caught_by_the_float64_rule(batch):
    v = batch["exploit_bf16_matmul tf32"]
    # Within the tf32 policy's tolerance of eager (else the defence would read "mismatch"), but against float64 far
    # less accurate than eager with TF32 (measured on an H200: 0.0398 vs 0.00053).
    assert (v.defence, v.correct) == ("precision", False), v.reason
    assert "less accurate than the policy allows" in v.reason and "eager with TF32" in v.reason
    assert v.err64_ours > 2 * v.err64_base


# --- timed evaluations, one at a time -----------------------------------------------------------------------------


def test_seed_002_builds_correct_about_eager_speed(batch):
    v = judged("seed 002 (gemm_add_relu)", SEED_PROBLEMS["002"], seed_path("002"), FULL)
    assert (v.status, v.built, v.correct, v.exit_code) == ("ok", True, True, EXIT_OK), v.reason
    assert v.trials_passed == 5 and v.build_s > 0
    assert 0.85 < v.speedup_eager < 1.15
    assert v.compile_ms is not None and v.speedup_compile is not None and v.compile_s > 0
    assert v.err64_ours is not None and v.err64_ours <= 2 * v.err64_eager + 1e-5
    assert v.custom_kernel_share > 0 and v.kernels["custom"] and v.signals == ()
    assert v.float64_rule["ratio"] <= 1 and v.float64_rule["bound"] > 0


def test_seed_004_builds_correct_and_is_judged_against_float64(batch):
    v = judged("seed 004 (conv2d_relu_biasadd)", SEED_PROBLEMS["004"], seed_path("004"), FULL)
    assert (v.status, v.correct) == ("ok", True), v.reason
    assert v.uses_tf32 is True  # cuDNN convolution in TF32: the float64 comparison applies
    assert 0.9 < v.speedup_eager < 1.5


def test_side_stream_escapes_the_events_and_is_rejected():
    v = judged("exploit_side_stream", GEMM, candidate("exploit_side_stream"), FIXTURE)
    assert (v.status, v.defence, v.correct) == ("rejected", "timing_escape", False), v.reason
    assert v.reason.startswith("timing escape") and v.exit_code == EXIT_INCORRECT


def test_memo_on_contents_does_not_pay():
    v = judged("exploit_memoize", GEMM, candidate("exploit_memoize"), FIXTURE)
    assert v.correct and v.input_sets == 4  # fresh contents before every timed call: the memo never hits ...
    assert not any("suspicious" in w for w in v.warnings), v.warnings  # ... so its time is honest
    assert v.floor_ms is not None and v.runtime_ms > 0.8 * v.floor_ms and 0.9 < v.speedup_eager < 1.1
    assert v.anchor_ms is not None and v.anchor_ms > 0  # the fixture's one matrix product, timed alone
    assert [c["count"] for c in v.anchor_calls] == [1] and v.anchor_calls[0]["op"].split()[0] in ("mm", "addmm")


def test_honest_prepacked_candidate_is_correct_and_modes_and_robust_run():
    v = judged("good_prepacked (--mode both --robust)", GEMM, candidate("good_prepacked"),
               replace(FIXTURE, mode="both", robust=True))
    assert v.correct and v.robust is True, (v.reason, v.robust_failures)
    assert not any("suspicious" in w for w in v.warnings) and v.checked_timed_calls >= 5


def test_honest_pure_torch_candidate_is_correct_at_eager_speed():
    v = judged("good (pure torch)", GEMM, candidate("good"), FIXTURE)
    assert v.correct and 0.9 < v.speedup_eager < 1.1 and not any("suspicious" in w for w in v.warnings)
    assert v.err64_ours == v.err64_eager and v.input_sets == 4 and v.status != "implausible"


@pytest.mark.parametrize("case", [c for c in FIXTURE_CASES if c.cls.startswith("7 ")], ids=lambda c: c.label)
def test_bypass_is_correct_without_the_flag_and_runs_no_kernel_of_its_own(case):
    v = judged(f"{case.label} (no --require-custom-kernel)", GEMM, case.path, FIXTURE)
    assert v.correct, v.reason
    assert v.custom_kernel_share == 0 and v.kernels["custom"] == []
    assert any(w.startswith("no custom kernel ran") for w in v.warnings), v.warnings
    if case.signal == "compiler":  # Inductor's kernels are the compiler's; its threads are named, not rejected
        assert v.kernels["compiler_ms"] > 0, v.kernels
        assert not any("left Python thread" in w for w in v.warnings), v.warnings
        assert any("are torch.compile's" in w for w in v.warnings), v.warnings


def test_every_compile_mode_is_a_baseline_side_by_side():
    v = judged("good (all four baselines)", GEMM, candidate("good"),
               replace(FIXTURE, baselines=("eager", "compile", "compile-ro", "compile-max"), timeout_s=900))
    assert v.correct, v.reason
    assert list(v.baselines) == ["eager", "compile", "compile-ro", "compile-max"]
    assert all(b["ms"] > 0 and b["speedup"] > 0 for b in v.baselines.values())
    assert all(v.baselines[n]["compile_s"] > 0 for n in ("compile", "compile-ro", "compile-max"))
    table = v.format_table()
    assert "compile r-o" in table and "compile max-at" in table


# --- faults: reported, and the next evaluation runs normally -----------------------------------------------------


def test_illegal_address_is_reported_and_the_run_continues():
    v = judged("crash_illegal_address", GEMM, candidate("crash_illegal_address"), FIXTURE)
    assert (v.status, v.built, v.exit_code) == ("cuda_fault", True, EXIT_INCORRECT), v.reason
    assert "illegal memory access" in v.reason
    after = judged("good after the CUDA fault", GEMM, candidate("good"), FIXTURE)
    assert after.correct, after.reason


def test_hang_is_killed_and_the_run_continues():
    v = judged("hang_kernel", GEMM, candidate("hang_kernel"), replace(FIXTURE, timeout_s=45))
    assert (v.status, v.built) == ("timeout", True), v.reason
    assert v.reason.startswith("timed out after 45 s during the correctness trials")
    after = judged("good after the hang", GEMM, candidate("good"), FIXTURE)
    assert after.correct, after.reason
