"""Row kernels whose output rows are contiguous but whose source rows are strided (a LayerNorm over the channels
of an NCHW activation, as a UNet's transformer block or ConvNeXt computes it) write through a shared tile
(kernelfuse.codegen.row_writes.stages_writes): checked in the CPU emulation against the plan interpreter, fp32 and
bf16."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import write_problem

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.load import load_problem
from kernelfuse.pipeline import build_model
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

CHANNEL_NORM = """
def __init__(self):
    super().__init__()
    self.norm = nn.LayerNorm(40)
    with torch.no_grad():
        self.norm.weight.uniform_(0.5, 1.5)
        self.norm.bias.uniform_(-0.5, 0.5)

def forward(self, x, r):
    n, c, h, w = x.shape
    return self.norm(x.view(n, c, h * w).permute(0, 2, 1)) * 2.0 + r
"""


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hw", [(8, 8), (6, 6)], ids=["rows_of_32", "rows_of_not_32"])
def test_a_norm_over_nchw_channels_writes_its_rows_through_a_tile(tmp_path, autocast, hw):
    # 2 x 8 x 8 = 128 rows (4 warps of 32 rows): staged, the epilogue (scale, a residual read at the output's
    # offsets) inside; 2 x 6 x 6 = 72 rows: not a multiple of 32, written directly
    inputs = f"[torch.randn(2, 40, {hw[0]}, {hw[1]}), torch.randn(2, {hw[0] * hw[1]}, 40)]"
    path = write_problem(tmp_path, "channel_norm", CHANNEL_NORM, inputs)
    problem = load_problem(path)
    graph = rewrite(capture(problem, build_model(problem).eval(), autocast=autocast))
    plan = plan_variants(graph, "bf16" if autocast else "strict")[0]
    (norm,) = [s for s in plan.generated if "native_layer_norm" in s.chain(plan.graph)]
    assert "mul" in norm.chain(plan.graph) and "add" in norm.chain(plan.graph)
    cuda = generate(plan).cuda
    body = cuda[cuda.index(f"// {norm.kernel}:"):cuda.index(f"{norm.kernel}_launch")]
    assert "strategy: strided" in body
    assert ("kf_tile[kf_w][kf_l][kf_j] = e_result;" in body) == (hw == (8, 8))
    # the norm is fp32 under autocast too: its arithmetic (Welford) and ATen's CPU one differ by a few ulps
    assert emulated_against_interpreter(plan, tmp_path, ulps=64) == len(plan.generated)
