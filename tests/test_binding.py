"""The kernels' Python binding (kernelfuse.codegen.binding): the checks that stand between a tensor and a kernel
built for one layout, and the emitted class's shape. Its calls into the library run in the CPU emulation tests
(emulation_helpers.emulated_run) and, on a GPU, in tests/test_generated_gpu.py."""

from __future__ import annotations

import ast

import pytest
import torch

from kernelfuse.codegen.binding import Binding, _check, _check_dense, kernels_class, py_tuple, runtime_source


def test_a_tensor_in_the_built_layout_passes_but_for_its_device() -> None:
    t = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="k0 src must be a CUDA tensor"):  # everything else matched
        _check(t, "k0 src", (4, 6), (6, 1), torch.float32)
    with pytest.raises(ValueError, match="k0 input must be a CUDA tensor"):
        _check_dense(t, "k0 input", (4, 6), torch.float32)


@pytest.mark.parametrize("tensor, message", [
    (torch.zeros(4, 5), r"has shape \[4, 5\], the kernel was built for \[4, 6\]"),
    (torch.zeros(6, 4).t(), r"has strides \[1, 4\], the kernel was built for \[6, 1\]"),
    (torch.zeros(4, 6, dtype=torch.float16), r"has dtype torch.float16, expected torch.float32"),
])
def test_a_strided_check_names_what_differs(tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=rf"kernelfuse: k0 src {message}"):
        _check(tensor, "k0 src", (4, 6), (6, 1), torch.float32)


def test_a_dimension_of_size_one_may_have_any_stride() -> None:
    t = torch.zeros(4, 6)[:, :1]  # shape (4, 1), strides (6, 1)
    odd = torch.as_strided(torch.zeros(24), (4, 1), (6, 99))
    for tensor in (t, odd):
        with pytest.raises(ValueError, match="must be a CUDA tensor"):  # the layout itself was accepted
            _check(tensor, "k1 src", (4, 1), (6, 7), torch.float32)
    with pytest.raises(ValueError, match=r"has strides \[6, 1\], the kernel was built for \[1, 1\]"):
        _check(t, "k1 src", (4, 1), (1, 1), torch.float32)


def test_a_dense_check_follows_the_memory_format() -> None:
    nchw = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="must be dense in torch.channels_last"):
        _check_dense(nchw, "k0 input", (2, 3, 4, 5), torch.float32, torch.channels_last)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _check_dense(nchw.contiguous(memory_format=torch.channels_last), "k0 input", (2, 3, 4, 5), torch.float32,
                     torch.channels_last)
    with pytest.raises(ValueError, match="must be dense in torch.contiguous_format"):
        _check_dense(torch.zeros(5, 4).t(), "k0 operand in0 (b)", (4, 5), torch.float32)


def test_the_emitted_class_declares_each_launcher_and_method() -> None:
    text = runtime_source() + kernels_class([
        Binding('self._k0 = self._function("k0_launch", [ctypes.c_void_p] * 2)', "def k0(self, src):\n    return src"),
        Binding('self._k1 = self._function("k1_launch", [ctypes.c_void_p] * 3)', "def k1(self, a, b):\n    return b"),
    ])
    tree = ast.parse(text)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Kernels"]
    assert [f.name for f in cls.body if isinstance(f, ast.FunctionDef)] == ["__init__", "k0", "k1"]
    assert "import" not in text, "the emitted file imports ctypes and torch once, at its top"


def test_py_tuple_keeps_the_comma_of_one_element() -> None:
    assert py_tuple((8192,)) == "(8192,)" and py_tuple((2, 3)) == "(2, 3)"
