"""Build seconds of a design not yet taken (issue 8): an emitted file's kernels built as a plain shared library
(nvcc, an `extern "C"` shim per launcher, no torch headers, callable through ctypes) against the torch-facing
C++ binding the emitted files build today (the part that takes most of a cold build). Needs nvcc and a host
compiler, no GPU:
    python benchmarks/plain_library_probe.py EMITTED.py [...]
"""
import ast
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch.utils.cpp_extension as ce


def strings(path: str) -> dict:
    tree = ast.parse(Path(path).read_text())
    out = {}
    for node in tree.body:
        names = ("CUDA_SRC", "CPP_SRC", "FUNCTIONS")
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out

for f in sys.argv[1:]:
    s = strings(f)
    d = Path(tempfile.mkdtemp())
    shims = []
    for decl in re.findall(r"cudaError_t (\w+_launch)\(([^)]*)\);", s["CPP_SRC"]):
        name, params = decl
        n = len([p for p in params.split(",") if p.strip()])
        args = ", ".join(f"p[{i}]" for i in range(n - 1))
        shims.append(f'extern "C" int kf_call_{name}(void** p, void* stream) '
                     f'{{ return (int){name}({args}, (cudaStream_t)stream); }}')
    (d / "k.cu").write_text(s["CUDA_SRC"] + "\n" + "\n".join(shims) + "\n")
    t = time.time()
    r = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-Xcompiler", "-fPIC", "-shared", str(d / "k.cu"),
                        "-o", str(d / "k.so")], capture_output=True, text=True)
    plain = time.time() - t
    inc = [f"-I{p}" for p in ce.include_paths()]
    inc += ["-I/usr/local/cuda/include", "-I" + sysconfig.get_paths()["include"]]
    defs = "".join(f'mod.def("{k}", &{k});' for k in s["FUNCTIONS"])
    cpp = s["CPP_SRC"] + "\n#include <torch/csrc/utils/pybind.h>\nPYBIND11_MODULE(m, mod) {" + defs + "}\n"
    (d / "b.cpp").write_text(cpp)
    t = time.time()
    r2 = subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-c", *inc, str(d / "b.cpp"), "-o", str(d / "b.o")],
                        capture_output=True, text=True)
    binding = time.time() - t
    print(f"{Path(f).stem}: plain library (nvcc, kernels + extern C shims) {plain:.1f} s rc={r.returncode}; "
          f"today's C++ binding alone {binding:.1f} s rc={r2.returncode}")
    for result in (r, r2):
        if result.returncode:
            print(result.stderr[-800:])
