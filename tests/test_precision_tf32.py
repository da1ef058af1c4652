"""The tf32 policy: matmul anchors run with TF32 allowed for that call only; strict plans never do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernelfuse.capture import capture
from kernelfuse.emit.runtime import runtime_text
from kernelfuse.load import load_problem
from kernelfuse.pipeline import OptimizeOptions, optimize_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _plans(name: str, precision: str):
    return plan_variants(rewrite(capture(load_problem(EXAMPLES / f"{name}.py"))), precision)


@pytest.mark.parametrize("precision, expected", [("strict", False), ("bf16", False), ("tf32", True)])
def test_matmul_anchor_tf32_only_under_tf32(precision: str, expected: bool) -> None:
    (plan,) = _plans("gemm_add_relu", precision)
    assert [s.anchor.tf32 for s in plan.fused] == [expected]
    assert plan.variant == ("fused-tf32" if expected else "fused")


def test_conv_anchor_is_not_marked_tf32() -> None:
    plans = _plans("conv2d_relu_biasadd", "tf32")
    assert [p.variant for p in plans] == ["fused-nhwc", "fused-nchw"]
    assert not any(s.anchor.tf32 for p in plans for s in p.fused)


def test_tf32_helper_restores_the_global_setting_even_on_error() -> None:
    (plan,) = _plans("gemm_add_relu", "tf32")
    namespace: dict[str, object] = {"torch": torch}
    exec(runtime_text(plan, None), namespace)  # noqa: S102 - our generated runtime
    before = torch.get_float32_matmul_precision()
    assert namespace["_with_tf32"](torch.get_float32_matmul_precision) == "high"
    assert torch.get_float32_matmul_precision() == before

    def boom() -> None:
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        namespace["_with_tf32"](boom)
    assert torch.get_float32_matmul_precision() == before


def test_emitted_tf32_file_wraps_only_the_matmul(tmp_path: Path) -> None:
    out = tmp_path / "tf32.py"
    optimize_file(EXAMPLES / "gemm_sigmoid_scaling_residualadd.py", out,
                  OptimizeOptions(precision="tf32", use_gpu=False), log=lambda s: None)
    text = out.read_text()
    compile(text, str(out), "exec")
    assert text.count("_with_tf32(lambda: torch.addmm(") == 1
    strict = tmp_path / "strict.py"
    optimize_file(EXAMPLES / "gemm_sigmoid_scaling_residualadd.py", strict, OptimizeOptions(use_gpu=False),
                  log=lambda s: None)
    assert "_with_tf32" not in strict.read_text()
