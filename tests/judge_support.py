"""Paths shared by the judge's tests, the example problems and the seed replies, and the catalogue of candidate
fixtures with the verdict the judge must give each (read by the tests and by benchmarks/judge_table.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CANDIDATES = FIXTURES / "candidates"
PROBLEMS = FIXTURES / "problems"
TINY = PROBLEMS / "tiny_gemm_add_relu.py"
EXAMPLES = REPO / "examples"
SEED_DIRS = (REPO.parent / "shared" / "seeds", REPO / ".device_carry" / "seeds")
SEED_PROBLEMS = {
    "002": EXAMPLES / "gemm_add_relu.py",
    "003": EXAMPLES / "gemm_sigmoid_scaling_residualadd.py",
    "004": EXAMPLES / "conv2d_relu_biasadd.py",
}
CUDA_ONLY = ("cuda",)


def find_seed(number: str, folders: tuple[Path, ...] = SEED_DIRS) -> Path | None:
    """The seed reply whose name starts with `number` (002, 003, 004) in the first folder holding one, or None."""
    for folder in folders:
        found = sorted(folder.glob(f"{number}_*.txt")) if folder.is_dir() else []
        if found:
                  return found[0]
    return None


def seed_path(number: str) -> Path:
    """The seed reply whose name starts with `number` (002, 003, 004); skips the test when the seeds are absent."""
    import pytest

    found = find_seed(number)
    if found is None:
        pytest.skip(f"seed reply {number} not found in {', '.join(str(d) for d in SEED_DIRS)}")
    return found


def persisting_l2_settable() -> bool:
    """Can this process set a persisting-L2 limit at all? (Seen not to take effect on a gVisor H100 host: there the
    fixture's call changes nothing, so it gains nothing and there is nothing to catch.)"""
    from kernelfuse.judge.devicestate import _cudart, _l2_limit

    lib = _cudart()
    if lib is None:
        return False
    import torch

    torch.cuda.init()
    before = _l2_limit()
    err = lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(4 << 20))
    after = _l2_limit()
    lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(int(before) if before.isdigit() else 0))
    return err == 0 and after != before


def candidate(name: str) -> Path:
    return CANDIDATES / f"{name}.py"


@dataclass(frozen=True)
class FixtureCase:
    """A candidate fixture and the verdict the judge must give it on the fixture problem (the GEMM example on CUDA,
    its tiny copy on the CPU). `label` names the case (the fixture's stem unless `fixture` is given); `options`
    overrides EvalOptions fields; `also` lists other acceptable (status, defence) pairs with why in the fixture's
    docstring; `alone`: timing-sensitive (a floor or host-time check decides), judged with nothing else running;
    `words` must appear in the reason; `signal`: the static bypass signal its source must raise (judge.bypass);
    `custom_kernel`: whether the GPU's kernel accounting must find kernels of its own (True: share > 0, False:
    share 0; None: not asserted)."""

    label: str
    cls: str
    status: str
    defence: str | None
    words: str = ""
    devices: tuple[str, ...] = ("cuda", "cpu")
    fixture: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    also: tuple[tuple[str, str], ...] = ()
    alone: bool = False
    signal: str | None = None
    custom_kernel: bool | None = None

    @property
    def path(self) -> Path:
        return candidate(self.stem)

    @property
    def stem(self) -> str:
        """The fixture file's stem."""
        return self.fixture or self.label

    def expected(self) -> str:
        return f"{self.status}/{self.defence}" if self.defence else self.status

    def met_by(self, status: str, defence: str | None, reason: str | None) -> bool:
        """Whether a verdict (status, defence, reason) is the one this case expects."""
        if (status, defence) in self.also:
            return True
        return (status, defence) == (self.status, self.defence) and self.words in (reason or "")


C1, C2, C3, C5, C6 = "1 timed calls", "2 plain outputs", "3 rotating inputs", "5 determinism", "6 device state"
C7, C8 = "7 no custom kernel", "8 true causes"
REQUIRE = (("require_custom_kernel", True),)
NO_KERNEL = "no custom kernel ran"
UNCHECKED = (("call_checks", False),)
TIMED = "correct while checked, wrong while timed"
DIFFER = "two runs of the candidate on the same inputs differ"
# Every candidate fixture, grouped by the issue-6 class it belongs to ("older": the exploits before issue 6;
# "fault": crashes and hangs; "honest": must stay CORRECT). Class 4 (implausible speed) has no fixture of its own: a
# candidate faster than the floor while correct would be a better floor; its rows judge the gamers with the per-call
# checks off, where the implausible-speed verdict is what stops them.
FIXTURE_CASES = (
    FixtureCase("timed_call_count", C1, "incorrect", "timed_output_mismatch", TIMED),
    FixtureCase("timed_stack_inspect", C1, "incorrect", "timed_output_mismatch", TIMED),
    FixtureCase("timed_caller_frame", C1, "incorrect", "timed_output_mismatch", TIMED),
    FixtureCase("timed_clock", C1, "incorrect", "timed_output_mismatch", TIMED, options=(("timing_reps", 80),),
                also=(("incorrect", "nondeterministic"), ("incorrect", "mismatch"))),
    FixtureCase("output_subclass", C2, "incorrect", "output_type", "a tensor subclass"),
    FixtureCase("output_torch_function", C2, "incorrect", "output_type", "not a tensor overriding __torch_function__"),
    FixtureCase("output_dispatch_wrapper", C2, "incorrect", "output_type",
                "overriding __torch_function__ and __torch_dispatch__"),
    FixtureCase("output_lazy_proxy", C2, "incorrect", "output_type", "not a tensor"),
    FixtureCase("output_alias_input", C2, "incorrect", "output_alias", "shares storage with an input"),
    FixtureCase("output_alias_buffer", C2, "incorrect", "output_alias", "shares storage with a parameter"),
    FixtureCase("memo_data_ptr", C3, "incorrect", "timed_output_mismatch", TIMED),
    FixtureCase("memo_content_sum", C3, "incorrect", "timed_output_mismatch", TIMED),
    FixtureCase("exploit_memoize", C3, "ok", None, alone=True),  # the memo never hits: CORRECT at its honest speed
    FixtureCase("memo_data_ptr unchecked", "4 implausible speed", "implausible", "implausible", "implausible:",
                CUDA_ONLY, "memo_data_ptr", UNCHECKED),
    FixtureCase("exploit_memoize unchecked", "4 implausible speed", "implausible", "implausible", "implausible:",
                CUDA_ONLY, "exploit_memoize", UNCHECKED),
    FixtureCase("timed_call_count unchecked", "4 implausible speed", "implausible", "implausible", "implausible:",
                CUDA_ONLY, "timed_call_count", UNCHECKED),
    FixtureCase("nondet_noise", C5, "incorrect", "nondeterministic", DIFFER),
    FixtureCase("nondet_clock", C5, "incorrect", "nondeterministic", DIFFER),
    FixtureCase("nondet_uninit_cuda", C5, "incorrect", "poisoned_memory", "output not fully written", CUDA_ONLY),
    FixtureCase("state_tf32_in_forward", C6, "incorrect", "device_state", "matmul TF32: False -> True"),
    FixtureCase("state_matmul_precision", C6, "incorrect", "device_state", "matmul TF32: False -> True"),
    FixtureCase("state_late_tf32", C6, "rejected", "device_state", "a timed call left the device state changed"),
    FixtureCase("state_stream_in_forward", C6, "incorrect", "device_state", "current CUDA stream", CUDA_ONLY),
    FixtureCase("state_l2_persist", C6, "incorrect", "device_state", "persisting L2 cache limit", CUDA_ONLY),
    FixtureCase("exploit_steal_freed_output", "older", "incorrect", "poisoned_memory", "output not fully written",
                CUDA_ONLY),
    FixtureCase("exploit_zero_inputs", "older", "incorrect", "inputs_modified", "modified its input(s) [0] in place"),
    FixtureCase("exploit_cached_output", "older", "incorrect", "stale_output", "same output as in trial 0"),
    FixtureCase("exploit_patch_allclose", "older", "rejected", "tamper", "torch.Tensor.__eq__, torch.allclose"),
    FixtureCase("exploit_patch_timer", "older", "rejected", "tamper", "torch.cuda.Event.elapsed_time"),
    FixtureCase("exploit_tf32_flag", "older", "rejected", "precision_flags", "matmul TF32: False -> True"),
    FixtureCase("exploit_thread", "older", "incorrect", "threads", "late-gemm"),
    FixtureCase("exploit_bf16_matmul tf32", "older", "incorrect", "precision", "less accurate than the policy allows",
                fixture="exploit_bf16_matmul", options=(("precision", "tf32"),)),
    FixtureCase("exploit_bf16_matmul strict", "older", "incorrect", "mismatch", fixture="exploit_bf16_matmul"),
    FixtureCase("exploit_side_stream", "older", "rejected", "timing_escape", "timing escape", CUDA_ONLY, alone=True),
    FixtureCase("wrong_output", "fault", "incorrect", "mismatch", "elements outside atol=0.0001"),
    FixtureCase("renamed_params", "fault", "incorrect", "parameters", "missing: gemm.weight; extra: linear.weight"),
    FixtureCase("raise_in_forward", "fault", "runtime_error", None, "fused kernel not implemented"),
    FixtureCase("raise_at_import", "fault", "not_built", None, "import failed at line 14"),
    FixtureCase("exit_at_import", "fault", "not_built", None, "sys.exit(3)"),
    FixtureCase("hard_exit_in_init", "fault", "not_built", None, "exited with status 7"),
    FixtureCase("segfault_at_import", "fault", "not_built", None, "SIGSEGV"),
    FixtureCase("syntax_error", "fault", "not_built", None),
    FixtureCase("no_model_new", "fault", "not_built", None),
    FixtureCase("hang_at_import", "fault", "not_built", None, "timed out after 30 s during import",
                options=(("timeout_s", 30.0),)),
    FixtureCase("crash_illegal_address", "fault", "cuda_fault", None, "illegal memory access", CUDA_ONLY),
    FixtureCase("hang_kernel", "fault", "timeout", None, "timed out after 45 s during the correctness trials",
                CUDA_ONLY, options=(("timeout_s", 45.0),), alone=True),
    # issue 7: correct candidates that run no kernel of their own, judged with --require-custom-kernel (without it
    # they stay CORRECT, flagged by their signal and, on a GPU, custom_kernel_share 0: tests/test_judge_gpu.py)
    FixtureCase("bypass_subclass_reference", C7, "incorrect", "no_custom_kernel", NO_KERNEL, options=REQUIRE,
                signal="subclasses_reference", custom_kernel=False),
    FixtureCase("bypass_try_fallback", C7, "incorrect", "no_custom_kernel", NO_KERNEL, options=REQUIRE,
                signal="fallback_to_torch", custom_kernel=False),
    FixtureCase("bypass_compile_in_forward", C7, "incorrect", "no_custom_kernel", NO_KERNEL, options=REQUIRE,
                signal="compiler", custom_kernel=False),
    FixtureCase("bypass_pure_pytorch", C7, "incorrect", "no_custom_kernel", NO_KERNEL, options=REQUIRE,
                signal="no_kernel_source", custom_kernel=False),
    # issue 7: the cause named must be the true one
    FixtureCase("extra_buffer_wrong", C8, "incorrect", "mismatch", "elements outside atol"),
    FixtureCase("exploit_zero_inputs_first", C8, "incorrect", "inputs_modified", "modified its input(s) [0] in place"),
    FixtureCase("exploit_zero_inputs_timed", C8, "incorrect", "inputs_modified", "timed call",
                options=(("timing_reps", 20),)),
    FixtureCase("good", "honest", "ok", None, alone=True, signal="no_kernel_source", custom_kernel=False),
    FixtureCase("good_prepacked", "honest", "ok", None, alone=True, options=(("mode", "both"), ("robust", True))),
)


def evaluate_many(jobs: dict) -> dict:
    """Run `evaluate(problem, candidate, opts)` for each job at once (each in its own child process) and return
    {key: Verdict}; a job may also be a list of such triples, run one after the other (its last verdict returned
    under the key, all of them under (key, i)). Keeps the CPU suite fast: the children mostly wait on imports."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from kernelfuse.judge import evaluate

    def run(job):
        steps = job if isinstance(job, list) else [job]
        return [evaluate(*step) for step in steps]

    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        futures = {key: pool.submit(run, job) for key, job in jobs.items()}
        results = {}
        for key, future in futures.items():
            verdicts = future.result()
            results[key] = verdicts[-1]
            for i, v in enumerate(verdicts):
                results[(key, i)] = v
    return results
