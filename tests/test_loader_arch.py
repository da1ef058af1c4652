"""The emitted loader's build target, off the GPU: a 9.0 device builds for sm_90a and enables the wgmma loops; an
nvcc that rejects sm_90a gets an sm_90 build with the loops off (never a library whose launchers take a kernel that
was not built); other devices build for their own arch. The target is named by -gencode (torch then adds no arch
list of its own): the user's TORCH_CUDA_ARCH_LIST is neither read nor changed, so builds in threads cannot mix."""

from __future__ import annotations

import hashlib
import inspect
import os
import warnings
from types import SimpleNamespace

import pytest
import torch.utils.cpp_extension as cpp_extension

from kernelfuse.emit.runtime import LOADER


def _gencode(kwargs: dict) -> str:
    """The one arch the build names: its -gencode flag's (torch's _get_cuda_arch_flags adds none beside it)."""
    (flag,) = [f for f in kwargs["extra_cuda_cflags"] if "arch" in f]
    arch = flag.removeprefix("-gencode=arch=compute_").split(",")[0]
    assert flag == f"-gencode=arch=compute_{arch},code=sm_{arch}"
    return arch


def _run_loader(monkeypatch, capability: tuple[int, int], rejects_sm90a: bool = False) -> tuple[list[str], list]:
    """The loader's `_extension()` with a fake device, load_inline and `_Kernels`: the arch lists it built with and
    what it told the library."""
    targets: list[str] = []
    allowed: list[bool] = []

    def load_inline(**kwargs):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.0;8.0"  # not the loader's business
        targets.append(_gencode(kwargs))
        if rejects_sm90a and targets[-1] == "90a":  # nvcc before 12.0
            raise RuntimeError("nvcc fatal   : Unsupported gpu architecture 'compute_90a'")
        return "/fake/lib.so"

    class Kernels:
        def __init__(self, path):
            assert path == "/fake/lib.so"

        def _allow_wgmma(self, on):
            allowed.append(on)

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0;8.0")
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True,
                                                      get_device_capability=lambda: capability))
    namespace = {"torch": fake_torch, "hashlib": hashlib, "inspect": inspect, "NAME": "t", "CUDA_SRC": "//",
                 "_Kernels": Kernels}
    exec(LOADER, namespace)  # noqa: S102 - kernelfuse's own loader text
    namespace["_extension"]()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.0;8.0"  # the user's setting is back
    return targets, allowed


@pytest.mark.parametrize(("capability", "rejects", "want_targets", "want_allowed"), [
    ((9, 0), False, ["90a"], [True]),
    ((9, 0), True, ["90a", "90"], [False]),
    ((8, 0), False, ["80"], [False]),
    ((8, 6), False, ["86"], [False]),
    ((10, 0), False, ["100"], [False]),
])
def test_the_loader_builds_sm90a_on_hopper_and_falls_back_where_torch_cannot(monkeypatch, capability, rejects,
                                                                            want_targets, want_allowed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets, allowed = _run_loader(monkeypatch, capability, rejects)
    assert targets == want_targets and allowed == want_allowed
    assert any("building for sm_90a failed (nvcc fatal" in str(w.message) for w in caught) == rejects


def test_a_build_that_fails_for_sm_90a_and_sm_90_raises_the_error(monkeypatch):
    tried = []

    def broken(**kwargs):
        tried.append(_gencode(kwargs))
        raise RuntimeError("nvcc: error")

    monkeypatch.setattr(cpp_extension, "load_inline", broken)
    namespace = {"torch": SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True,
                                                               get_device_capability=lambda: (9, 0))),
                 "hashlib": hashlib, "inspect": inspect, "NAME": "t", "CUDA_SRC": "//", "_Kernels": object}
    exec(LOADER, namespace)  # noqa: S102
    with pytest.raises(RuntimeError, match="nvcc: error"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        namespace["_extension"]()
    assert tried == ["90a", "90"]
