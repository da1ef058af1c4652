"""The optimizer's GPU decisions, with the judge replaced by scripted verdicts (the decision logic runs on CPU).

Ships the fastest verified variant only if it beats eager; a variant that fails is dropped; when nothing fused
verifies or pays, the unfused file (the original ops) ships and the notes say why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

import kernelfuse.choose as choose
import kernelfuse.pipeline as pipeline
from kernelfuse.bench.layout import LayoutTiming
from kernelfuse.judge import Verdict
from kernelfuse.pipeline import OptimizeOptions, optimize_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _verdict(correct: bool, ms: float | None = None, eager: float = 4.0) -> Verdict:
    return Verdict(problem="p", candidate="c", code_from="file", precision="strict",
                   status="ok" if correct else "incorrect", built=True, correct=correct,
                   reason=None if correct else "5 of 5 trials failed", runtime_ms=ms if correct else None,
                   eager_ms=eager, speedup_eager=(eager / ms) if correct and ms else None)


def without_gemm_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer's variants without the 3xTF32-GEMM twins (`-tcgemm`), for tests about the other plans."""
    every = pipeline.optimizer_variants
    monkeypatch.setattr(pipeline, "optimizer_variants",
                        lambda *a, **k: [p for p in every(*a, **k) if "-tcgemm" not in p.variant])


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, problem: str | Path, script: dict[str, Verdict],
         layouts: dict[str, tuple] | None = None, options: OptimizeOptions | None = None,
         patch: Callable[[], None] = lambda: None) -> tuple:
    """`layouts`: each convolution's scripted (NCHW ms, channels-last ms[, fp32]); None: not measurable."""
    judged: list[str] = []

    def fake_evaluate(problem_path: Path, candidate: Path, options: object) -> Verdict:
        text = candidate.read_text()
        variant = "unfused" if "unfused (the original ops)" in text else \
            re.search(r"plan variant: ([\w+-]+)", text).group(1)
        judged.append(variant)
        return script[variant]

    monkeypatch.setattr(choose, "evaluate", fake_evaluate)
    if not any("-tcgemm" in v for v in script):  # a test that scripts no GEMM twin judges the plans without one
        without_gemm_twins(monkeypatch)
    monkeypatch.setattr(choose, "prebuild", lambda files, timeout_s=0: None)
    timings = None if layouts is None else [LayoutTiming(n, *t) for n, t in layouts.items()]
    monkeypatch.setattr(pipeline, "measure_conv_layouts", lambda graph, strict: timings)
    monkeypatch.setattr(choose.torch.cuda, "get_device_name", lambda *a: "scripted GPU")
    patch()  # a test's own stand-ins, over the defaults above
    out = tmp_path / "out.py"
    path = problem if isinstance(problem, Path) else EXAMPLES / f"{problem}.py"
    result = optimize_file(path, out, options or OptimizeOptions(use_gpu=True),
                           log=lambda s: None)
    return result, out.read_text(), judged


def test_the_own_gemm_ships_where_it_is_fastest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused": _verdict(True, 2.8, eager=2.8), "fused-tcgemm": _verdict(True, 2.6, eager=2.8),
              "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert result.shipped == "fused-tcgemm" and sorted(judged[:2]) == ["fused", "fused-tcgemm"]
    assert "GEMM on tensor cores (3xTF32" in text and "kf_gemm_3xtf32" in text


def test_fastest_verified_variant_ships(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused-nhwc": _verdict(True, 1.7), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}
    result, text, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script)
    assert result.shipped == "fused-nhwc"
    assert "ext.to_channels_last" in text
    assert judged == ["fused-nhwc", "fused-nchw", "fused-igemm", "fused-nhwc"]  # three variants, the final check


def test_generated_convolution_ships_where_it_is_fastest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The implicit-GEMM variant is judged with the library ones even where the layouts were measured (no layout
    timing predicts it), and ships where it is the fastest."""
    script = {"fused-nhwc": _verdict(True, 1.7), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 1.2),
              "unfused": _verdict(True, 4.0)}
    result, text, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                                layouts={"convolution": (3.0, 2.0)})
    assert judged == ["fused-nhwc", "fused-nchw", "fused-igemm", "fused-igemm"] and result.shipped == "fused-igemm"
    assert "cudnn_convolution_relu" not in text and "ext.k0(" in text


@pytest.mark.parametrize(("nchw_ms", "nhwc_ms", "variant", "library"),
                         [(3.0, 2.0, "fused-nhwc", ["fused-nhwc", "fused-nchw"]),
                          (3.0, 2.9, "fused-nchw", ["fused-nchw"])])
def test_measured_layout_makes_the_first_variant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nchw_ms: float,
                                                 nhwc_ms: float, variant: str, library: list[str]) -> None:
    script = {"fused-nhwc": _verdict(True, 1.7 if variant == "fused-nhwc" else 2.5),
              "fused-nchw": _verdict(True, 1.7 if variant == "fused-nchw" else 2.5),
              "fused-igemm": _verdict(True, 3.0), "unfused": _verdict(True, 4.0)}
    result, text, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                                layouts={"convolution": (nchw_ms, nhwc_ms)})
    assert result.shipped == variant and judged == [*library, "fused-igemm", variant]  # the measured layout first
    assert ("ext.to_channels_last" in text) == (variant == "fused-nhwc")


def test_measured_plan_that_fails_falls_back_to_nchw(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused-nhwc": _verdict(False), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(False),
              "unfused": _verdict(True, 4.0)}
    result, text, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                                layouts={"convolution": (3.0, 2.0, True)})
    assert judged == ["fused-nhwc", "fused-nchw", "fused-igemm", "fused-nchw"] and result.shipped == "fused-nchw"
    assert "ext.to_channels_last" not in text


def test_norm_reading_a_channels_last_convolution_judges_both_layouts(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The convolution alone measured faster channels-last, but a group norm reads its output: the timing does
    not decide, both plans are judged whole and the faster one ships (level-2 60: the norm 3.9 ms channels-last)."""
    from optimizer_helpers import write_problem

    path = write_problem(tmp_path, "conv_gn", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3)
            self.gn = nn.GroupNorm(4, 16)

        def forward(self, x):
            return self.gn(self.conv(x))
        """, "[torch.rand(2, 3, 16, 16)]")
    script = {"fused-nhwc": _verdict(True, 3.0), "fused-nchw": _verdict(True, 2.0), "fused-igemm": _verdict(True, 2.5),
              "unfused": _verdict(True, 4.0)}
    result, _, judged = _run(monkeypatch, tmp_path, path, script, layouts={"convolution": (3.0, 2.0)})
    # the runner-up within 25% of the fastest: both timed again before the choice, then the final check
    assert judged == ["fused-nhwc", "fused-nchw", "fused-igemm", "fused-nchw", "fused-igemm", "fused-nchw"]
    assert result.shipped == "fused-nchw"


def test_fp32_convolution_runs_without_tf32(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused-nhwc": _verdict(True, 1.7), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}
    result, text, _ = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                           layouts={"convolution": (3.0, 2.0, True)})
    assert result.shipped == "fused-nhwc"
    assert "_without_tf32(lambda: torch.cudnn_convolution_relu(ext.to_channels_last(" in text
    assert "torch.backends.cudnn.allow_tf32 = previous" in text  # the flag is restored after the call


def test_failing_variant_is_dropped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused-nhwc": _verdict(False), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}
    result, text, _ = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script)
    assert result.shipped == "fused-nchw"
    assert "ext.to_channels_last" not in text and "cudnn_convolution_relu" in text


def test_no_verified_variant_ships_unfused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused": _verdict(False), "fused-tcgemm": _verdict(False), "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, _ = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert result.shipped == "unfused"
    assert any("no fused variant verified" in n for n in result.notes), result.notes
    assert "def forward(self, x):" in text and "_extension" not in text


def test_fusion_that_does_not_pay_ships_unfused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused": _verdict(True, 2.9, eager=2.8), "fused-tcgemm": _verdict(True, 2.95, eager=2.8),
              "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, _ = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert result.shipped == "unfused"
    assert any("does not pay" in n and "0.966x" in n for n in result.notes), result.notes
    assert "CUDA_SRC" not in text


def test_single_variant_is_judged_once_with_every_baseline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    problem = tmp_path / "pointwise.py"  # one plan: no convolution layouts, no Linear for the -tcgemm twin
    problem.write_text("import torch\n\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
                       "        return torch.sigmoid(x) * 2.0 + 1.0\n\n\ndef get_inputs():\n"
                       "    return [torch.randn(64, 128)]\n\n\ndef get_init_inputs():\n    return []\n")
    script = {"fused": _verdict(True, 2.7, eager=2.8), "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, problem, script)
    assert result.shipped == "fused" and judged == ["fused"] and result.final is script["fused"]
    assert "CUDA_SRC" in text and "verified on scripted GPU" in text


def test_final_check_failure_never_ships_the_fused_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = {"n": 0}
    good, bad = _verdict(True, 2.7, eager=2.8), _verdict(False)

    def fused_then_fails() -> Verdict:
        calls["n"] += 1
        return good if calls["n"] == 1 else bad

    class Script(dict):
        def __getitem__(self, key: str) -> Verdict:
            return fused_then_fails() if key == "fused-nhwc" else super().__getitem__(key)

    script = Script({"fused-nhwc": good, "fused-nchw": _verdict(True, 2.75, eager=2.8),
                     "fused-igemm": _verdict(True, 2.76, eager=2.8), "unfused": _verdict(True, 2.8, eager=2.8)})
    result, text, _ = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script)
    assert result.shipped == "unfused"
    assert any("final check" in n for n in result.notes)
    assert "CUDA_SRC" not in text


def test_prebuild_kills_a_stuck_build(tmp_path: Path) -> None:
    import os

    pid_file = tmp_path / "stuck.pid"
    stuck = tmp_path / "stuck.py"
    stuck.write_text(f"import os, time\n\ndef _extension():\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                     "    time.sleep(600)\n")
    fine = tmp_path / "fine.py"
    fine.write_text("def _extension():\n    open(__file__ + '.built', 'w').close()\n")
    choose.prebuild([stuck, fine], timeout_s=3.0)
    assert (tmp_path / "fine.py.built").exists()
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed with its session, and reaped by prebuild
        os.kill(pid, 0)


def test_cpu_check_off_leaves_verification_to_the_judge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kernelfuse bench's judge phase: no CPU interpreter check and no second round of builds on the GPU
    worker's path; the judge still judges every plan before one ships, and a failing one is still dropped."""
    def refuse(what: str):  # noqa: ANN202 - a stand-in that fails the test when called
        def called(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"{what} ran")
        return called

    monkeypatch.setattr(pipeline, "check_plans", refuse("the CPU check"))
    script = {"fused-nhwc": _verdict(False), "fused-nchw": _verdict(True, 2.5), "fused-igemm": _verdict(True, 3.0),
              "unfused": _verdict(True, 4.0)}
    result, _, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script,
                             options=OptimizeOptions(use_gpu=True, cpu_check=False, prebuild=False),
                             patch=lambda: monkeypatch.setattr(choose, "prebuild", refuse("prebuild")))
    assert result.shipped == "fused-nchw" and result.cpu_checks == [] and result.cold_build_s is None
    assert judged[:2] == ["fused-nhwc", "fused-nchw"]


def test_a_variant_timed_slow_once_is_timed_again_before_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # level-3 8 in the suite (stop 51): the first variant judged beside the next problem's builds measured 1.040 ms
    # against the runner-up's 0.974, where a profile alone gave 0.797 against 0.934
    times = {"a": [1.040, 0.800], "b": [0.974, 0.950], "c": [2.0]}
    plans = {name: SimpleNamespace(variant=name) for name in times}
    monkeypatch.setattr(choose, "evaluate",
                        lambda problem, path, options: _verdict(True, times[path.name].pop(0)))
    judged = [(plans[n], _verdict(True, times[n].pop(0))) for n in ("a", "b", "c")]
    problem = SimpleNamespace(path=Path("p.py"))
    files = {n: Path(n) for n in times}
    plan, verdict = choose._retimed_best(problem, judged, files, choose.EvalOptions(), lambda line: None)
    assert plan.variant == "a" and times == {"a": [], "b": [], "c": []}  # c, 2x slower, is not timed again
    only = choose._retimed_best(problem, judged[2:], files, choose.EvalOptions(), lambda line: None)
    assert only[0].variant == "c"


def test_a_variant_timed_on_a_busy_machine_is_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its eager baseline, the same model each time, ran 2x slower than another variant's (level-3 MobileNetV2 in
    the suite, stop 52: the first variant 10.0 ms beside eager's 9.9, eager 4.9 for a later variant): timed again,
    it wins. A variant 2x slower beside an eager baseline as quick as the rest is not timed again."""
    times = {"first": [10.0, 4.5], "b": [5.0, 4.9], "c": [10.5]}
    eager = {"first": 9.9, "b": 4.9, "c": 5.0}
    plans = {name: SimpleNamespace(variant=name) for name in times}
    monkeypatch.setattr(choose, "evaluate",
                        lambda problem, path, options: _verdict(True, times[path.name].pop(0), 4.9))
    judged = [(plans[n], _verdict(True, times[n].pop(0), eager[n])) for n in ("first", "b", "c")]
    files = {n: Path(n) for n in times}
    plan, _ = choose._retimed_best(SimpleNamespace(path=Path("p.py")), judged, files, choose.EvalOptions(),
                                   lambda line: None)
    assert plan.variant == "first" and times == {"first": [], "b": [], "c": []}
