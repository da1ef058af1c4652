"""Generated kernels on the CPU: what the scheduler groups (and refuses, with reasons), the CUDA it renders
(strategies, golden snapshot, nvcc), and the interpreter against the model for every kernel family."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.codegen.iteration import merge_space
from kernelfuse.load import load_problem
from kernelfuse.plan import GenStep, TorchStep, plan_variants

FIXTURES = Path(__file__).parent / "fixtures"
ZOO = FIXTURES / "problems" / "zoo_generated.py"
GOLDEN = FIXTURES / "golden"

ZOO_FAMILIES = [
    "sum", "mean", "amax", "amin", "softmax", "log_softmax", "logsumexp", "softmax", "norm", "norm", "norm", "norm",
    "affine_norm", "pointwise", "prod", "amax", "pointwise", "sum", "sum", "max_pool", "avg_pool", "avg_pool",
    "max_pool", "avg_pool", "avg_pool", "mean", "amax", "sum",
]


@pytest.fixture(scope="module")
def zoo():
    """The zoo planned straight from its capture: the rewrite stage (tested on its own) cannot move a kernel here."""
    problem = load_problem(ZOO)
    graph = capture(problem, build_model(problem))
    (plan,) = plan_variants(graph)
    return problem, graph, plan


def test_zoo_branches_each_become_one_kernel_of_their_family(zoo):
    problem, graph, plan = zoo
    assert [g.family for g in plan.generated] == ZOO_FAMILIES
    assert plan.fused == []
    # what stays a torch call: batch norm's bookkeeping (counter update, reserve buffer), each with a decision
    assert sorted({s.node.op for s in plan.unfused}) == ["add_.Tensor", "empty.memory_format"]
    assert all("no kernel yet" not in s.reason for s in plan.unfused)


def test_zoo_interpreter_equals_the_model(zoo):
    problem, graph, plan = zoo
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_each_kernel_picks_its_row_strategy(zoo):
    _, _, plan = zoo
    cuda = generate(plan).cuda
    strategies = {k: line for k, line in (_strategy(cuda, g.kernel) for g in plan.generated) if line}
    assert "inner, 32 thread(s) per row, 64 rows of 1000" in strategies["k0"]  # a warp per row
    assert "inner, 256 thread(s) per row, 48 rows of 1600" in strategies["k2"]  # a block per row
    assert "strided, 1 thread(s) per row, 25600 rows of 3" in strategies["k3"]  # the innermost dim is kept
    assert "strided" in strategies["k17"] and "rows of 300" in strategies["k17"]  # sum over the outer dim
    assert "inner, 256 thread(s) per row, 1 rows of 64000" in strategies["k18"]  # the whole tensor
    assert "split, 1 rows of 98304 in 24 chunks of 4096" in strategies["k25"]
    assert "split, 4 rows of 70000 in 17 chunks" in strategies["k26"]
    assert "split, 4 rows of 70000" in strategies["k27"]


def _strategy(cuda: str, kernel: str) -> tuple[str, str | None]:
    block = cuda.split(f"// {kernel}: ", 1)[1].split("\n// k", 1)[0]
    line = next((ln for ln in block.splitlines() if ln.startswith("// strategy:")), None)
    return kernel, line


def test_zoo_kernels_match_the_golden_snapshot(zoo):
    """A refactor that changes no kernel changes no byte here; regenerate with KERNELFUSE_UPDATE_GOLDEN=1."""
    _, _, plan = zoo
    sources = generate(plan)
    text = sources.cuda + "\n// ---- bindings ----\n" + sources.binding
    golden = GOLDEN / "zoo_generated.cu"
    if os.environ.get("KERNELFUSE_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "generated code changed: review, then KERNELFUSE_UPDATE_GOLDEN=1"


def test_zoo_kernels_compile_with_nvcc(zoo, tmp_path):
    nvcc = _nvcc()
    _, _, plan = zoo
    cu = tmp_path / "zoo.cu"
    cu.write_text(generate(plan).cuda)
    result = subprocess.run([nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(tmp_path / "zoo.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_merge_space_merges_only_chained_dims_of_one_class():
    # [N, C, H, W] reducing H, W of a contiguous tensor with a per-channel operand: H and W merge, N and C do not
    space = merge_space((2, 3, 4, 5), ("k", "k", "r", "r"), {"src": (60, 20, 5, 1), "bias": (0, 1, 0, 0)})
    assert space.sizes == (2, 3, 20) and space.classes == ("k", "k", "r")
    assert space.strides == {"src": (60, 20, 1), "bias": (0, 1, 0)}
    # size-1 dims drop out; a transposed operand stops the merge
    space = merge_space((1, 4, 6), ("k", "k", "k"), {"src": (24, 6, 1), "t": (24, 1, 4)})
    assert space.sizes == (4, 6) and space.strides["t"] == (1, 4)


LIN = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 24)

def forward(self, x):
    y = self.lin(x)
{body}
"""


def _plan(tmp_path, body: str, inputs: str = "[torch.randn(4, 16)]"):
    problem, graph, plans = pipeline(write_problem(tmp_path, "p", LIN.format(body=body), inputs))
    return problem, graph, plans[0]


def _reason(plan, name: str) -> str:
    return next(s.reason for s in plan.steps if isinstance(s, TorchStep) and s.node.name == name)


def test_max_with_used_indices_stays_a_torch_call(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    v, i = torch.max(y, dim=1)
    return v, i
    """)
    assert plan.generated == []
    assert _reason(plan, "max_1") == "its output 1 (statistics or indices) is used"
    assert_interpreter_matches(problem, plan)


def test_an_epilogue_value_two_kernels_read_is_recomputed_in_each(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    r = torch.sigmoid(y)
    return r - r.mean(dim=1, keepdim=True)
    """)
    fams = sorted((s.family, s.replaces) for s in plan.generated)
    # the mean and the subtraction read the sigmoid as their source: each recomputes it from the anchor's raw
    # output (kernelfuse.plan.merge), which is all the anchor writes: no epilogue pass
    assert [s.chain(g) for s in plan.fused] == ["addmm"] and not plan.fused[0].needs_kernel
    assert fams == [("mean", ("sigmoid", "mean")), ("pointwise", ("sigmoid", "sub"))]
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_anchor_epilogue_moves_into_the_reduction_prologue(tmp_path):
    problem, g, plan = _plan(tmp_path, """
    return torch.logsumexp(torch.tanh(y) * 2.0 + 1.0, dim=1)
    """)
    (anchor,) = plan.fused
    (gen,) = plan.generated
    assert anchor.replaces == ("addmm",) and not anchor.needs_kernel
    assert gen.chain(g) == "tanh -> mul -> add -> logsumexp" and gen.source.ref.name == "addmm"
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_reshape_inside_a_chain_keeps_one_kernel(tmp_path):
    path = write_problem(tmp_path, "r", """
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            z = torch.relu(x).view(4, 4, 6) * self.b
            return torch.softmax(z, dim=-1)
        """, "[torch.randn(4, 24)]")
    problem, g, (plan,) = pipeline(path)
    (gen,) = plan.generated
    assert gen.family == "softmax" and [st.op for st in gen.prologue.statements] == ["relu", "reshape", "mul"]
    assert gen.prologue.space == (4, 4, 6)
    assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-6)


def test_integer_chain_is_not_generated(tmp_path):
    path = write_problem(tmp_path, "ints", """
        def forward(self, a):
            return torch.abs(a) * 2
        """, "[torch.randint(-5, 5, (4, 4))]")
    problem, g, (plan,) = pipeline(path)
    assert plan.generated == []
    assert all("floating-point" in s.reason for s in plan.unfused)


def test_generated_step_records_what_it_replaces_once(zoo):
    _, graph, plan = zoo
    computed = []
    for s in plan.steps:
        computed += list(s.replaces) if isinstance(s, GenStep) else [s.node.name]
    assert sorted(computed) == sorted(n.name for n in graph.nodes if n.op not in ("input", "param", "buffer"))


def test_interpreter_writes_generated_outputs_contiguous_as_the_kernel_does(tmp_path):
    """clone(contiguous) of a permuted tensor inside a kernel: the kernel's output is a fresh contiguous tensor, so
    a view after it works; the interpreter must mirror that (the op-table clone alone keeps the permuted strides)."""
    path = write_problem(tmp_path, "perm", """
        def forward(self, x):
            y = (x.permute(0, 2, 1) * 2.0).contiguous()
            return y.view(4, -1)
        """, "[torch.randn(4, 5, 6)]")
    problem, _, (plan,) = pipeline(path)
    assert [g.chain(plan.graph) for g in plan.generated] == ["mul -> clone"]
    assert_interpreter_matches(problem, plan)
