"""Kernel accounting: which share of a forward's GPU time ran in kernels the candidate built itself.

A candidate that subclasses the reference, falls back to torch inside a try/except, or calls torch.compile is
correct and may be fast, yet runs no kernel of its own. The judge profiles one forward (judge.streams) and sorts
each GPU activity into one of three kinds:
- compiler: Inductor's generated Triton kernels (`triton_poi_fused_...`, `triton_red_...`): torch.compile's work;
- custom: a kernel whose base name (`void ns::name<T>(...)` -> `name`) is defined by the candidate: it appears as a
  word in the candidate's source (CUDA in load_inline strings, a Triton function) or inside a shared object the
  candidate loaded (a cpp_extension build, a library opened through ctypes), or it contains the name of a function
  the source decorates as a kernel (CuTe names its kernels `kernel_cutlass_<name>_...`); and it is neither a
  kernel the reference's own forward ran nor in a library namespace (at::, cub::, cutlass::, cudnn::...);
- library: everything else (ATen, cuBLAS, cuDNN, copies and memsets).
A name is only custom with positive evidence from the candidate's own files, so a PyTorch program never counts as
custom, whatever its kernels are called.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kernelfuse.judge.bypass import kernel_functions

COMPILER_NAME = re.compile(r"^triton_(poi|red|per|tem|for|mm|bmm|spl)_")
LIBRARY_NAMESPACES = ("at::", "c10::", "cub::", "thrust::", "cutlass::", "cudnn::", "cublas", "cask", "xmma",
                      "flash::", "pytorch_flash::", "fmha", "cutlass_", "internal::", "native::")
SYSTEM_DIRS = ("/usr/lib", "/lib", "/usr/local/cuda", "/opt/conda/lib", "/usr/local/lib/python")
MIN_NAME = 3
ANONYMOUS = "(anonymous namespace)::"
TOP = 8


@dataclass(frozen=True)
class KernelAccount:
    """GPU milliseconds of one profiled forward by kind, the custom share, and the top names of each kind."""

    custom_ms: float
    library_ms: float
    compiler_ms: float
    custom: tuple[str, ...]
    library: tuple[str, ...]
    compiler: tuple[str, ...]

    @property
    def total_ms(self) -> float:
        return self.custom_ms + self.library_ms + self.compiler_ms

    @property
    def share(self) -> float:
        """custom / all GPU time of the forward (0 when nothing ran on the GPU)."""
        return self.custom_ms / self.total_ms if self.total_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"custom_kernel_share": round(self.share, 4), "custom_ms": round(self.custom_ms, 4),
                "library_ms": round(self.library_ms, 4), "compiler_ms": round(self.compiler_ms, 4),
                "custom": list(self.custom), "library": list(self.library), "compiler": list(self.compiler)}


def base_name(kernel: str) -> str:
    """`void at::native::foo<float, 4>(float*, int)` -> `foo`; a plain name (extern "C", Triton) as it is."""
    name = kernel.strip().replace(ANONYMOUS, "")
    if name.startswith("void "):
        name = name[5:]
    name = re.split(r"[(<]", name, maxsplit=1)[0]
    return name.rsplit("::", 1)[-1].strip()


def in_library_namespace(kernel: str) -> bool:
    qualified = re.split(r"[(<]", kernel.replace(ANONYMOUS, "").removeprefix("void "), maxsplit=1)[0]
    return "::" in qualified and qualified.startswith(LIBRARY_NAMESPACES) or kernel.startswith(LIBRARY_NAMESPACES)


def account_kernels(work: Iterable[tuple[str, str, float]], reference_names: Iterable[str], source: str,
                    libraries: Iterable[str]) -> KernelAccount:
    """Sort profiled activities (name, category, ms) into custom, library and compiler time (module docstring):
    `reference_names` are the kernels the reference ran, `libraries` the shared objects the candidate loaded."""
    reference = set(reference_names)
    blobs = [_read(p) for p in libraries]
    try:
        decorated = {n for n in kernel_functions(ast.parse(source)) if len(n) > MIN_NAME}
    except SyntaxError:
        decorated = set()
    totals = {"custom": 0.0, "library": 0.0, "compiler": 0.0}
    names: dict[str, dict[str, float]] = {k: {} for k in totals}
    cache: dict[str, str] = {}
    for name, category, ms in work:
        if name not in cache:
            cache[name] = _kind(name, category, reference, source, blobs, decorated)
        kind = cache[name]
        totals[kind] += ms
        names[kind][name] = names[kind].get(name, 0.0) + ms

    def top(kind: str) -> tuple[str, ...]:
        return tuple(n[:120] for n, _ in sorted(names[kind].items(), key=lambda kv: -kv[1])[:TOP])

    return KernelAccount(totals["custom"], totals["library"], totals["compiler"], top("custom"), top("library"),
                         top("compiler"))


def _kind(name: str, category: str, reference: set[str], source: str, blobs: list[bytes],
          decorated: set[str]) -> str:
    if category != "kernel" or name in reference or in_library_namespace(name):
        return "library"
    base = base_name(name)
    if COMPILER_NAME.match(base):
        return "compiler"
    if len(base) < MIN_NAME or not re.fullmatch(r"\w+", base):
        return "library"
    if re.search(rf"\b{re.escape(base)}\b", source) or any(base.encode() in blob for blob in blobs):
        return "custom"
    if any(fn in base for fn in decorated):
        return "custom"
    return "library"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def mapped_libraries() -> frozenset[str]:
    """Shared objects mapped into this process now (Linux /proc/self/maps; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    paths = {line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6}
    return frozenset(p for p in paths if p.startswith("/") and (p.endswith(".so") or ".so." in p))


def candidate_libraries(before: frozenset[str]) -> list[str]:
    """Shared objects mapped since `before` (taken ahead of the candidate's import) that are neither torch's nor
    CUDA's nor the system's: the candidate's builds and the libraries it opened."""
    import torch

    torch_dir = os.path.dirname(os.path.dirname(torch.__file__))
    own = []
    for path in sorted(mapped_libraries() - before):
        if path.startswith(SYSTEM_DIRS) or "/nvidia/" in path or path.startswith(os.path.join(torch_dir, "torch")):
            continue
        if os.path.basename(path).startswith(("libcu", "libnv", "libcudnn", "libnccl")):
            continue
        own.append(path)
    return own
