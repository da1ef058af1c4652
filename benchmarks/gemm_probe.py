"""Can a GEMM of our own on tensor cores beat cuBLAS's exact-fp32 SGEMM at fp32 accuracy (3xTF32)?

    PYTHONPATH=. python benchmarks/gemm_probe.py [OUT.md]

Issue 22 asks for GEMM anchors with the epilogue inside, at eager's precision: exact fp32 where eager's matmul is
fp32. cuBLAS's SGEMM runs on the fp32 pipes (~51 TFLOP/s measured on an H200 at 1024 x 8192 x 8192); TF32 tensor
cores through mma.sync are several times faster, and three TF32 products per multiply (each operand split into a
TF32 part and the TF32 rounding of the rest) keep fp32 accuracy. This measures kernelfuse's GEMM as the planner
emits it (kernelfuse.codegen.gemm_tc, a Linear per shape) on level-2 and transformer GEMM shapes, out = x @ w.T +
bias, against F.linear in strict fp32 and with TF32 (the tensor cores' speed through cuBLAS's wgmma kernels).
Errors are max abs against float64. L2 flushed, median of 20 CUDA-event timings.

How the kernel was chosen (stop 41; the probe's own CUDA template then, in git at commit 9976aaf, and its tables
`benchmarks/results/gemm_probe_v1/v2/v3_*_s41_h200.md`): ten tile configurations; tensor-core accumulation across
all of K (16x SGEMM's error at K = 8192) against a fresh accumulator per K tile; 16-byte fragment loads.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import capture_module
from kernelfuse.codegen import generate
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import optimizer_variants

SHAPES = [  # (M, N, K): KernelBench level 2's Linear, BERT-base (8 x 512 tokens), Llama's MLP, a small one
    (1024, 8192, 8192), (4096, 3072, 768), (4096, 768, 3072), (4096, 768, 768), (2048, 2816, 1024),
    (128, 4096, 4096),
]


class Linears(torch.nn.Module):
    """One Linear per shape: the planner's `-tcgemm` variant makes one kernelfuse GEMM of each (k0, k1, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(k, n) for _, n, k in SHAPES)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(lin(x) for lin, x in zip(self.linears, xs, strict=True))


def kernelfuse_gemms() -> tuple[object, list]:
    """The GEMM kernels as kernelfuse plans them, built (the planner's own shapes: a real Linear per SHAPES row)."""
    model = Linears().eval()
    graph = capture_module(model, [torch.randn(m, k) for m, _, k in SHAPES])
    (plan,) = [p for p in optimizer_variants(graph) if p.variant.endswith("-tcgemm")]
    return load_kernels(generate(plan), "kf_gemm_probe_planned"), [s.kernel for s in plan.fused]


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    planned, names = kernelfuse_gemms()
    lines = ["| M x N x K | version | ms | TFLOP/s | vs cuBLAS fp32 | max abs err (fp64) |",
             "|---|---|---|---|---|---|"]
    for (m, n, k), name in zip(SHAPES, names, strict=True):
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") / k**0.5
        b = torch.randn(n, device="cuda")
        ref = torch.addmm(b.double(), x.double(), w.double().t())

        def row(name: str, fn, base: float | None, ref=ref, shape=(m, n, k)) -> float:  # noqa: ANN001
            err = (fn().double() - ref).abs().max().item()
            ms = median_event_ms(fn)
            vs = f"{base / ms:.3f}x" if base else "1.000x"
            tflops = 2 * shape[0] * shape[1] * shape[2] / ms / 1e9
            lines.append(f"| {'x'.join(map(str, shape))} | {name} | {ms:.4f} | {tflops:.1f} | {vs} | {err:.2e} |")
            print(lines[-1], flush=True)
            return ms

        args = (x, w, b)
        base = row("cuBLAS fp32 (F.linear)", lambda args=args: F.linear(*args), None)
        torch.backends.cuda.matmul.allow_tf32 = True
        row("cuBLAS TF32 (F.linear)", lambda args=args: F.linear(*args), base)
        torch.backends.cuda.matmul.allow_tf32 = False
        fn = getattr(planned, name)
        row("kernelfuse (the planner's kernel)", lambda fn=fn, args=args: fn(args[0], args[1].t(), args[2]), base)
    text = "\n".join(lines) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(f"# GEMM probe ({torch.cuda.get_device_name()})\n\n" + text)


if __name__ == "__main__":
    main()
