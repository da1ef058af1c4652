"""Row kernels that gather their statistics in one pass: softmax, log_softmax and logsumexp find a row's max and
sum of exp(x - max) together (online: a larger max rescales the sum); norms find the mean and variance together
(Welford, Chan's merge). Their generated CUDA, run in the CPU emulation of CUDA, against eager on rows with -inf
(some, all), +inf, NaN and large offsets, in each row strategy (a thread, 4 or 8 lanes, a warp or a block per row)."""

from __future__ import annotations

import pytest
import torch
from emulation_helpers import call, emulated, emulated_run
from optimizer_helpers import pipeline, write_problem

from kernelfuse.codegen import generate
from kernelfuse.codegen.iteration import tensor_args

BODY = """
def forward(self, x):
    return {expr}
"""
CASES = {
    # name: (expression, input shape, the strategy line's start)
    "softmax_block": ("torch.softmax(x, -1)", (8, 3000), "// strategy: inner, 256 thread(s) per row"),
    "log_softmax_warp": ("torch.log_softmax(x, 1)", (8, 300), "// strategy: inner, 32 thread(s) per row"),
    "logsumexp_warp": ("torch.logsumexp(x, 1)", (8, 300), "// strategy: inner, 32 thread(s) per row"),
    "log_softmax_lanes": ("torch.log_softmax(x, 1)", (8, 100), "// strategy: inner, 8 thread(s) per row"),
    "logsumexp_lanes": ("torch.logsumexp(x, 1)", (16, 40), "// strategy: inner, 4 thread(s) per row"),
    "logsumexp_block": ("torch.logsumexp(x, 1)", (8, 3000), "// strategy: inner, 256 thread(s) per row"),
    "softmax_strided": ("torch.softmax(x, 1)", (2, 40, 4), "// strategy: strided, 1 thread(s) per row"),
}


def _special_rows(shape: tuple[int, ...]) -> torch.Tensor:
    """Random values, then one special pattern per row along dim 1: all -inf, some -inf, one +inf, one NaN,
    a large offset, a max at the row's end (the sum rescaled late), and two ordinary rows."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 4.0
    rows = x.movedim(1, -1).reshape(-1, shape[1])  # a view: writes land in x
    n = shape[1]
    rows[0].fill_(float("-inf"))
    rows[1, : n // 2] = float("-inf")
    rows[2, n // 3] = float("inf")
    rows[3, n // 2] = float("nan")
    rows[4] += 1e4
    rows[5, -1] = 60.0
    return x


@pytest.mark.parametrize("name", sorted(CASES))
def test_online_row_kernel_matches_eager_on_special_values(name: str, tmp_path) -> None:
    expr, shape, strategy = CASES[name]
    problem, _, plans = pipeline(write_problem(tmp_path, name, BODY.format(expr=expr), f"[torch.randn{shape}]"))
    plan = plans[-1]
    (step,) = plan.generated
    assert strategy in generate(plan).cuda, generate(plan).cuda[:2000]
    assert "kf_row_reduce_online<TPR>(m, s)" in generate(plan).cuda  # one pass for the max and the sum
    # a broadcasting kernel whose thread owns at most 32 elements keeps them in registers for the write pass
    per_thread = -(-shape[1] // int(strategy.split(", ")[1].split()[0]))
    assert ("float cache[PER];" in generate(plan).cuda) == ("logsumexp" not in name and per_thread <= 32)
    x = _special_rows(shape)
    assert [n for n, _ in tensor_args(step)] == ["src"]
    out = torch.full(step.out_meta.shape, float("nan"))
    call(emulated(plan, tmp_path), step, [x.contiguous(), out])
    with torch.no_grad():
        expected = problem.make_model()(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5, equal_nan=True)


NORMS = {
    # name: (model body, input, the strategy line's start); sources offset by 100 (a variance far below the mean)
    "layer_norm_block": ("def __init__(self):\n    super().__init__()\n    self.ln = nn.LayerNorm(3000)\n\n"
                         "def forward(self, x):\n    return self.ln(x)", (8, 3000), "256 thread(s) per row"),
    "layer_norm_warp": ("def __init__(self):\n    super().__init__()\n    self.ln = nn.LayerNorm(300)\n\n"
                        "def forward(self, x):\n    return self.ln(x)", (8, 300), "32 thread(s) per row"),
    "layer_norm_lanes": ("def __init__(self):\n    super().__init__()\n    self.ln = nn.LayerNorm(64)\n\n"
                         "def forward(self, x):\n    return self.ln(x)", (8, 64), "8 thread(s) per row"),
    "layer_norm_ragged": ("def __init__(self):\n    super().__init__()\n    self.ln = nn.LayerNorm(64)\n\n"
                          "def forward(self, x):\n    return self.ln(x)", (7, 64), "32 thread(s) per row"),
    "instance_norm": ("def forward(self, x):\n    return F.instance_norm(x)", (2, 4, 30, 40), "256 thread(s) per row"),
    "batch_norm_strided": ("def __init__(self):\n    super().__init__()\n    self.bn = nn.BatchNorm1d(16)\n\n"
                           "def forward(self, x):\n    return self.bn(x)", (64, 16), "strided, 1 thread(s) per row"),
    # 67 a thread, read twice: 16 groups of four, then 3 one by one
    "batch_norm_strided_ragged": ("def __init__(self):\n    super().__init__()\n    self.bn = nn.BatchNorm1d(16)\n\n"
                                  "def forward(self, x):\n    return self.bn(x)", (67, 16),
                                  "strided, 1 thread(s) per row"),
    # 36 or 37 a thread of 256, read twice
    "layer_norm_block_uncached": ("def __init__(self):\n    super().__init__()\n    self.ln = nn.LayerNorm(9301)\n\n"
                                  "def forward(self, x):\n    return self.ln(x)", (3, 9301), "256 thread(s) per row"),
}
UNCACHED = ("batch_norm_strided", "batch_norm_strided_ragged", "layer_norm_block_uncached")


@pytest.mark.parametrize("name", sorted(NORMS))
def test_welford_norm_kernel_matches_the_interpreter(name: str, tmp_path) -> None:
    body, shape, strategy = NORMS[name]
    _, _, plans = pipeline(write_problem(tmp_path, name, body, f"[torch.randn{shape}]"))
    plan = plans[-1]
    step = next(g for g in plan.generated if g.spec.kind == "norm")
    cuda = generate(plan).cuda
    assert strategy in cuda and "kf_row_reduce_welford<TPR>(n, mean, m2)" in cuda
    # a row a thread does not keep in registers is read twice; its statistics pass takes four elements a step
    assert ("float cache[PER];" in cuda) == (name not in UNCACHED)
    assert ("kf_welford_add4(n, mean, m2, value(r)" in cuda) == (name in UNCACHED)
    out, expected, tensors, env = emulated_run(emulated(plan, tmp_path), plan, step, seed=1, src_offset=100.0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for (arg, ref), emulated_buffer in zip(tensor_args(step), tensors, strict=True):
        if arg.startswith("run_"):  # batch norm's running statistics, updated in place by both
            torch.testing.assert_close(emulated_buffer, env[ref.name], atol=1e-5, rtol=1e-5)
