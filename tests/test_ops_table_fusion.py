"""The pointwise op table through the optimizer: every row (bool rows aside) is fused into a Linear's epilogue,
interpreted like the model on the CPU (NaN and Inf included) and rendered with every placeholder filled; the CUDA
renderings of gelu, alpha and clamp bounds and float literals; every row at once in one epilogue, compiled with
nvcc in float32, float16 and bfloat16. Each row's expression element by element: tests/test_ops_table_expressions.py.

Adding a row to kernelfuse.ops.POINTWISE_OPS without a case here fails `test_every_row_has_a_case`.
"""

from __future__ import annotations

import subprocess

import pytest
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from test_nvcc_compile import _nvcc

from kernelfuse.codegen import generate
from kernelfuse.ops import POINTWISE_BY_ATEN, POINTWISE_OPS, float_literal, render_cuda

A = "torch.ops.aten"

# case id -> (row, forward expression over y (the Linear output) and self.w (a [16] parameter), non-default params)
CASES: dict[str, tuple[str, str, bool]] = {
    "relu": ("relu.default", f"{A}.relu.default(y)", False),
    "sigmoid": ("sigmoid.default", f"{A}.sigmoid.default(y)", False),
    "tanh": ("tanh.default", f"{A}.tanh.default(y)", False),
    "silu": ("silu.default", f"{A}.silu.default(y)", False),
    "exp": ("exp.default", f"{A}.exp.default(y)", False),
    "log": ("log.default", f"{A}.log.default(y)", False),  # NaN for negative y: NaN must match too
    "neg": ("neg.default", f"{A}.neg.default(y)", False),
    "abs": ("abs.default", f"{A}.abs.default(y)", False),
    "sqrt": ("sqrt.default", f"{A}.sqrt.default(y)", False),
    "rsqrt": ("rsqrt.default", f"{A}.rsqrt.default(y)", False),
    "gelu": ("gelu.default", f"{A}.gelu.default(y)", False),
    "gelu-tanh": ("gelu.default", f"{A}.gelu.default(y, approximate='tanh')", True),
    "softplus": ("softplus.default", f"{A}.softplus.default(y, 2.0, 3.0)", True),
    "hardtanh": ("hardtanh.default", f"{A}.hardtanh.default(y, -0.25, 0.5)", True),
    "mish": ("mish.default", f"{A}.mish.default(y)", False),
    "leaky_relu": ("leaky_relu.default", f"{A}.leaky_relu.default(y, 0.3)", True),
    "elu": ("elu.default", f"{A}.elu.default(y)", False),
    "elu-params": ("elu.default", f"{A}.elu.default(y, 0.5, 2.0, 1.5)", True),
    "selu": ("elu.default", "F.selu(y)", True),  # CompositeImplicit: captured as elu(alpha, scale)
    "celu": ("celu.default", f"{A}.celu.default(y, 2.0)", True),
    "hardsigmoid": ("hardsigmoid.default", f"{A}.hardsigmoid.default(y)", False),
    "hardswish": ("hardswish.default", f"{A}.hardswish.default(y)", False),
    "threshold": ("threshold.default", f"{A}.threshold.default(y, 0.1, 20.0)", True),
    "clamp": ("clamp.default", f"{A}.clamp.default(y, -0.5, 0.25)", True),
    "clamp-max-only": ("clamp.default", f"{A}.clamp.default(y, None, 0.25)", True),
    "clamp-min-only": ("clamp.default", f"{A}.clamp.default(y, -0.25)", True),
    "exp2": ("exp2.default", f"{A}.exp2.default(y)", False),
    "clamp_min": ("clamp_min.default", f"{A}.clamp_min.default(y, 0.1)", True),
    "expm1": ("expm1.default", f"{A}.expm1.default(y)", False),
    "log1p": ("log1p.default", f"{A}.log1p.default(y)", False),
    "log2": ("log2.default", f"{A}.log2.default(y)", False),
    "clamp_max": ("clamp_max.default", f"{A}.clamp_max.default(y, 0.1)", True),
    "log10": ("log10.default", f"{A}.log10.default(y)", False),
    "sin": ("sin.default", f"{A}.sin.default(y)", False),
    "cos": ("cos.default", f"{A}.cos.default(y)", False),
    "erf": ("erf.default", f"{A}.erf.default(y)", False),
    "erfinv": ("erfinv.default", f"{A}.erfinv.default(y)", False),
    "reciprocal": ("reciprocal.default", f"{A}.reciprocal.default(y)", False),
    "sign": ("sign.default", f"{A}.sign.default(y)", False),
    "floor": ("floor.default", f"{A}.floor.default(y)", False),
    "ceil": ("ceil.default", f"{A}.ceil.default(y)", False),
    "round": ("round.default", f"{A}.round.default(y)", False),
    "trunc": ("trunc.default", f"{A}.trunc.default(y)", False),
    "pow-2": ("pow.Tensor_Scalar", f"{A}.pow.Tensor_Scalar(y, 2)", True),
    "pow-1.7": ("pow.Tensor_Scalar", f"{A}.pow.Tensor_Scalar(y, 1.7)", True),
    "add": ("add.Tensor", f"{A}.add.Tensor(y, self.w)", False),
    "add-alpha": ("add.Tensor", f"{A}.add.Tensor(y, self.w, alpha=0.5)", True),
    "add-left": ("add.Tensor", f"{A}.add.Tensor(self.w, y, alpha=-2.0)", True),
    "add-scalar": ("add.Tensor", f"{A}.add.Tensor(y, 0.75)", False),
    "sub": ("sub.Tensor", f"{A}.sub.Tensor(y, self.w)", False),
    "sub-alpha": ("sub.Tensor", f"{A}.sub.Tensor(y, self.w, alpha=0.5)", True),
    "sub-left": ("sub.Tensor", f"{A}.sub.Tensor(self.w, y)", False),
    "sub-scalar": ("sub.Tensor", f"{A}.sub.Tensor(y, 0.75)", False),
    "mul": ("mul.Tensor", f"{A}.mul.Tensor(y, self.w)", False),
    "mul-left": ("mul.Tensor", f"{A}.mul.Tensor(self.w, y)", False),
    "mul-scalar": ("mul.Tensor", f"{A}.mul.Tensor(y, 1.5)", False),
    "div": ("div.Tensor", f"{A}.div.Tensor(y, self.w)", False),
    "div-left": ("div.Tensor", f"{A}.div.Tensor(self.w, y)", False),
    "add.Scalar": ("add.Scalar", f"{A}.add.Scalar(y, 0.75, 2.0)", True),
    "sub.Scalar": ("sub.Scalar", f"{A}.sub.Scalar(y, 0.75, 2.0)", True),
    "rsub.Scalar": ("rsub.Scalar", f"{A}.rsub.Scalar(y, 1.0)", False),
    "rsub.Scalar-alpha": ("rsub.Scalar", f"{A}.rsub.Scalar(y, 1.0, 3.0)", True),
    "mul.Scalar": ("mul.Scalar", f"{A}.mul.Scalar(y, 1.5)", False),
    "div.Scalar": ("div.Scalar", f"{A}.div.Scalar(y, 3.0)", True),
    "div-trunc": ("div.Tensor_mode", f"{A}.div.Tensor_mode(y, self.w, rounding_mode='trunc')", True),
    "div-floor": ("div.Tensor_mode", f"{A}.div.Tensor_mode(y, self.w, rounding_mode='floor')", True),
    "floor_divide": ("floor_divide.default", f"{A}.floor_divide.default(y, self.w)", False),
    "remainder": ("remainder.Tensor", f"{A}.remainder.Tensor(y, self.w)", False),
    "remainder.Scalar": ("remainder.Scalar", f"{A}.remainder.Scalar(y, -0.7)", False),
    "fmod": ("fmod.Tensor", f"{A}.fmod.Tensor(y, self.w)", False),
    "fmod.Scalar": ("fmod.Scalar", f"{A}.fmod.Scalar(y, 0.7)", False),
    "pow-tensor": ("pow.Tensor_Tensor", f"{A}.pow.Tensor_Tensor(y, self.w)", False),
    "xlogy": ("xlogy.Tensor", f"{A}.xlogy.Tensor(y, self.w)", False),
    "maximum": ("maximum.default", f"{A}.maximum.default(y, self.w)", False),
    "maximum-left": ("maximum.default", f"{A}.maximum.default(self.w, y)", False),
    "minimum": ("minimum.default", f"{A}.minimum.default(y, self.w)", False),
    "minimum-left": ("minimum.default", f"{A}.minimum.default(self.w, y)", False),
    # a cast to the same dtype here (one epilogue, one dtype); casts between dtypes: tests/test_mixed_dtypes.py
    "cast": ("_to_copy.default", f"{A}._to_copy.default(y, dtype=torch.float32)", True),
    "clone": ("clone.default", f"{A}.clone.default(y)", False),  # last: the returned clone is kept
}

BODY = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16)
    self.w = nn.Parameter(torch.randn(16))
    with torch.no_grad():
        self.w[3] = float("nan")

def forward(self, x):
    y = self.lin(x)
    return {expr}
"""


# Rows with a bool operand or result: the planner fuses float tensors only (it refuses them, see
# kernelfuse.ops.pointwise), so they are checked below on their own, not through a fused plan.
BOOL_ROWS = {row.aten for row in POINTWISE_OPS if row.result == "bool" or row.bool_args}


def test_every_row_has_a_case():
    assert {row for row, _, _ in CASES.values()} == set(POINTWISE_BY_ATEN) - BOOL_ROWS
    assert len(POINTWISE_BY_ATEN) == len(POINTWISE_OPS), "one row per ATen overload"
    for row in POINTWISE_OPS:
        if row.params and row.aten not in BOOL_ROWS:
            assert any(r == row.aten and nondefault for r, _, nondefault in CASES.values()), row.aten


@pytest.mark.parametrize("case", list(CASES))
def test_row_is_fused_and_interpreted_like_the_model(tmp_path, case):
    aten, expr, nondefault = CASES[case]
    path = write_problem(tmp_path, "row", BODY.format(expr=expr), "[torch.randn(6, 16)]")
    problem, graph, plans = pipeline(path)
    (plan,) = plans
    node = next(n for n in graph.nodes if n.op == aten)
    (step,) = plan.fused
    assert step.replaces[-1] == node.name, f"{aten} was not fused: {plan.summary()}"
    assert plan.unfused == []
    (st,) = step.epilogue.statements
    row = POINTWISE_BY_ATEN[aten]
    assert st.aten == aten and st.op == row.ir
    assert len(st.args) == len(row.operands) and len(st.params) == len(row.params)
    if nondefault:
        assert st.params != tuple(default for _, default in row.params)
    assert all(p is not None for p in st.params)
    if "left" in case:
        assert st.args[1] == "acc" and st.args[0] == "in0"
    inputs = problem.make_inputs(0)
    inputs[0][2] = float("nan")  # one row of the Linear output is NaN
    inputs[0][4, 0] = float("inf")
    assert_interpreter_matches(problem, plan, inputs=inputs)
    # and the CUDA expression renders with every placeholder filled
    sources = generate(plan)
    assert sources is not None
    apply_fn = sources.cuda[sources.cuda.index("k0_apply"):sources.cuda.index("k0_kernel")]
    for placeholder in ("{0}", "{1}", "{p0}", "{p1}", "None"):
        assert placeholder not in apply_fn


def test_render_cuda_gelu_variants_and_alpha():
    gelu = POINTWISE_BY_ATEN["gelu.default"]
    assert render_cuda(gelu, ["v"], ["none"]) == "kf_gelu_erf(v)"
    assert render_cuda(gelu, ["v"], ["tanh"]) == "kf_gelu_tanh(v)"
    add = POINTWISE_BY_ATEN["add.Tensor"]
    assert render_cuda(add, ["a", "b"], [1.0]) == "(a + b)"
    assert render_cuda(add, ["a", "b"], [0.5]) == "(a + 0.5f * b)"
    clamp = POINTWISE_BY_ATEN["clamp.default"]
    assert render_cuda(clamp, ["v"], [float("-inf"), 0.25]) == "kf_clamp(v, (-INFINITY), 0.25f)"


@pytest.mark.parametrize("value, text", [(0.1, "0.10000000149011612f"), (2.0, "2.0f"), (-0.5, "(-0.5f)"),
                                         (float("nan"), "NAN"), (float("inf"), "INFINITY"),
                                         (float("-inf"), "(-INFINITY)"), (1e-30, "1.0000000031710769e-30f"),
                                         (3, "3.0f")])
def test_float_literal_is_the_float32_value(value, text):
    assert float_literal(value) == text


# ---- every row at once, compiled with nvcc ------------------------------------------------------------------

def all_rows_expr() -> str:
    """One chain applying every case's op in turn, so one epilogue holds every row. (No two clamp-like cases are
    adjacent, else the rewrite merges them, and clone comes last: one inside a chain is bypassed.)"""
    v = "y"
    for _, expr, _ in CASES.values():
        v = expr.replace("(y", f"({v}").replace(", y", f", {v}")
    return v


ALL_BODY = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16, dtype={dtype})
    self.w = nn.Parameter(torch.rand(16, dtype={dtype}) + 0.5)

def forward(self, x):
    y = self.lin(x)
    return {expr}
"""


def _all_rows_plan(tmp_path, dtype: str):
    path = write_problem(tmp_path, f"all_rows_{dtype.split('.')[-1]}",
                         ALL_BODY.format(dtype=dtype, expr=all_rows_expr()), f"[torch.rand(8, 16, dtype={dtype})]")
    problem, graph, plans = pipeline(path)
    (plan,) = plans
    return problem, plan


def test_all_rows_fuse_into_one_epilogue(tmp_path):
    problem, plan = _all_rows_plan(tmp_path, "torch.float32")
    (step,) = plan.fused
    assert plan.unfused == []
    assert {st.aten for st in step.epilogue.statements} == set(POINTWISE_BY_ATEN) - BOOL_ROWS
    # every pointwise node left after the rewrite (which merges adjacent clamps) is one statement
    assert len(step.epilogue.statements) == sum(n.op in POINTWISE_BY_ATEN for n in plan.graph.nodes)
    assert_interpreter_matches(problem, plan)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16", "torch.bfloat16"])
def test_all_rows_compile_with_nvcc(tmp_path, dtype):
    nvcc = _nvcc()
    _, plan = _all_rows_plan(tmp_path, dtype)
    sources = generate(plan)
    cu = tmp_path / "all_rows.cu"
    cu.write_text(sources.cuda)
    for row in (r for r in POINTWISE_OPS if r.aten not in BOOL_ROWS):  # every row's expression is in the TU
        assert f"// {row.aten.split('.')[0]}" in sources.cuda
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(cu), "-o", str(tmp_path / "all_rows.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "all_rows.o").stat().st_size > 0
