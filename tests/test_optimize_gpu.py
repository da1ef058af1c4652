"""GPU: `kernelfuse optimize` on the three bundled problems ships a verified file that runs without kernelfuse."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernelfuse.pipeline import OptimizeOptions, optimize_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["gemm_add_relu", "gemm_sigmoid_scaling_residualadd", "conv2d_relu_biasadd"]

pytestmark = pytest.mark.gpu

STANDALONE = textwrap.dedent("""
    import runpy, sys, torch
    problem = runpy.run_path(sys.argv[1])
    emitted = runpy.run_path(sys.argv[2])
    init = problem["get_init_inputs"]()
    torch.manual_seed(42); ref = problem["Model"](*init).cuda()
    torch.manual_seed(42); new = emitted["ModelNew"](*init).cuda()
    torch.manual_seed(7); xs = [x.cuda() for x in problem["get_inputs"]()]
    with torch.no_grad():
        a, b = ref(*xs), new(*xs)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max().item()
    assert "kernelfuse" not in sys.modules
    print("standalone ok", (a - b).abs().max().item())
""")


@pytest.mark.parametrize("name", EXAMPLES)
def test_optimize_ships_verified_file(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}_new.py"
    result = optimize_file(ROOT / "examples" / f"{name}.py", out,
                           OptimizeOptions(trials=5, final_baselines=("eager",)))
    assert out.is_file()
    assert result.final is not None and result.final.correct, result.final
    for v in result.variants:
        assert v.verdict.built, v.verdict.reason
    if result.shipped != "unfused":
        assert "import kernelfuse" not in out.read_text()
        proc = subprocess.run([sys.executable, "-c", STANDALONE, str(ROOT / "examples" / f"{name}.py"), str(out)],
                              capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "standalone ok" in proc.stdout
