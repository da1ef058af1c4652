"""The floor's FLOP count follows kernelfuse's exact rewrites: a GEMM reduced to a matrix-vector product is cheap."""

from __future__ import annotations

from optimizer_helpers import write_problem

from kernelfuse.bench.floor import count_flops
from kernelfuse.judge.rewritten import rewritten_flops
from kernelfuse.load import load_problem

LINEAR = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(64, 128)

def forward(self, x):
    return {body}
"""


def _flops(tmp_path, body: str) -> tuple[int, int | None]:
    problem = load_problem(write_problem(tmp_path, "p", LINEAR.format(body=body), "[torch.randn(8, 64)]"))
    model, inputs = problem.make_model(), problem.make_inputs(0)
    return count_flops(lambda: model(*inputs)), rewritten_flops(problem, model, inputs)


def test_sum_over_a_linear_counts_a_matrix_vector_product(tmp_path):
    reference, rewritten = _flops(tmp_path, "torch.sum(self.lin(x), dim=1, keepdim=True)")
    assert reference == 2 * 8 * 64 * 128
    assert rewritten is not None and rewritten <= 2 * 8 * 64  # x @ W.sum(0): one column


def test_no_rule_no_refinement(tmp_path):
    reference, rewritten = _flops(tmp_path, "torch.relu(self.lin(x))")
    assert reference == 2 * 8 * 64 * 128 and rewritten is None
