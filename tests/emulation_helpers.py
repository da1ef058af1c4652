"""Run a plan's generated CUDA on the CPU: the kernel file built with the host compiler against
tests/fixtures/cuda_emulation.h (block threads as std::threads, barriers and shuffles emulated).

`emulated_run` calls each kernel through the emitted Python binding (`_Kernels`, kernelfuse.codegen.binding): its
checks, output and workspace allocation and argument order are what the GPU runs; only the launch drops the device
and stream. `call` passes pointers straight to an `extern "C" int call_kN(void** pointers)` shim (its tensors, out,
then the workspace if any) for tests that build their own tensors.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernelfuse.codegen import generate
from kernelfuse.codegen.dryrun import binding_off_the_gpu
from kernelfuse.codegen.generated import workspace_floats
from kernelfuse.codegen.iteration import tensor_args
from kernelfuse.plan import Plan
from kernelfuse.plan.interpret import call_aten
from kernelfuse.plan.ir import GenStep

EMULATION = Path(__file__).parent / "fixtures" / "cuda_emulation.h"


@dataclass
class Emulated:
    """The plan's kernels built for the CPU: the library, and the emitted binding (`_Kernels`) over it."""

    lib: ctypes.CDLL
    kernels: object


def emulated(plan: Plan, tmp_path: Path) -> Emulated:
    """The plan's kernels as a CPU library (skips the test where no C++20 host compiler is found)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) on PATH")
    sources = generate(plan)
    lines = [ln for ln in sources.cuda.splitlines() if not ln.startswith("#include")]
    text = re.sub(r"(\w+(?:<[^<>]*>)?)<<<(.*?), (\w+), [^,<>]+, stream>>>\((.*)\);",
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
    return Emulated(ctypes.CDLL(str(lib)), _binding(sources.binding, lib))


def _binding(binding: str, lib: Path) -> object:
    """The emitted `_Kernels` over the CPU library: the same checks, except that CPU tensors are allowed (by the
    checks and by the binding's choice of its own copy kernels), and launches without a device or stream."""
    namespace = binding_off_the_gpu(binding)

    class EmulatedKernels(namespace["_Kernels"]):
        def _launch(self, function, kernel, tensor, *args):
            assert function(*args, None) == 0, kernel

        @staticmethod
        def _on_device(t):  # the emulated kernels read CPU tensors (the binding's own copies run here too)
            return True

    return EmulatedKernels(str(lib))


def pointer_count(step: GenStep) -> int:
    """Pointers its launcher takes before the stream: every tensor it reads, out, and a workspace if any."""
    return len(tensor_args(step)) + 1 + (1 if workspace_floats(step) else 0)


def call(emu: Emulated, step: GenStep, tensors: list) -> None:
    """Launch `step`'s kernel(s) on CPU tensors (inputs in tensor_args order, out, workspace); assert success."""
    pointers = [t.data_ptr() for t in tensors]
    assert len(pointers) == pointer_count(step)
    assert emu.lib[f"call_{step.kernel}"]((ctypes.c_void_p * len(pointers))(*pointers)) == 0


def strided_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides, gaps included (`clone` makes a view with gaps contiguous: a slice of the
    last dim, which a kernel reads through its strides, would no longer pass the binding's check)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype).copy_(tensor)


def emulated_and_interpreted(emu: Emulated, plan: Plan, step: GenStep, seed: int = 0) -> tuple:
    """(the kernel's output, the plan interpreter's) for random tensors in the layouts the plan gives them."""
    out, expected, _, _ = emulated_run(emu, plan, step, seed)
    return out, expected


def emulated_run(emu: Emulated, plan: Plan, step: GenStep, seed: int = 0, src_offset: float = 0.0) -> tuple:
    """The kernel and the plan interpreter on the same random tensors (the source shifted by `src_offset`):
    (kernel output, interpreter output, the kernel's input tensors after the call, the interpreter's by name) -
    in-place updates (batch norm's running statistics) show in the last two."""
    from kernelfuse.plan.interpret import _run_generated

    torch.manual_seed(seed)
    env, tensors = {}, []
    for name, ref in tensor_args(step):
        if ref.name in env:  # one graph value read twice (the source as a broadcast consumer's operand too)
            tensors.append(strided_clone(env[ref.name]))
            continue
        meta = step.source.meta if name == "src" else plan.graph[ref].meta
        value = torch.randn(meta.shape) + (src_offset if name == "src" else 0.0)
        value = value > 0 if meta.dtype == torch.bool else value  # a mask read as an operand
        env[ref.name] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype).copy_(value)
        tensors.append(strided_clone(env[ref.name]))
    # the binding allocates out and the workspace: NaN-filled here, so an element the kernel skips shows
    previous = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        out = getattr(emu.kernels, step.kernel)(*tensors)
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.utils.deterministic.fill_uninitialized_memory = previous[1]
    return out, _run_generated(step, env), tensors, env


def emulated_against_interpreter(plan: Plan, tmp_path: Path, ulps: int = 1) -> int:
    """Every generated kernel of `plan` run on the CPU (tests/fixtures/cuda_emulation.h, its fp16/bf16 conversions
    round as CUDA's do) through the emitted binding, against the plan interpreter's ATen ops on the same random
    tensors (variances positive): equal up to one ulp of the output's dtype, where the CPU's libm and CUDA's may
    round a float differently before the final rounding (`ulps` of them where the kernel's arithmetic is ordered
    otherwise: fp32 batch norm as (x - mean) / std * w + b, ATen's as x * a + b). The running statistics a
    training-mode batch norm updates in place are compared with ATen's update too. Returns how many kernels were
    compared."""
    from kernelfuse.plan.interpret import _run_generated

    emu = emulated(plan, tmp_path)
    torch.manual_seed(0)
    for step in plan.generated:
        env, tensors = {}, []
        for name, ref in tensor_args(step):
            meta = step.source.meta if name == "src" else plan.graph[ref].meta
            value = torch.randn(meta.shape).abs() + 0.5 if name == "run_var" else torch.randn(meta.shape) * 2
            env.setdefault(ref.name, torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype).copy_(value))
            tensors.append(strided_clone(env[ref.name]))
        got = getattr(emu.kernels, step.kernel)(*tensors)
        expected = _run_generated(step, env)
        assert got.dtype == expected.dtype == step.out_meta.dtype and got.shape == expected.shape, step.kernel
        ulp = torch.finfo(got.dtype).eps * ulps
        assert torch.allclose(got.float(), expected.float(), rtol=ulp, atol=ulp, equal_nan=True), \
            (step.kernel, (got.float() - expected.float()).abs().max().item())
        for (name, ref), tensor in zip(tensor_args(step), tensors, strict=True):
            if name in ("run_mean", "run_var"):
                torch.testing.assert_close(tensor, env[ref.name], atol=1e-5, rtol=1e-5, msg=f"{step.kernel} {name}")
    return len(plan.generated)


def node_values(graph, model, inputs) -> dict[str, object]:
    """Every node's value, computed with the ATen ops themselves: what a plan's kernels are fed, and the reference
    values of a graph's outputs."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    env: dict[str, object] = {}
    for node in graph.nodes:
        if node.op == "input":
            env[node.name] = inputs[int(node.target)]
        elif node.op in ("param", "buffer"):
            env[node.name] = state[str(node.target)]
        else:
            env[node.name] = call_aten(node, env)
    return env
