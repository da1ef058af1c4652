"""Packed operand loads in flat kernels (kernelfuse.codegen.generated._packed): an operand that runs along the
innermost dim with the output (a channels-last per-channel parameter, a residual) moves VEC elements per access,
one constant along it (a per-channel parameter over NCHW planes) is loaded once per VEC elements, and the
one-element instantiation takes over where a pointer is not 16-byte aligned. Checked in the CPU emulation against
the plan interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from emulation_helpers import emulated, emulated_against_interpreter
from optimizer_helpers import write_problem

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.codegen.iteration import tensor_args
from kernelfuse.load import load_problem
from kernelfuse.pipeline import build_model
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

BLOCK = """
def __init__(self):
    super().__init__()
    self.conv1 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    self.bn1 = nn.BatchNorm2d(16)
    self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    self.bn2 = nn.BatchNorm2d(16)
    self.scale = nn.Parameter(torch.rand(16, 1, 1) + 0.5)
    self.conv3 = nn.Conv2d(16, 4, 1)
    with torch.no_grad():
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)

def forward(self, x):
    y = torch.relu(self.bn1(self.conv1(x)))
    return self.conv3(torch.relu(self.bn2(self.conv2(y)) + y) * self.scale)
"""


def _plans(tmp_path: Path) -> dict:
    path = write_problem(tmp_path, "packed_block", BLOCK, "[torch.randn(2, 8, 8, 8)]")
    problem = load_problem(path)
    graph = rewrite(capture(problem, build_model(problem).eval()))
    return {p.variant: p for p in plan_variants(graph, "strict")}


def _norms(plan) -> list:
    return [s for s in plan.generated if s.spec is not None and s.spec.kind == "affine_norm"]


@pytest.mark.parametrize("variant, load", [("fused-cl", "kf_pack_load<float, VEC>(weight + b_weight)"),
                                           ("fused-nchw", "const float k_weight = kf_load(weight[b_weight]);")])
def test_per_channel_operands_are_loaded_once_per_pack(tmp_path, variant, load):
    plan = _plans(tmp_path)[variant]
    cuda = generate(plan).cuda
    for step in _norms(plan):
        body = cuda[cuda.index(f"// {step.kernel}:"):cuda.index(f"{step.kernel}_launch")]
        assert load in body, body
        assert "kf_load(weight[a_weight])" not in body  # no per-element parameter load left
    assert emulated_against_interpreter(plan, tmp_path, ulps=16) == len(plan.generated)


def test_an_unaligned_operand_takes_the_one_element_kernel(tmp_path):
    plan = _plans(tmp_path)["fused-cl"]
    step = next(s for s in _norms(plan) if s.epilogue.operands)  # bn2's: its parameters, a residual, a scale
    assert "((uintptr_t)ep0 % 16 == 0)" in generate(plan).cuda  # the residual is a run
    emu = emulated(plan, tmp_path)
    torch.manual_seed(0)
    tensors = []
    for name, ref in tensor_args(step):
        meta = step.source.meta if name == "src" else plan.graph[ref].meta
        value = torch.rand(meta.shape) + 0.5
        tensors.append(torch.empty_strided(meta.shape, meta.stride).copy_(value))
    aligned = getattr(emu.kernels, step.kernel)(*tensors)
    weight = tensors[1]  # the same values one float into a buffer: 4-byte, not 16-byte, aligned
    shifted = torch.empty(weight.numel() + 1)[1:].copy_(weight)
    assert shifted.data_ptr() % 16 != 0
    unaligned = getattr(emu.kernels, step.kernel)(tensors[0], shifted, *tensors[2:])
    assert torch.equal(aligned, unaligned)
    assert not aligned.isnan().any()


GATED = """
def __init__(self):
    super().__init__()
    self.proj = nn.Linear(16, 64)

def forward(self, x):
    a, gate = self.proj(x).chunk(2, -1)
    return a * F.gelu(gate)
"""


def test_a_source_read_at_offsets_of_its_own_moves_vec_elements_per_access(tmp_path):
    # GEGLU's halves: the source and the operand are chunks of one wider tensor (rows of 64, 32 elements each),
    # the output is contiguous; both run along the innermost dim with it
    path = write_problem(tmp_path, "gated", GATED, "[torch.randn(2, 8, 16)]")
    problem = load_problem(path)
    graph = rewrite(capture(problem, build_model(problem).eval()))
    plan = plan_variants(graph, "strict")[0]
    (step,) = [s for s in plan.generated if "gelu" in s.chain(plan.graph)]
    assert step.source.strides != step.out_meta.stride
    assert "kf_pack_load<float, VEC>(src + b_src)" in generate(plan).cuda
    emu = emulated(plan, tmp_path)
    wide = torch.randn(2, 8, 64)
    a, gate = wide.chunk(2, -1)
    names = [name for name, _ in tensor_args(step)]
    got = getattr(emu.kernels, step.kernel)(*(gate if step.source.ref.name == ref.name else a
                                              for _, ref in tensor_args(step)))
    assert names == ["src", "in0"]
    torch.testing.assert_close(got, a * torch.nn.functional.gelu(gate), rtol=1e-6, atol=1e-6)
