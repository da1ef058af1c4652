"""Kernel accounting (kernelfuse.judge.accounting) on profiles written by hand: which GPU time is the candidate's own.

The profiler itself needs a GPU (tests/test_judge_gpu.py); the sorting of names into custom, library and compiler
kernels does not.
"""

from __future__ import annotations

import ctypes.util

import torch

from kernelfuse.judge.accounting import account_kernels, base_name, candidate_libraries, mapped_libraries

SOURCE = '''
cuda_src = r"""
extern "C" __global__ void kf_bias_relu(float* y) {}
template <typename T> __global__ void row_softmax(T* y) {}
"""
@triton.jit
def add_kernel(x_ptr):
    pass
'''
GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int, float*)"


def test_base_names():
    assert base_name(ELEMENTWISE) == "vectorized_elementwise_kernel"
    assert base_name("void row_softmax<float>(float*)") == "row_softmax"
    assert base_name("kf_bias_relu") == "kf_bias_relu"
    assert base_name("void (anonymous namespace)::row_softmax<float>(float*)") == "row_softmax"


def test_custom_library_and_compiler_time_are_told_apart():
    work = [(GEMM, "kernel", 2.0), ("kf_bias_relu", "kernel", 0.5), ("void row_softmax<float>(float*)", "kernel", 0.25),
            ("add_kernel", "kernel", 0.25), ("triton_poi_fused_add_relu_0", "kernel", 0.5),
            (ELEMENTWISE, "kernel", 0.3), ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 0.2)]
    account = account_kernels(work, [GEMM], SOURCE, [])
    assert account.custom_ms == 1.0 and account.compiler_ms == 0.5
    assert abs(account.library_ms - 2.5) < 1e-9 and abs(account.share - 1.0 / 4.0) < 1e-9
    assert account.custom[0] == "kf_bias_relu" and account.compiler == ("triton_poi_fused_add_relu_0",)
    assert account.to_dict()["custom_kernel_share"] == 0.25


def test_a_dsl_kernel_named_after_its_function_is_custom():
    source = "import cutlass.cute as cute\n@cute.kernel\ndef softmax_rows(x):\n    pass\n"
    account = account_kernels([("kernel_cutlass_softmax_rows_0_tensor_ptr", "kernel", 1.0)], [], source, [])
    assert account.share == 1.0


def test_a_pytorch_program_has_no_custom_time_whatever_its_names():
    # a candidate that mentions ATen's kernel names in its text still runs ATen's kernels
    source = "# vectorized_elementwise_kernel gemm reduce_kernel\nimport torch\n"
    account = account_kernels([(ELEMENTWISE, "kernel", 1.0), (GEMM, "kernel", 1.0)], [], source, [])
    assert account.share == 0 and account.custom == ()
    assert account_kernels([], [], source, []).share == 0  # nothing ran on the GPU


def test_a_kernel_defined_only_in_a_loaded_library_is_custom(tmp_path):
    library = tmp_path / "libmine.so"
    library.write_bytes(b"\x7fELF....\x00_Z12fused_gelu_kPfi\x00....")
    account = account_kernels([("void fused_gelu_k(float*, int)", "kernel", 1.0)], [], "import ctypes\n",
                              [str(library)])
    assert account.share == 1.0
    assert account_kernels([("void fused_gelu_k(float*, int)", "kernel", 1.0)], [], "", []).share == 0


def test_only_libraries_mapped_since_the_snapshot_count():
    before = mapped_libraries()
    assert candidate_libraries(before) == []
    name = ctypes.util.find_library("z") or ctypes.util.find_library("m")
    if name:
        ctypes.CDLL(name)
        assert all(not p.startswith(("/usr/lib", "/lib")) for p in candidate_libraries(before))


def test_profiled_calls_do_not_include_the_input_copies(monkeypatch, tmp_path):
    """The GPU work the profiler attributes to a forward (its busy time, its custom-kernel share) is the model's
    alone: each call's private input copy is made before the profiler starts (seen on 2 H200s: a 2 ms
    device-to-device copy counted as library time beside a 2.6 ms kernel)."""
    from types import SimpleNamespace

    import kernelfuse.judge.sidechecks as sidechecks
    from kernelfuse.judge.streams import GpuActivity

    profiling = [False]
    copied_while_profiling: list[bool] = []

    def fake_streams(fn):
        profiling[0] = True
        try:
            fn()
        finally:
            profiling[0] = False
        return GpuActivity(frozenset({7}), 1, 1.0, (("k0_kernel", "kernel", 1.0),))

    def fake_inputs_to(inputs, device):
        copied_while_profiling.append(profiling[0])
        return list(inputs)

    monkeypatch.setattr(sidechecks, "kernel_streams", fake_streams)
    monkeypatch.setattr(sidechecks, "inputs_to", fake_inputs_to)
    found: dict = {}
    out = SimpleNamespace(set=lambda **kw: found.update(kw), warn=lambda text: None)
    models = SimpleNamespace(reference=lambda *a: None, candidate=lambda *a: None)
    problem = SimpleNamespace(make_inputs=lambda seed, device: [1.0])
    flags = SimpleNamespace(apply=lambda: None)
    settings = SimpleNamespace(seed=0, device=torch.device("cpu"), default_flags=flags, candidate_flags=flags,
                               policy=SimpleNamespace(autocast=None))
    candidate = tmp_path / "c.py"
    candidate.write_text("# no kernels\n")
    sidechecks.check_streams(out, models, problem, settings, SimpleNamespace(candidate_path=str(candidate)),
                             frozenset())
    assert copied_while_profiling == [False, False]
    assert found["streams"]["candidate_busy_ms"] == 1.0
