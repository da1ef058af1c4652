"""Build logs and exit statuses turned into causes."""

from __future__ import annotations

import signal

from judge_support import FIXTURES

from kernelfuse.judge.diagnose import (
    describe_exit,
    diagnose_build,
    diagnose_build_file,
    is_cuda_fault,
    key_error_lines,
    tail,
)

SEED003_LOG = FIXTURES / "logs" / "seed003_build_cxx14.log"


def test_seed003_cause_is_the_cxx14_flag():
    diag = diagnose_build_file(SEED003_LOG, ["-std=c++14"])
    assert "-std=c++14" in diag.cause and "torch's headers require C++" in diag.cause
    assert "#error" in diag.key_lines[0] and "C++" in diag.key_lines[0]
    assert all("site-packages" not in line for line in diag.key_lines)


def test_flag_is_found_in_the_failed_command_without_being_told():
    diag = diagnose_build_file(SEED003_LOG)
    assert "-std=c++14" in diag.cause


def test_key_lines_are_deduplicated_and_capped():
    lines = ["a.cu(3): error: identifier \"foo\" is undefined\n"] * 50 + [f"x.h:{i}: error: e{i}\n" for i in range(30)]
    key, commands = key_error_lines(lines)
    assert len(key) == 8 and key[0].startswith("a.cu(3)") and commands == []


def test_generic_and_link_causes():
    assert diagnose_build(["k.cu(1): error: expected a ';'\n"]).cause.startswith("compiler error: k.cu(1)")
    assert diagnose_build(["ImportError: x.so: undefined symbol: _Z3foov\n"]).cause.startswith("link error")
    assert "no compiler error line" in diagnose_build(["all fine\n"]).cause


def test_describe_exit():
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV (segmentation fault)"
    assert describe_exit(3) == "exited with status 3"


def test_cuda_fault_messages():
    assert is_cuda_fault("CUDA error: an illegal memory access was encountered")
    assert is_cuda_fault("RuntimeError: CUDA error: unspecified launch failure")
    assert not is_cuda_fault("ValueError: shapes do not match")


def test_tail_of_a_large_file(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i}\n" for i in range(200_000)))
    assert tail(path, 2) == "line 199998\nline 199999"
