"""Stage 5 — codegen: operand index expressions (checked numerically) and the shape of the generated CUDA."""

from __future__ import annotations

import random
import re

import pytest
import torch
from optimizer_helpers import EXAMPLES, pipeline, write_problem

from kernelfuse.capture import TensorMeta, capture, contiguous_strides
from kernelfuse.codegen import generate, offset_expr
from kernelfuse.load import load_problem
from kernelfuse.plan import broadcast_strides, plan_variants
from kernelfuse.rewrite import rewrite


def c_eval(expr: str, i: int) -> int:
    """Evaluate a generated C index expression (non-negative integers: C's `/` is Python's `//`)."""
    assert re.fullmatch(r"[i0-9 ()+*/%]+", expr), expr
    return eval(expr.replace("/", "//"), {"__builtins__": {}}, {"i": i})


def check_offsets(op_shape, out_shape, op_stride=None, samples: int = 300) -> str:
    """offset_expr against torch.broadcast_to on a strided view of arange: returns the expression."""
    op_stride = tuple(op_stride) if op_stride is not None else contiguous_strides(tuple(op_shape))
    storage = 1 + sum((d - 1) * s for d, s in zip(op_shape, op_stride, strict=True)) if all(op_shape) else 1
    base = torch.arange(storage, dtype=torch.int64)
    operand = base.as_strided(op_shape, op_stride)
    meta = TensorMeta(tuple(op_shape), torch.int64, op_stride)
    out = TensorMeta(tuple(out_shape), torch.int64, contiguous_strides(tuple(out_shape)))
    expr = offset_expr(broadcast_strides(meta, out), out.shape)
    expected = torch.broadcast_to(operand, out_shape).reshape(-1)  # the operand's value at each logical index
    numel = expected.numel()
    rng = random.Random(0)
    indices = {0, numel - 1, *(rng.randrange(numel) for _ in range(samples))}
    for i in sorted(indices):
        assert c_eval(expr, i) == int(expected[i]), f"{expr} at i={i}"
    return expr


@pytest.mark.parametrize("op_shape, out_shape, expected", [
    ((8192,), (1024, 8192), "(i % 8192)"),
    ((128, 1, 1), (4, 128, 126, 126), "((i / 15876) % 128)"),
    ((1, 128, 1, 1), (4, 128, 12, 12), "((i / 144) % 128)"),
    ((4, 8, 6), (4, 8, 6), "i"),
    ((), (4, 8), "0"),
    ((1,), (4, 8), "0"),
    ((1, 1, 1), (2, 3, 4), "0"),
    ((4, 1), (4, 8), "(i / 8)"),
    ((3, 1, 5), (3, 4, 5), "(i / 20) * 5 + (i % 5)"),
    ((4, 1, 1), (4, 6, 7), "(i / 42)"),
    ((6, 1), (4, 6, 7), "((i / 7) % 6)"),
    ((6, 7), (4, 6, 7), "(i % 42)"),
    ((2, 1, 3, 1), (2, 5, 3, 4), "(i / 60) * 3 + ((i / 4) % 3)"),
])
def test_offset_expr_cases(op_shape, out_shape, expected):
    assert check_offsets(op_shape, out_shape) == expected


@pytest.mark.parametrize("op_shape, out_shape, op_stride", [
    ((8, 6), (8, 6), (1, 8)),             # a transposed operand
    ((5, 1, 7), (5, 3, 7), (1, 1, 5)),    # transposed, broadcast in the middle
    ((2, 3, 4), (2, 3, 4), (12, 1, 3)),   # channels-last-like permutation
    ((3, 4), (2, 3, 4), (8, 2)),          # strided (every other element)
    ((1, 4), (3, 1, 4), (4, 1)),          # output dimension of size 1
])
def test_offset_expr_non_contiguous_operands(op_shape, out_shape, op_stride):
    check_offsets(op_shape, out_shape, op_stride)


def test_offset_expr_random_broadcasts():
    rng = random.Random(1)
    for _ in range(60):
        out_shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        keep = rng.randint(0, len(out_shape))
        op_shape = tuple(d if rng.random() < 0.6 else 1 for d in out_shape[len(out_shape) - keep:])
        check_offsets(op_shape, out_shape, samples=40)


# ---- generated text --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example_sources():
    out = {}
    for name in ("gemm_add_relu", "gemm_sigmoid_scaling_residualadd", "conv2d_relu_biasadd"):
        plans = plan_variants(rewrite(capture(load_problem(EXAMPLES / f"{name}.py"))))
        out[name] = {p.variant: generate(p) for p in plans}
    return out


def test_gemm_kernel_is_flat_and_in_place(example_sources):
    src = example_sources["gemm_add_relu"]["fused"]
    assert src.functions == ("k0",)
    assert "// k0: mm -> add -> relu" in src.cuda
    assert "k0_kernel(const float* acc, float* out, const float* __restrict__ in0)" in src.cuda
    assert "kf_pack<float, VEC>" in src.cuda and "constexpr int k0_VEC = 4;" in src.cuda
    assert "constexpr int kNumel = 8388608;" in src.cuda
    assert "const float in0 = kf_load(in0_p[(i % 8192)]);" in src.cuda
    assert "const float v_add = (acc + in0);" in src.cuda and "kf_relu(v_add)" in src.cuda
    assert "to_channels_last" not in src.binding and "__shared__" not in src.cuda
    assert "(in place on the library output)" in src.binding
    assert "        out = acc\n" in src.binding
    assert '_check_dense(acc, "k0 input", (1024, 8192), torch.float32)' in src.binding
    assert '_check_dense(in0, "k0 operand in0 (arg0_1)", (8192,), torch.float32)' in src.binding
    assert 'KF_EXPORT cudaError_t k0_launch(const void* acc, void* out, const void* in0, cudaStream_t stream)' \
        in src.cuda
    assert 'self._k0 = self._function("k0_launch", [ctypes.c_void_p] * 3)' in src.binding
    assert 'self._launch(self._k0, "k0", acc, acc.data_ptr(), out.data_ptr(), in0.data_ptr())' in src.binding
    assert "#include <torch/extension.h>" not in src.cuda, "the kernel TU stays free of torch headers"


def test_gemm_residual_reads_acc_twice_without_operands(example_sources):
    src = example_sources["gemm_sigmoid_scaling_residualadd"]["fused"]
    assert "float k0_apply(float acc, int i) {" in src.cuda
    assert "(v_sigmoid * 2.0f)" in src.cuda and "(v_mul + acc)" in src.cuda
    assert "    def k0(self, acc):" in src.binding


def test_conv_nhwc_has_transpose_kernel_and_to_channels_last(example_sources):
    src = example_sources["conv2d_relu_biasadd"]["fused-nhwc"]
    assert src.functions == ("to_channels_last", "k0")
    assert "kf_nchw_to_nhwc_kernel" in src.cuda and "kf_nchw_to_nhwc_float32(" in src.cuda
    assert "    def to_channels_last(self, x, round_tf32=False):" in src.binding
    assert "self._to_nhwc_tf32 = {}" in src.binding and "kf_nchw_to_nhwc_float32_rna" not in src.cuda  # no TMA conv
    assert 'torch.float32: self._function("kf_nchw_to_nhwc_float32"' in src.binding
    assert "constexpr int C = 128, HW = 15876;" in src.cuda
    assert "__shared__ float tile[" in src.cuda
    assert "kf_load(in0_p[((i / 15876) % 128)])" in src.cuda
    # not in place: reads channels-last acc, writes a new NCHW tensor
    assert "out = acc.new_empty(acc.shape)  # NCHW" in src.binding
    assert "acc = acc.contiguous(memory_format=torch.channels_last)" in src.binding
    assert '_check_dense(acc, "k0 input", (128, 128, 126, 126), torch.float32, torch.channels_last)' in src.binding
    assert "(in place on the library output)" not in src.binding


def test_conv_nchw_is_flat_in_place(example_sources):
    src = example_sources["conv2d_relu_biasadd"]["fused-nchw"]
    assert src.functions == ("k0",)
    assert "kf_nchw_to_nhwc" not in src.cuda and "to_channels_last" not in src.binding
    assert "kf_pack<float, VEC>" in src.cuda
    assert "        out = acc\n" in src.binding


def test_plan_without_kernels_generates_nothing(tmp_path):
    path = write_problem(tmp_path, "convrelu", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return torch.relu(self.conv(x))
        """, "[torch.rand(2, 3, 10, 10)]")
    _, _, (nhwc, nchw) = pipeline(path)
    assert generate(nchw) is None  # cuDNN's conv+bias+relu alone
    assert generate(nhwc).functions == ("to_channels_last", "k0")  # the layout change back is a kernel


BIG = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16)

def forward(self, x):
    return torch.relu(self.lin(x))
"""


@pytest.mark.parametrize("rows, index_t", [
    (1 << 27, "long long"),        # 2^31 elements
    ((1 << 27) - 1, "long long"),  # 2^31 - 16: a grid-stride step past the end would overflow int
    (1 << 20, "int"),
])
def test_index_type(tmp_path, rows, index_t):
    _, _, (plan,) = pipeline(write_problem(tmp_path, "big", BIG, f"[torch.rand({rows}, 16)]"))
    src = generate(plan)
    numel = rows * 16
    assert f"constexpr {index_t} kNumel = {numel};" in src.cuda
    assert f"float k0_apply(float acc, {index_t} i)" in src.cuda
    assert f"for ({index_t} v = first;" in src.cuda and f"for ({index_t} i = kNumel / VEC * VEC + first;" in src.cuda
    assert f"kf_blocks({numel}LL" in src.cuda


def test_index_type_transpose_kernel(tmp_path):
    path = write_problem(tmp_path, "bigconv", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 64, 1)

        def forward(self, x):
            return torch.relu(self.conv(x)) * 2.0
        """, "[torch.rand(512, 4, 256, 256)]")  # output 2^31 elements
    _, _, (nhwc, nchw) = pipeline(path)
    src = generate(nhwc)
    assert "const long long base = (long long)blockIdx.z * C * HW;" in src.cuda
    assert "const long long i = base + (long long)c * HW + hw;" in src.cuda


@pytest.mark.parametrize("dtype, ctype, vec", [
    ("torch.float16", "__half", 8),
    ("torch.bfloat16", "__nv_bfloat16", 8),
])
def test_low_precision_types(tmp_path, dtype, ctype, vec):
    path = write_problem(tmp_path, "lowp", f"""
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 32, dtype={dtype})
            self.b = nn.Parameter(torch.randn(32, dtype={dtype}))

        def forward(self, x):
            return torch.sigmoid(self.lin(x) + self.b)
        """, f"[torch.rand(4, 16, dtype={dtype})]")
    _, _, (plan,) = pipeline(path)
    src = generate(plan)
    assert f"const {ctype}* __restrict__ in0" in src.cuda
    assert f"kf_pack<{ctype}, VEC>" in src.cuda and f"constexpr int k0_VEC = {vec};" in src.cuda
    assert f"kf_store<{ctype}>(k0_apply(kf_load(p.v[j])" in src.cuda
    assert "const float in0 = kf_load(in0_p[(i % 32)]);" in src.cuda  # math in float opmath
    assert f'_check_dense(acc, "k0 input", (4, 32), {dtype})' in src.binding


def test_conv_nhwc_half_uses_typed_transpose(tmp_path):
    path = write_problem(tmp_path, "halfconv", """
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, dtype=torch.float16)

        def forward(self, x):
            return torch.relu(self.conv(x)) + 1.0
        """, "[torch.rand(2, 3, 10, 10, dtype=torch.float16)]")
    _, _, (nhwc, _) = pipeline(path)
    src = generate(nhwc)
    assert "kf_nchw_to_nhwc_float16(" in src.cuda and "<__half" in src.cuda
    assert 'torch.float16: self._function("kf_nchw_to_nhwc_float16"' in src.binding


def test_kernel_sizes_follow_the_captured_shapes(tmp_path):
    sources = []
    for rows in (3, 5):
        _, _, (plan,) = pipeline(write_problem(tmp_path, f"rows{rows}", BIG, f"[torch.rand({rows}, 16)]"))
        sources.append(generate(plan))
    assert "constexpr int kNumel = 48;" in sources[0].cuda and "constexpr int kNumel = 80;" in sources[1].cuda
    assert "(3, 16)" in sources[0].binding and "(5, 16)" in sources[1].binding
