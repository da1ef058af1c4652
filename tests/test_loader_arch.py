"""The emitted loader's build target, off the GPU: a 9.0 device builds for sm_90a and enables the wgmma GEMM
loop; a torch that rejects sm_90a gets an sm_90 build with the loop off (never a library whose launchers take a
kernel that was not built); other devices build for their own arch; the user's TORCH_CUDA_ARCH_LIST comes back."""

from __future__ import annotations

import hashlib
import inspect
import os
import warnings
from types import SimpleNamespace

import pytest
import torch.utils.cpp_extension as cpp_extension

from kernelfuse.emit.runtime import LOADER


def _run_loader(monkeypatch, capability: tuple[int, int], rejects_sm90a: bool = False) -> tuple[list[str], list]:
    """The loader's `_extension()` with a fake device, load_inline and `_Kernels`: the arch lists it built with and
    what it told the library."""
    targets: list[str] = []
    allowed: list[bool] = []

    def load_inline(**kwargs):
        targets.append(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if rejects_sm90a and targets[-1] == "9.0a":  # torch before 2.3
            raise ValueError("Unknown CUDA arch (9.0a) or GPU not supported")
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
    ((9, 0), False, ["9.0a"], [True]),
    ((9, 0), True, ["9.0a", "9.0"], [False]),
    ((8, 0), False, ["8.0"], [False]),
    ((10, 0), False, ["10.0"], [False]),
])
def test_the_loader_builds_sm90a_on_hopper_and_falls_back_where_torch_cannot(monkeypatch, capability, rejects,
                                                                            want_targets, want_allowed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets, allowed = _run_loader(monkeypatch, capability, rejects)
    assert targets == want_targets and allowed == want_allowed
    assert any("building for sm_90a failed (Unknown CUDA arch" in str(w.message) for w in caught) == rejects


def test_a_build_that_fails_for_sm_90a_and_sm_90_raises_the_error(monkeypatch):
    tried = []

    def broken(**kwargs):
        tried.append(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        raise RuntimeError("nvcc: error")

    monkeypatch.setattr(cpp_extension, "load_inline", broken)
    namespace = {"torch": SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True,
                                                               get_device_capability=lambda: (9, 0))),
                 "hashlib": hashlib, "inspect": inspect, "NAME": "t", "CUDA_SRC": "//", "_Kernels": object}
    exec(LOADER, namespace)  # noqa: S102
    with pytest.raises(RuntimeError, match="nvcc: error"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        namespace["_extension"]()
    assert tried == ["9.0a", "9.0"]
