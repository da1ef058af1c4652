"""Compile-only checks of the generated extension sources, without a GPU.

Every variant's kernel file (no torch headers) is compiled with nvcc, and built as the shared library its
Python binding loads.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from optimizer_helpers import EXAMPLE_NAMES, EXAMPLES

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.compilecheck import nvcc_command
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


@pytest.mark.parametrize("name, variant", _example_variants())
def test_every_binding_reaches_an_exported_launcher_of_its_arity(sources, tmp_path, name, variant):
    """ctypes finds a launcher by its unmangled name and passes exactly the declared arguments: a symbol the
    library does not export, or one argument too many or too few, would fail or corrupt at run time."""
    nvcc = _nvcc()
    src = sources[(name, variant)]
    cu, lib = tmp_path / "kernels.cu", tmp_path / "kernels.so"
    cu.write_text(src.cuda)
    result = subprocess.run(nvcc_command(nvcc, cu, lib), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
    declared = re.findall(r'self._function\("(\w+)", (\[ctypes.c_void_p\] \* (\d+)|\[[^\]]*\])\)', src.binding)
    assert len(declared) == len(src.functions)
    assert "kf_error_string" in exported
    # nothing else leaves the library: torch loads it RTLD_GLOBAL, where another file's equal template kernel
    # would otherwise bind to this one's copy
    symbols = exported[2::3]
    assert sorted(symbols) == sorted(["kf_error_string", *(d[0] for d in declared)]), symbols
    for symbol, argtypes, pointers in declared:
        assert symbol in exported, f"{symbol} is not exported unmangled"
        params = re.search(rf"KF_EXPORT cudaError_t {symbol}\(([^)]*)\)", src.cuda).group(1).split(",")
        count = int(pointers) if pointers else argtypes.count("ctypes.")
        assert len(params) == count + 1, (symbol, params)  # the stream comes last
        assert "cudaStream_t" in params[-1]


def test_the_emitted_loader_builds_with_the_flags_the_compile_check_uses():
    from kernelfuse.compilecheck import LOADER_FLAGS
    from kernelfuse.emit.runtime import LOADER

    assert '"-fvisibility=hidden"' in LOADER and "-fvisibility=hidden" in LOADER_FLAGS


def test_every_prelude_compiles_in_one_file(tmp_path):
    """A plan may need all the kernel families at once (ConvolutionalVisionTransformer: implicit-GEMM convolutions
    beside attention): their preludes must not define one name twice (both once had a kf_tf32)."""
    from kernelfuse.codegen.attention_flash import FLASH_PRELUDE
    from kernelfuse.codegen.attention_mma import MMA_ATTENTION_PRELUDE
    from kernelfuse.codegen.attention_prelude import ATTENTION_PRELUDE
    from kernelfuse.codegen.conv_igemm_prelude import IGEMM_PRELUDE
    from kernelfuse.codegen.cuda import HEADER
    from kernelfuse.codegen.generated import REDUCE_PRELUDE
    from kernelfuse.codegen.onchip import ONCHIP_PRELUDE
    from kernelfuse.codegen.tensorcore import TENSORCORE_PRELUDE

    nvcc = _nvcc()
    cu = tmp_path / "preludes.cu"
    cu.write_text("\n".join([HEADER, REDUCE_PRELUDE, ONCHIP_PRELUDE, ATTENTION_PRELUDE, MMA_ATTENTION_PRELUDE,
                             FLASH_PRELUDE, TENSORCORE_PRELUDE, IGEMM_PRELUDE]))
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(cu), "-o", str(tmp_path / "p.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
