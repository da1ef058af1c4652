"""A concatenation of pointwise branches selected inside the flat kernel that reads it (kernelfuse.plan.catselect):
Llama's rotary embedding is one kernel per rotation, not a `neg` kernel, a torch `cat` and a multiply-add kernel.
Each case is checked three ways: the plan interpreter against eager, the generated kernel in the CPU emulation
against the interpreter, and the CUDA file through nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

from kernelfuse.codegen import generate
from kernelfuse.plan.catselect import SELECT, selects

ROTARY = Path(__file__).parent / "fixtures" / "problems" / "rotary_cat.py"

CASES = {  # name: (forward, inputs)
    "three_branches": ("def forward(self, x, y, z):\n"
                       "    return torch.cat((x * 2.0, torch.sin(y), z - 1.0), -1) * x.sum()",
                       "[torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 2)]"),
    "middle_dim": ("def forward(self, x, y):\n    return torch.cat((x.exp(), y), 1) + 1.0",
                   "[torch.randn(2, 3, 5), torch.randn(2, 4, 5)]"),
    "bare_view_branch": ("def forward(self, x):\n    return torch.cat((-x[:, 5:], x[:, :5]), 1) * x",
                         "[torch.randn(6, 12)]"),
    "only_views": ("def forward(self, x):\n    return torch.cat((x[:, 2:], x[:, :2]), 1) * 2.0",  # a windowed source
                   "[torch.randn(4, 7)]"),
    "broadcast_in_branch": ("def __init__(self):\n    super().__init__()\n    self.w = nn.Parameter(torch.randn(4))\n\n"
                            "def forward(self, x, y):\n    return torch.relu(torch.cat((x * self.w, y), -1)) - 0.5",
                            "[torch.randn(3, 4), torch.randn(3, 2)]"),
    "returned_too": ("def forward(self, x, y):\n    c = torch.cat((x * 2.0, y + 1.0), 0)\n    return c, c * 3.0",
                     "[torch.randn(2, 8), torch.randn(3, 8)]"),
    "rotate_half_first": ("def forward(self, x, cos, sin):\n    h = x.shape[-1] // 2\n"
                          "    return torch.cat((-x[..., h:], x[..., :h]), -1) * sin + x * cos",
                          "[torch.randn(2, 3, 8, 16), torch.randn(8, 16), torch.randn(8, 16)]"),
    "bf16_rotary": ("def forward(self, x, cos, sin):\n    h = x.shape[-1] // 2\n"
                    "    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin",
                    "[torch.randn(2, 8, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16()]"),
    "transposed_rotary": ("def forward(self, x, cos, sin):\n    q = x.transpose(1, 2)\n    h = q.shape[-1] // 2\n"
                          "    return q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin",
                          "[torch.randn(2, 8, 3, 16), torch.randn(8, 16), torch.randn(8, 16)]"),
    "reshaped_after": ("def forward(self, x, y):\n    return (torch.cat((x * 2.0, y), -1).reshape(-1) + 1.0).exp()",
                       "[torch.randn(3, 4), torch.randn(3, 2)]"),
}


def _case(tmp_path: Path, name: str) -> tuple:
    forward, inputs = CASES[name]
    return pipeline(write_problem(tmp_path, name, forward, inputs))


def _selecting(plan) -> list:
    return [g for g in plan.generated if selects(g.prologue)]


def _cats(graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "cat.default"]


def test_rotary_is_one_kernel_per_rotation():
    problem, graph, plans = pipeline(ROTARY)
    for plan in plans:
        assert not plan.unfused, plan.summary()
        kernels = _selecting(plan)
        assert len(plan.generated) == len(kernels) == 2, plan.summary()
        for step in kernels:  # the negation, the cat and the multiply-add: one kernel
            assert [graph[n].op.split(".")[0] for n in step.replaces] == ["mul", "neg", "cat", "mul", "add"]
            assert step.source.window is None and sum(o.window is not None for o in step.prologue.operands) == 2
        assert len(plan.attention) == 1
    assert_interpreter_matches(problem, plans[0], atol=1e-5, rtol=1e-5)  # attention's reference sums otherwise


@pytest.mark.parametrize("name", list(CASES))
def test_cat_joins_the_kernel_and_matches_eager(tmp_path, name):
    problem, graph, plans = _case(tmp_path, name)
    plan = plans[0]
    assert not [s for s in plan.unfused if s.node.op == "cat.default"], plan.summary()
    owners = [g for g in plan.generated for c in _cats(graph) if c in g.replaces]
    assert len(owners) == len(_cats(graph)) == 1 and selects(owners[0].prologue), plan.summary()
    if name == "returned_too":  # the kernel writes the concatenation; its other reader is a kernel of its own
        assert owners[0].out == _cats(graph)[0] and len(plan.generated) == 2, plan.summary()
    if name.startswith(("rotate", "bf16", "transposed")):
        assert len(plan.generated) == 1, plan.summary()  # the neg seeds no kernel of its own
    if name == "transposed_rotary":  # the output keeps the transposed layout eager gives q * cos
        assert owners[0].permuted_out is not None, plan.summary()
    if name == "only_views":
        assert owners[0].source.window is not None
    tolerance = 1e-2 if name.startswith("bf16") else 1e-6
    assert_interpreter_matches(problem, plan, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", [*CASES, "rotary"])
def test_emulated_kernels_match_the_interpreter(tmp_path, name):
    plan = pipeline(ROTARY)[2][0] if name == "rotary" else _case(tmp_path, name)[2][0]
    assert emulated_against_interpreter(plan, tmp_path, ulps=2) >= 1


def test_windowed_reads_are_scalar_and_clamped(tmp_path):
    """The packed (16-byte) accesses keep to the plain operands; a window's reads are clamped into the branch."""
    plan = pipeline(ROTARY)[2][0]
    cuda = generate(plan).cuda
    body = cuda[cuda.index("// k0"):cuda.index("// k1")]
    assert "kf_pack_load<float, VEC>(p_in0_p" in body and "p_in1_p + " not in body and "p_in2_p + " not in body
    assert "(o_xc3 >= 15 ? 15 : o_xc3)" in body  # the negated half: elements 16.. of x
    assert "(o_xc3 < 16 ? 0 : o_xc3 - 16)" in body  # the other half
    assert "(o_xc3 < 16 ? p_v_neg : p_in2)" in body  # the index along the last dim, through the space


def test_a_cat_feeding_a_reduction_keeps_the_reduction_prologue(tmp_path):
    """A cat of tensors in memory read by a pointwise prologue of a reduction stays a torch call (the prologue
    would read it from memory anyway); one with a pointwise branch becomes the kernel that writes it."""
    path = write_problem(tmp_path, "reduced", "def forward(self, x, y):\n"
                         "    return torch.relu(torch.cat((x, y), 1)).sum(1), torch.cat((x * 2, y), 1).sum(1)",
                         "[torch.randn(64, 8), torch.randn(64, 3)]")
    problem, graph, plans = pipeline(path)
    plan = plans[0]
    cats = _cats(graph)
    assert [s.node.name for s in plan.unfused if s.node.op == "cat.default"] == cats[:1], plan.summary()
    assert any(g.out == cats[1] and selects(g.prologue) for g in plan.generated), plan.summary()
    assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)


def test_no_select_in_a_channels_last_conv_input(tmp_path):
    """A kernel that selects keeps writing NCHW when a channels-last convolution reads it (kernelfuse.plan.convinput
    does not make it write channels-last), and still matches eager."""
    body = "def __init__(self):\n    super().__init__()\n    self.conv = nn.Conv2d(6, 4, 3)\n\n" \
           "def forward(self, x, y):\n    return self.conv(torch.cat((x * 2.0, y), 1).relu())"
    problem, graph, plans = pipeline(write_problem(tmp_path, "conv", body,
                                                   "[torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8)]"))
    for plan in plans:
        for step in _selecting(plan):
            assert step.permuted_out is None and step.out_meta.is_contiguous, plan.variant
    assert any(_selecting(p) for p in plans)
    assert_interpreter_matches(problem, plans[0], atol=1e-4, rtol=1e-4)


def test_generated_cuda_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    plans = [pipeline(ROTARY)[2][0], *(_case(tmp_path, name)[2][0] for name in ("three_branches", "only_views",
                                                                                 "bf16_rotary"))]
    for i, plan in enumerate(plans):
        assert any(st.op == SELECT for g in plan.generated for st in g.prologue.statements)
        cu = tmp_path / f"cat{i}.cu"
        cu.write_text(generate(plan).cuda)
        result = subprocess.run([nvcc, "-c", "-O1", "-std=c++17", "-arch=sm_90", str(cu), "-o", str(tmp_path / "a.o")],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
