"""Run a plan's generated CUDA on the CPU: the kernel file built with the host compiler against
tests/fixtures/cuda_emulation.h (block threads as std::threads, barriers and shuffles emulated), with an
`extern "C" int call_kN(void** pointers)` per generated kernel (its tensors, out, then the workspace if any)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernelfuse.capture import contiguous_strides
from kernelfuse.codegen import generate
from kernelfuse.codegen.generated import workspace_floats
from kernelfuse.codegen.iteration import permuted_out, tensor_args
from kernelfuse.plan import Plan
from kernelfuse.plan.ir import GenStep

EMULATION = Path(__file__).parent / "fixtures" / "cuda_emulation.h"


def emulated(plan: Plan, tmp_path: Path) -> ctypes.CDLL:
    """The plan's kernels as a CPU library (skips the test where no C++20 host compiler is found)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) on PATH")
    lines = [ln for ln in generate(plan).cuda.splitlines()
             if not ln.startswith("#include") and "__half" not in ln and "__nv_bfloat16" not in ln]
    text = re.sub(r"(\w+(?:<[^<>]*>)?)<<<(.*?), (\w+), 0, stream>>>\((.*)\);",
                  r"kf_emu_launch(dim3(\2), \3, [&]{ \1(\4); });", "\n".join(lines))
    for g in plan.generated:
        pointers = ", ".join(f"p[{i}]" for i in range(pointer_count(g)))
        text += f'\nextern "C" int call_{g.kernel}(void** p) {{ return {g.kernel}_launch({pointers}, nullptr); }}\n'
    cpp, lib = tmp_path / f"{plan.variant}.cpp", tmp_path / f"{plan.variant}.so"
    cpp.write_text(f'#include "{EMULATION}"\n{text}')
    result = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread", str(cpp), "-o", str(lib)],
                            capture_output=True, text=True, timeout=600)
    if result.returncode and "barrier" in result.stderr:
        pytest.skip("the host compiler has no C++20 <barrier>")
    assert result.returncode == 0, result.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def pointer_count(step: GenStep) -> int:
    """Pointers its launcher takes before the stream: every tensor it reads, out, and a workspace if any."""
    return len(tensor_args(step)) + 1 + (1 if workspace_floats(step) else 0)


def call(lib: ctypes.CDLL, step: GenStep, tensors: list) -> None:
    """Launch `step`'s kernel(s) on CPU tensors (inputs in tensor_args order, out, workspace); assert success."""
    pointers = [t.data_ptr() for t in tensors]
    assert len(pointers) == pointer_count(step)
    assert lib[f"call_{step.kernel}"]((ctypes.c_void_p * len(pointers))(*pointers)) == 0


def emulated_and_interpreted(lib: ctypes.CDLL, plan: Plan, step: GenStep, seed: int = 0) -> tuple:
    """(the kernel's output, the plan interpreter's) for random tensors in the layouts the plan gives them."""
    out, expected, _, _ = emulated_run(lib, plan, step, seed)
    return out, expected


def emulated_run(lib: ctypes.CDLL, plan: Plan, step: GenStep, seed: int = 0, src_offset: float = 0.0) -> tuple:
    """The kernel and the plan interpreter on the same random tensors (the source shifted by `src_offset`):
    (kernel output, interpreter output, the kernel's input tensors after the call, the interpreter's by name) -
    in-place updates (batch norm's running statistics) show in the last two."""
    import torch

    from kernelfuse.plan.interpret import _run_generated

    torch.manual_seed(seed)
    env, tensors = {}, []
    for name, ref in tensor_args(step):
        if ref.name in env:  # one graph value read twice (the source as a broadcast consumer's operand too)
            tensors.append(env[ref.name].clone())
            continue
        meta = step.source.meta if name == "src" else plan.graph[ref].meta
        value = torch.randn(meta.shape) + (src_offset if name == "src" else 0.0)
        env[ref.name] = torch.empty_strided(meta.shape, meta.stride).copy_(value)
        tensors.append(env[ref.name].clone())
    out = torch.empty_strided(step.out_meta.shape, permuted_out(step) or contiguous_strides(step.out_meta.shape))
    out.fill_(float("nan"))  # the layout the wrapper allocates: eager's where it kept a permutation
    work = [torch.full((workspace_floats(step),), float("nan"))] if workspace_floats(step) else []
    call(lib, step, [*tensors, out, *work])
    return out, _run_generated(step, env), tensors, env
