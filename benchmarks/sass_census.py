"""Static SASS census of a problem's generated kernels, with no GPU: instructions per loop body, by opcode.

An issue-bound kernel (ncu: the busiest pipe the integer ALU, IPC near 2) gets faster when its main loop issues
fewer instructions. This census counts them on the CPU machine, so a change to the loop can be weighed before it
costs device time. It found that the dense convolution's 4-byte gathers spent ~10 integer instructions on each copy
(level-2 54, stop 47).

    PYTHONPATH=. python benchmarks/sass_census.py PROBLEM.py [--kernel k0] [--arch sm_90] [--plan owned|first|VARIANT]
        [--fp32-convs]

`--plan owned` (the default) takes the owned-anchor plan, the one with the generated convolutions and GEMMs: TF32
convolutions, or with `--fp32-convs` the 3xTF32 ones a GPU gets where eager's convolution computes in full fp32.
`first` takes the optimizer's first variant, a variant's name (`fused-nchw`) that variant. The report lists,
for each kernel, its instruction count and each loop's body (a backward branch's range): its instruction count
and top opcodes (predicates stripped).

Needs nvcc and cuobjdump. cuobjdump comes from CUDA's bin folder or the `nvidia-cuda-cuobjdump` wheel.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kernelfuse.capture import capture
from kernelfuse.codegen import generate
from kernelfuse.load import load_problem
from kernelfuse.plan.fuse import optimizer_variants, owned_anchor_variants
from kernelfuse.rewrite import apply_rules

LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\s+0x([0-9a-f]+)")  # a branch to an address (cuobjdump prints targets so)
TOP = 12


def find_tool(name: str) -> str:
    """`name` from PATH, CUDA's bin folder, or an installed nvidia wheel's bin folder; exits with one line if none."""
    import site

    candidates = [Path("/usr/local/cuda/bin") / name]
    for root in site.getsitepackages():
        candidates += sorted(Path(root).glob(f"nvidia/cu*/bin/{name}"), reverse=True)
    found = shutil.which(name) or next((str(p) for p in candidates if p.exists()), None)
    if found is None:
        sys.exit(f"sass_census: {name} not found; put CUDA's bin folder on PATH"
                 + (" or pip install nvidia-cuda-cuobjdump" if name == "cuobjdump" else ""))
    return found


def parse(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text), by (mangled) function name."""
    functions: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = functions.setdefault(line.split("Function :")[1].strip(), [])
        elif current is not None and (m := LINE.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return functions


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) address ranges of the loop bodies: a branch back to an earlier address closes one."""
    found = []
    for addr, text in code:
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            found.append((int(m.group(1), 16), addr))
    return found


def census(code: list[tuple[int, str]], start: int = 0, end: int = 1 << 62) -> collections.Counter:
    return collections.Counter(opcode(t) for a, t in code if start <= a <= end)


def report(name: str, code: list[tuple[int, str]]) -> list[str]:
    total = census(code)
    lines = [f"## {name}: {sum(total.values())} instructions",
             "top: " + ", ".join(f"{op} {n}" for op, n in total.most_common(TOP))]
    for start, end in loops(code):
        body = census(code, start, end)
        lines.append(f"- loop 0x{start:x}-0x{end:x}: {sum(body.values())} instructions; "
                     + ", ".join(f"{op} {n}" for op, n in body.most_common(TOP)))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", type=Path)
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this (e.g. k0_kernel)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--plan", default="owned",
                        help="owned, first, or a variant's name (e.g. fused-nchw) among the optimizer's variants")
    parser.add_argument("--fp32-convs", action="store_true", help="the convolutions as eager's full-fp32 ones")
    args = parser.parse_args()
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    problem = load_problem(args.problem)
    graph = apply_rules(capture(problem)).graph
    if args.plan == "owned":
        convs = frozenset(n.name for n in graph.nodes if n.op == "convolution.default")
        plans = owned_anchor_variants(graph, measured=convs, fp32_convs=convs if args.fp32_convs else frozenset())
    else:
        plans = optimizer_variants(graph)
        if args.plan != "first":
            plans = [p for p in plans if p.variant == args.plan]
    if not plans:
        sys.exit("sass_census: no plan with generated kernels for this problem")
    sources = generate(plans[0])
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(sources.cuda)
        subprocess.run([nvcc, "-std=c++17", f"-arch={args.arch}", "-O3", "-cubin", str(cu), "-o", str(cubin)],
                       check=True, capture_output=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    print(f"# SASS census: {args.problem.name}, plan {plans[0].variant}, {args.arch}\n")
    for name, code in parse(sass).items():
        if args.kernel in name:
            print("\n".join(report(name, code)) + "\n")


if __name__ == "__main__":
    main()
