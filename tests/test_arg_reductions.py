"""argmax / argmin as generated reduction kernels (kernelfuse.codegen.arg_reduce): the plan takes them over a
middle dim (a thread per output), the last dim (a warp or a block per row), the flattened tensor and with a fused
prologue, a few long rows split across blocks; run in a CPU emulation of the CUDA they return torch's indices
exactly (int64) on inputs full of ties, NaN, -0.0 and infinities; an index result never joins a float epilogue;
dev level-1 problem 52 plans to one strided kernel that passes the CPU check; the CUDA compiles with nvcc."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.capture import build_model
from kernelfuse.codegen import generate
from kernelfuse.codegen.generated import workspace_floats
from kernelfuse.codegen.iteration import tensor_args
from kernelfuse.codegen.split import split_chunks
from kernelfuse.cpucheck import check_plans
from kernelfuse.ops.kept import KEPT_AS_TORCH
from kernelfuse.plan import Plan, TorchStep
from kernelfuse.plan.interpret import _run_generated, run_env

ROWS = """
def forward(self, x, w):
    return (
        torch.argmin(x, dim=1),                   # a middle dim: strided, a thread per output
        torch.argmax(x, dim=1, keepdim=True),
        torch.argmax(x, dim=-1),                  # the last dim: inner, a warp per row
        torch.argmin(x, dim=2, keepdim=True),
        torch.argmax(w, dim=1),                   # rows of 3000: a block per row
        torch.argmin(w, dim=0),                   # the outer dim
        torch.argmax(x),                          # the flattened tensor: one row
        torch.argmin(x, keepdim=True),
        torch.argmax(torch.relu(x), dim=1),       # a fused prologue: ties among the zeros
        torch.argmin(x * 2.0, dim=2),
        torch.argmax(w.t()),                      # a transposed view flattened: torch's logical order
        torch.argmin(x.transpose(1, 2), dim=1),   # read through the view's strides
        torch.argmax(x.unsqueeze(1), dim=1),      # a size-1 dim: every index 0
    )
"""
ROW_INPUTS = "[torch.randn(4, 37, 45), torch.randn(6, 3000)]"
ROW_KINDS = ["argmin", "argmax", "argmax", "argmin", "argmax", "argmin", "argmax", "argmin", "argmax", "argmin",
             "argmax", "argmin", "argmax"]
ROW_STRATEGIES = ["strided, 1 thread(s) per row, 180 rows of 37", "strided, 1 thread(s) per row, 180 rows of 37",
                  "inner, 32 thread(s) per row, 148 rows of 45", "inner, 32 thread(s) per row, 148 rows of 45",
                  "inner, 256 thread(s) per row, 6 rows of 3000", "strided, 1 thread(s) per row, 3000 rows of 6",
                  "inner, 256 thread(s) per row, 1 rows of 6660", "inner, 256 thread(s) per row, 1 rows of 6660",
                  "strided, 1 thread(s) per row, 180 rows of 37", "inner, 32 thread(s) per row, 148 rows of 45",
                  "inner, 256 thread(s) per row, 1 rows of 18000", "inner, 32 thread(s) per row, 148 rows of 45",
                  "strided, 1 thread(s) per row, 6660 rows of 1"]

SPLITS = """
def forward(self, x, y, z):
    return torch.argmax(x), torch.argmin(y, dim=0), torch.argmax(z, dim=1)
"""
SPLIT_INPUTS = "[torch.randn(300, 400), torch.randn(4096, 12), torch.randn(3, 70000)]"
SPLIT_STRATEGIES = ["split, 1 rows of 120000 in 29 chunks of 4138, then a combine kernel",
                    "split strided, 12 rows of 4096 in 16 chunks of 256, tiles of 16 rows, then a combine kernel",
                    "split, 3 rows of 70000 in 17 chunks of 4118, then a combine kernel"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    problem, _, (plan,) = pipeline(write_problem(tmp_path_factory.mktemp("args"), "rows", ROWS, ROW_INPUTS))
    return problem, plan


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    problem, _, (plan,) = pipeline(write_problem(tmp_path_factory.mktemp("args"), "splits", SPLITS, SPLIT_INPUTS))
    return problem, plan


def strategies(plan: Plan) -> list[str]:
    cuda = generate(plan).cuda
    return [next(ln for ln in cuda.split(f"// {g.kernel}: ", 1)[1].splitlines() if ln.startswith("// strategy:"))
            .removeprefix("// strategy: ") for g in plan.generated]


def nasty(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), zeros of both signs, infinities and NaN in some rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float()
    x = torch.where(torch.rand(shape, generator=g) < 0.5, x, -x)  # -0.0 beside 0.0
    flat = x.view(-1)
    n = flat.numel()
    picks = torch.randint(0, n, (max(3, n // 200),), generator=g)
    flat[picks[0::3]] = float("nan")
    flat[picks[1::3]] = float("inf")
    flat[picks[2::3]] = -float("inf")
    return x


def run_kernels(plan: Plan, emu, inputs: list[torch.Tensor]) -> None:
    """Every kernel of the plan on the values the plan gives its tensors for `inputs` (views through their
    strides): torch's indices exactly, as int64."""
    values = run_env(plan, {}, inputs)
    for step in plan.generated:
        env = dict(values)
        out = getattr(emu.kernels, step.kernel)(*(env[ref.name] for _, ref in tensor_args(step)))
        expected = _run_generated(step, env)
        assert out.dtype == torch.int64 and expected.dtype == torch.int64, step.kernel
        assert out.shape == expected.shape, step.kernel
        assert torch.equal(out, expected), (step.kernel, step.chain(plan.graph), out, expected)


def test_every_arg_reduction_is_one_generated_kernel(rows):
    problem, plan = rows
    assert [g.spec.kind for g in plan.generated] == ROW_KINDS
    assert plan.unfused == []
    assert [g.chain(plan.graph) for g in plan.generated][8:10] == ["relu -> argmax", "mul -> argmin"]
    assert strategies(plan) == ROW_STRATEGIES
    assert "argmin.default" not in KEPT_AS_TORCH and "argmax.default" not in KEPT_AS_TORCH
    assert_interpreter_matches(problem, plan)


def test_binding_allocates_an_int64_output(rows):
    _, plan = rows
    binding = generate(plan).binding
    assert binding.count("dtype=torch.int64)") == len(plan.generated)
    assert "long long* __restrict__ out" in generate(plan).cuda


def test_arg_kernels_return_torchs_indices_in_a_cpu_emulation(rows, tmp_path):
    _, plan = rows
    emu = emulated(plan, tmp_path)
    run_kernels(plan, emu, [torch.randn(4, 37, 45), torch.randn(6, 3000)])
    for seed in range(3):
        x, w = nasty((4, 37, 45), seed), nasty((6, 3000), seed + 10)
        x[0, 0] = float("nan")  # a NaN row, all ties rows, rows of infinities
        x[1] = 0.0
        x[1, :, ::2] = -0.0
        x[2, :, 3] = -float("inf")
        w[1] = -float("inf")
        w[2] = float("inf")
        w[3, 2000] = w[3, 100] = float("nan")
        run_kernels(plan, emu, [x, w])


def test_few_long_rows_split_their_pairs_across_blocks(splits, tmp_path):
    problem, plan = splits
    assert [g.spec.kind for g in plan.generated] == ["argmax", "argmin", "argmax"]
    assert [split_chunks(g) for g in plan.generated] == [29, 16, 17]
    assert strategies(plan) == SPLIT_STRATEGIES
    assert [workspace_floats(g) for g in plan.generated] == [29 + 1 + 2 * 29, 12 * 16 + 2 * 12 * 16, 52 + 2 * 51]
    assert_interpreter_matches(problem, plan)
    emu = emulated(plan, tmp_path)
    x, y, z = nasty((300, 400), 1), nasty((4096, 12), 2), nasty((3, 70000), 3)
    run_kernels(plan, emu, [x, y, z])
    # the extreme in several chunks: the lowest index wins the combine, a NaN wins over it
    x, y, z = torch.zeros(300, 400), torch.zeros(4096, 12), torch.zeros(3, 70000)
    x.view(-1)[[70000, 5000, 119999]] = 1.0
    y[[3000, 700, 4000], 5] = -1.0
    z[:, [69000, 30000, 9000]] = 2.0
    z[1, 60000] = z[1, 50000] = float("nan")
    run_kernels(plan, emu, [x, y, z])
    assert int(emu.kernels.k0(x)) == 5000 and emu.kernels.k1(y)[5] == 700
    assert emu.kernels.k2(z).tolist() == [9000, 50000, 9000]


def test_an_index_result_takes_no_float_epilogue(tmp_path):
    """argmin(x, 1).float() * 2: the conversion stays a torch call and the mul reads its float copy (a kernel of
    its own); an int64 op on the index stays a torch call; the plan computes the model's values and dtypes."""
    body = """
    def forward(self, x):
        a = torch.argmin(x, dim=1)
        return a.float() * 2.0, a + 1, torch.argmax(x, 2) * 2.5
    """
    problem, _, (plan,) = pipeline(write_problem(tmp_path, "consumer", body, "[torch.randn(3, 40, 50)]"))
    kinds = [g.spec.kind if g.spec is not None else "pointwise" for g in plan.generated]
    assert kinds.count("argmin") == 1 and kinds.count("argmax") == 1
    for g in plan.generated:
        if g.spec is not None:
            assert g.epilogue.statements == () and g.out_meta.dtype == torch.int64, plan.summary()
        else:
            assert g.out_meta.dtype == torch.float32 and g.source.meta.dtype == torch.float32, plan.summary()
    assert {s.node.op for s in plan.steps if isinstance(s, TorchStep)} >= {"add.Tensor"}
    assert_interpreter_matches(problem, plan)


def test_an_integer_argmax_stays_atens_with_a_reason(tmp_path):
    body = """
    def forward(self, x):
        return torch.argmax(x.long(), dim=1)
    """
    _, _, (plan,) = pipeline(write_problem(tmp_path, "ints", body, "[torch.randn(3, 40)]"))
    reasons = {s.node.op: s.reason for s in plan.unfused}
    assert reasons["argmax.default"] == "dtype torch.int64 not supported"


LEVEL1_52 = Path(__file__).resolve().parents[1].parent / "shared" / "kernelbench" / "level1" / \
    "52_Argmin_over_a_dimension.py"


@pytest.mark.skipif(not LEVEL1_52.exists(), reason=f"the dev split is not at {LEVEL1_52}")
def test_problem_52_plans_one_strided_argmin_that_passes_the_cpu_check(tmp_path):
    """A small copy of dev level-1 52 (argmin over the middle dim of (batch, dim1, dim2), dim2 odd): one generated
    argmin, a thread per output, that passes the CPU check; its emulated CUDA equals torch.argmin."""
    text = LEVEL1_52.read_text()
    for name, value in (("batch_size", 3), ("dim1", 130), ("dim2", 63)):
        text = re.sub(rf"^{name} = \d+$", f"{name} = {value}", text, flags=re.M)
    path = tmp_path / "argmin52.py"
    path.write_text(text)
    problem, graph, plans = pipeline(path)
    (plan,) = plans
    (step,) = plan.generated
    assert step.spec.kind == "argmin" and plan.unfused == [], plan.summary()
    assert strategies(plan) == ["strided, 1 thread(s) per row, 189 rows of 130"]
    (check,) = check_plans(problem, build_model(problem), graph, plans)
    assert check.ok and not check.skipped, check.note
    x = problem.make_inputs(0)[0]
    emu = emulated(plan, tmp_path)
    assert torch.equal(emu.kernels.k0(x), torch.argmin(x, dim=1))
    x[:, 7::11] = x[:, 3:4]  # ties with an earlier element
    x[1, 40, 5] = float("nan")
    assert torch.equal(emu.kernels.k0(x), torch.argmin(x, dim=1))


def test_arg_kernels_compile_with_nvcc(rows, splits, tmp_path):
    """Every kernel above and a bfloat16 one (which the emulation leaves out), compiled for sm_90."""
    nvcc = _nvcc()
    half = write_problem(tmp_path, "half", "def forward(self, x):\n    return torch.argmax(torch.relu(x), 1)",
                         "[torch.randn(8, 3000, 5).bfloat16()]")
    plans = [rows[1], splits[1], pipeline(half)[2][0]]
    assert plans[2].generated[0].source.meta.dtype == torch.bfloat16
    for i, plan in enumerate(plans):
        cu = tmp_path / f"args{i}.cu"
        cu.write_text(generate(plan).cuda)
        result = subprocess.run([nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o",
                                 str(tmp_path / f"a{i}.o")], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
