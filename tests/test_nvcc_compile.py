"""Compile-only checks of the generated extension sources, without a GPU.

Every variant's kernel file (no torch headers) is compiled with nvcc; one binding .cpp is syntax-checked with the
host compiler against torch's headers (about 20 s: marked `torch_headers`, deselect with -m "not torch_headers").
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from optimizer_helpers import EXAMPLE_NAMES, EXAMPLES

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

NVCC_PLACES = ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or next((p for p in NVCC_PLACES if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or in /usr/local")
    return nvcc


def _example_variants() -> list[tuple[str, str]]:
    return [(name, variant) for name in EXAMPLE_NAMES
            for variant in (("fused-nhwc", "fused-nchw") if name.startswith("conv") else ("fused",))]


@pytest.fixture(scope="module")
def sources():
    out = {}
    for name in EXAMPLE_NAMES:
        for plan in plan_variants(rewrite(capture(load_problem(EXAMPLES / f"{name}.py")))):
            out[(name, plan.variant)] = generate(plan)
    return out


def test_variants_are_as_expected(sources):
    assert sorted(sources) == sorted(_example_variants())
    assert all(s is not None for s in sources.values())


@pytest.mark.parametrize("name, variant", _example_variants())
def test_kernels_compile_with_nvcc(sources, tmp_path, name, variant):
    nvcc = _nvcc()
    cu = tmp_path / f"{name}_{variant}.cu"
    cu.write_text(sources[(name, variant)].cuda)
    obj = tmp_path / "out.o"
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(cu), "-o", str(obj)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert obj.stat().st_size > 0
    # every launcher the bindings declare is defined in the kernel file
    cpp = sources[(name, variant)].cpp
    for fn in sources[(name, variant)].functions:
        launcher = "kf_nchw_to_nhwc_float32(" if fn == "to_channels_last" else f"cudaError_t {fn}_launch("
        assert launcher in cpp and launcher in cu.read_text()


def _cuda_include() -> str | None:
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "include")
    candidates += [Path(p) for p in sorted(glob.glob("/usr/local/cuda*/include"))]
    site = Path(torch.__file__).resolve().parents[1]
    candidates += [site / "nvidia" / "cu13" / "include", site / "nvidia" / "cuda_runtime" / "include"]
    for c in candidates:
        if (c / "cuda_runtime_api.h").is_file():
            return str(c)
    return None


@pytest.mark.torch_headers
def test_binding_cpp_compiles_against_torch_headers(sources, tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler (c++/g++) on PATH")
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("no CUDA headers: set CUDA_HOME, or install them in /usr/local/cuda*/include or nvidia/cu13")
    torch_dir = Path(torch.__file__).resolve().parent
    if not (torch_dir / "include" / "torch" / "extension.h").is_file():
        pytest.skip("this torch has no C++ headers")
    # the nhwc conv variant: the largest binding file (to_channels_last plus an epilogue wrapper)
    cpp = tmp_path / "bindings.cpp"
    cpp.write_text(sources[("conv2d_relu_biasadd", "fused-nhwc")].cpp)
    # torch's own extension builds use C++20 (its headers require it); the kernel file above is C++17-clean
    cmd = [cxx, "-std=c++20", "-fsyntax-only", f"-I{torch_dir / 'include'}",
           f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", str(cpp)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
