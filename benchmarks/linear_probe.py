"""Does a Linear's bias belong in cuBLAS's GEMM (addmm: cuBLASLt's bias epilogue) or in the kernel behind it (mm)?

torch.compile's BERT calls mm and adds the bias in its Triton kernels; its GEMMs took 6% less time than eager's
addmm (2 H200s, stop 32, benchmarks/kernel_profile.py --compile). This times, per transformer GEMM shape of the zoo
(strict fp32, TF32 off), addmm against mm alone (the bias then joins a generated kernel's prologue, nearly free)
and mm followed by an in-place bias add, and names the cuBLAS kernel each runs.
    PYTHONPATH=. python benchmarks/linear_probe.py > $OUT/linear_probe.md
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from kernelfuse.bench.timer import median_event_ms

SHAPES = [  # (rows, in, out): BERT-base at 8 x 512 tokens, Whisper's encoder at 4 x 1500, Llama's MLP
    (4096, 768, 768), (4096, 768, 3072), (4096, 3072, 768), (6000, 512, 512), (6000, 512, 2048), (6000, 2048, 512),
    (2048, 1024, 2816), (2048, 2816, 1024),
    # 2-d Linears: a CNN's classifier at batch 10 (VGG's three, a ResNet head, LeNet's), level-2 GEMM sizes
    (10, 25088, 4096), (10, 4096, 4096), (10, 4096, 1000), (10, 2048, 1000), (10, 400, 120), (10, 84, 10),
    (128, 8192, 8192), (1024, 8192, 8192),
]


def _kernel(fn) -> str:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                  key=lambda e: -e.self_device_time_total)
    return rows[0].key[:60] if rows else "-"


def _calls(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict:
    return {"addmm": lambda: torch.addmm(b, x, w.t()), "mm": lambda: torch.mm(x, w.t()),
            "mm+bias": lambda: torch.mm(x, w.t()).add_(b)}


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"## addmm against mm on {torch.cuda.get_device_name()} (fp32, TF32 off; median of 20, L2 flushed)\n")
    print("| rows x in x out | addmm ms | mm ms | mm + bias ms | mm / addmm | addmm kernel | mm kernel |")
    print("|---|---|---|---|---|---|---|")
    for m, k, n in SHAPES:
        calls = _calls(torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"),
                       torch.randn(n, device="cuda"))
        ms = {name: median_event_ms(fn) for name, fn in calls.items()}
        print(f"| {m} x {k} x {n} | {ms['addmm']:.4f} | {ms['mm']:.4f} | {ms['mm+bias']:.4f} | "
              f"{ms['mm'] / ms['addmm']:.3f} | `{_kernel(calls['addmm'])}` | `{_kernel(calls['mm'])}` |")


if __name__ == "__main__":
    main()
