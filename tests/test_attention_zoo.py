"""The attention zoo (every form the flash-attention kernel takes, one model): its plan, a golden snapshot of the
rendered CUDA, an nvcc build for sm_90 whose launchers have the arity their bindings declare, and on the GPU the
emitted ModelNew against eager (fp32 within the strict rule)."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
from pathlib import Path

import pytest
import torch
from optimizer_helpers import assert_interpreter_matches
from test_nvcc_compile import _nvcc

from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

FIXTURES = Path(__file__).parent / "fixtures"
ZOO = FIXTURES / "problems" / "zoo_attention.py"
GOLDEN = FIXTURES / "golden" / "zoo_attention.cu"


@pytest.fixture(scope="module")
def zoo():
    problem = load_problem(ZOO)
    plan, split, library = plan_variants(rewrite(capture(problem, build_model(problem))))
    assert split.variant == "fused-3xtf32" and {a.math for a in split.attention} == {"3xtf32"}
    assert library.variant == "fused-sdpa" and {a.impl for a in library.attention} == {"library", "kernel"}  # relu
    return problem, plan


def test_every_attention_of_the_zoo_is_one_kernel(zoo):
    _, plan = zoo
    kinds = [(a.origin, a.dims[5], a.mask_kind, a.causal, a.dims[1] // a.dims[2], a.activation)
             for a in plan.attention]
    assert kinds == [("hand-written", 96, "drop", False, 1, "softmax"), ("hand-written", 96, "none", False, 1, "relu"),
                     ("sdpa", 40, "keep", False, 1, "softmax"), ("sdpa", 128, "none", False, 4, "softmax"),
                     ("sdpa", 256, "none", True, 1, "softmax"), ("hand-written", 64, "add", False, 1, "softmax")]
    assert not {s.node.op for s in plan.unfused} & {"bmm.default", "_softmax.default", "clone.default",
                                                    "scaled_dot_product_attention.default"}


def test_zoo_interpreter_matches_the_model(zoo):
    problem, plan = zoo
    assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)


def test_zoo_attention_matches_the_golden_snapshot(zoo):
    """A refactor that changes no kernel changes no byte here; regenerate with KERNELFUSE_UPDATE_GOLDEN=1."""
    _, plan = zoo
    sources = generate(plan)
    text = sources.cuda + "\n// ---- bindings ----\n" + sources.binding
    if os.environ.get("KERNELFUSE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_zoo_attention_builds_with_nvcc_for_sm90(zoo, tmp_path):
    nvcc = _nvcc()
    _, plan = zoo
    sources = generate(plan)
    cu, lib = tmp_path / "attention.cu", tmp_path / "attention.so"
    cu.write_text(sources.cuda)
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC", str(cu),
                             "-o", str(lib)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
    for step in plan.attention:
        assert f"{step.kernel}_launch" in exported
        params = re.search(rf"KF_EXPORT cudaError_t {step.kernel}_launch\(([^)]*)\)", sources.cuda).group(1)
        declared = re.search(rf'"{step.kernel}_launch", \[ctypes.c_void_p\] \* (\d+)', sources.binding).group(1)
        assert len(params.split(",")) == int(declared) + 1  # the tensors, out, then the stream


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_zoo_attention_matches_eager_on_the_gpu(zoo, tmp_path, seed):
    problem, plan = zoo
    path = tmp_path / "zoo_attention_new.py"
    path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    ns = runpy.run_path(str(path))
    torch.manual_seed(seed)
    inputs = [t.cuda() for t in ns["get_inputs"]()]
    torch.manual_seed(0)
    ref = runpy.run_path(str(ZOO))["Model"](*ns["get_init_inputs"]()).cuda()
    torch.manual_seed(0)
    new = ns["ModelNew"](*ns["get_init_inputs"]()).cuda()
    with torch.no_grad():
        expected, got = ref(*inputs), new(*inputs)
    bad = [f"output {i}: max abs err {(g - e).abs().max().item():.3g}"
           for i, (e, g) in enumerate(zip(expected, got, strict=True))
           if g.shape != e.shape or not torch.allclose(g, e, atol=1e-4, rtol=1e-4, equal_nan=True)]
    assert not bad, bad
