"""Static checks: what the judge can say without running anything."""

from __future__ import annotations

import pytest
from judge_support import TINY, seed_path

from kernelfuse.judge import extract_candidate, static_check
from kernelfuse.load import load_problem


@pytest.fixture(scope="module")
def problem():
    return load_problem(TINY)


GOOD = """
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()

    def forward(self, x):
        return x
"""


def test_good_source_passes(problem):
    report = static_check(GOOD, problem)
    assert report.ok and report.warnings == ()
    assert report.init_params == ("in_features", "out_features", "bias_shape")


def test_syntax_error_names_the_reply_line(problem):
    report = static_check("x = (\n", problem, line_offset=100)
    assert not report.ok and report.errors[0].startswith("syntax error at line 10")


def test_missing_model_new(problem):
    report = static_check("import torch\nclass Model: pass\n", problem)
    assert not report.ok and "no top-level ModelNew" in report.errors[0]


def test_model_new_by_assignment_counts(problem):
    assert static_check("import torch\nclass A: pass\nModelNew = A\n", problem).ok


def test_signature_mismatch_warns(problem):
    report = static_check(GOOD.replace("in_features, out_features, bias_shape", "a, b"), problem)
    assert report.ok and "does not match Model.__init__(in_features, out_features, bias_shape)" in report.warnings[0]
    renamed = static_check(GOOD.replace("in_features, out_features, bias_shape", "a, b, c"), problem)
    assert "differs in names" in renamed.warnings[0]


def test_foreign_imports_and_missing_forward_warn(problem):
    src = "import numpy\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    pass\n"
    warnings = " | ".join(static_check(src, problem).warnings)
    assert "imports numpy" in warnings and "no forward()" in warnings


def test_old_cxx_standard_is_flagged_with_its_reply_line():
    cand = extract_candidate(seed_path("003"))
    from judge_support import SEED_PROBLEMS

    report = static_check(cand.source, load_problem(SEED_PROBLEMS["003"]), cand.line_offset)
    assert report.ok
    assert any(w.startswith("line 425: -std=c++14 requested") for w in report.warnings)
