"""The flash-attention kernel against what a user would run instead, on level-3-like shapes, fp32 and bf16.

    PYTHONPATH=. python benchmarks/attention_probe.py [OUT.md] [--no-compile]

Per shape and dtype: our kernel (kernelfuse.codegen.attention, built through the planner from an SDPA call; fp32
in each arithmetic: exact FMA, 3xTF32, TF32),
eager's unfused attention (q @ kᵀ * scale, mask, softmax, @ v), torch's SDPA under each backend that accepts the
case (math, efficient, flash, cuDNN) and torch.compile of the unfused form. Each is checked against a float64
reference (max abs error) and timed by CUDA events with L2 flushed (median of 20). Under 3 minutes on one H100
(torch.compile's builds are most of it; --no-compile skips them).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import capture_module
from kernelfuse.codegen import attention, generate
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import make_plan


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    seq: int
    dim: int
    mask: str  # "none" | "causal" | "add" (a per-head additive bias, Swin's relative positions)


CASES = (
    Case("L3-44 minGPT", 128, 8, 512, 96, "causal"),
    Case("L3-28 ViT", 197, 8, 2, 64, "none"),
    Case("L3-30 Swin window", 640, 3, 49, 32, "add"),
    Case("GPT-2 small", 8, 12, 1024, 64, "causal"),
    Case("UNet self-attn", 4, 8, 4096, 40, "none"),
)
BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


class Attentions(torch.nn.Module):
    """One SDPA call per case (its source names scaled_dot_product_attention: capture keeps the calls whole)."""

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, i = [], 0
        for case in CASES:
            q, k, v = tensors[i:i + 3]
            i += 3
            if case.mask == "add":
                out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=tensors[i]))
                i += 1
            else:
                out.append(F.scaled_dot_product_attention(q, k, v, is_causal=case.mask == "causal"))
        return tuple(out)


def inputs_of(case: Case, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (case.batch, case.heads, case.seq, case.dim)
    qkv = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(3)]
    if case.mask == "add":
        qkv.append(torch.randn(case.heads, case.seq, case.seq, generator=g).to(device, dtype))
    return qkv


def unfused(case: Case):
    """Eager's hand-written attention for the case (minGPT's form)."""
    def run(q, k, v, *mask):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if case.mask == "causal":
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            att = att.masked_fill(~causal, float("-inf"))
        elif mask:
            att = att + mask[0]
        return torch.softmax(att, dim=-1) @ v
    return run


def sdpa(case: Case):
    def run(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None,
                                              is_causal=case.mask == "causal")
    return run


def our_kernels(dtype: torch.dtype) -> dict[str, tuple[object, list[str]]]:
    """The planner's kernels for every case in each arithmetic (fp32: exact FMA, 3xTF32 as the strict policy gives
    SDPA nodes, TF32 as the tf32 policy gives, and 3xTF32 in the first tensor-core kernel, where the flash kernel
    would take the case; bf16: tensor cores), and each one's kernel names."""
    example = [t for case in CASES for t in inputs_of(case, dtype, "meta")]
    plan = make_plan(capture_module(Attentions(), example))
    assert len(plan.attention) == len(CASES), plan.summary()
    maths = ("fma", "3xtf32", "tf32") if dtype == torch.float32 else (plan.attention[0].math,)
    steps = [replace(a, kernel=f"a{i * len(CASES) + j}", math=m) for i, m in enumerate(maths)
             for j, a in enumerate(plan.attention)]
    kernels = load_kernels(generate(replace(plan, steps=tuple(steps))), f"attention_probe_{str(dtype)[6:]}")
    built = {f"kernelfuse {m}" if len(maths) > 1 else "kernelfuse":
             (kernels, [s.kernel for s in steps[i * len(CASES):(i + 1) * len(CASES)]]) for i, m in enumerate(maths)}
    if dtype == torch.float32:  # 3xTF32 again in the first tensor-core kernel, beside the flash kernel
        flash = attention.flash_warps
        attention.flash_warps = lambda step, strides: 0
        try:
            steps = [replace(a, math="3xtf32") for a in plan.attention]
            first = load_kernels(generate(replace(plan, steps=tuple(steps))), "attention_probe_first_f32")
        finally:
            attention.flash_warps = flash
        built["kernelfuse 3xtf32 first kernel"] = (first, [s.kernel for s in steps])
    return built


def main(argv: list[str]) -> int:
    compile_too = "--no-compile" not in argv
    paths = [a for a in argv if not a.startswith("--")]
    rows = ["| case | dtype | method | ms | max abs err vs fp64 | ours: speedup |", "|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        built = our_kernels(dtype)
        for i, case in enumerate(CASES):
            args = inputs_of(case, dtype, "cuda")
            with torch.no_grad():
                reference = unfused(case)(*(t.double() for t in args))
            methods = {label: lambda a=args, f=getattr(kernels, names[i]): f(*a)  # noqa: B008 - bound per case
                       for label, (kernels, names) in built.items()}
            methods["eager unfused"] = lambda a=args, c=case: unfused(c)(*a)
            for backend, enum in BACKENDS.items():
                methods[f"sdpa {backend}"] = lambda a=args, c=case, e=enum: _with_backend(e, sdpa(c), a)
            if compile_too:
                compiled = torch.compile(unfused(case), dynamic=False)
                methods["torch.compile unfused"] = lambda a=args, f=compiled: f(*a)
            times: dict[str, float] = {}
            for method, fn in methods.items():
                try:
                    with torch.no_grad():
                        err = (fn().double() - reference).abs().nan_to_num(0.0).max().item()
                        times[method] = median_event_ms(fn)
                except RuntimeError as e:  # the backend does not take this case (dtype, mask, head dim)
                    why = str(e).splitlines()[0][:60]
                    rows.append(f"| {case.name} | {str(dtype)[6:]} | {method} | n/a | {why} | |")
                    continue
                ours = min((t for m, t in times.items() if m.startswith("kernelfuse")), default=times[method])
                ratio = "" if method.startswith("kernelfuse") else f"{times[method] / ours:.2f}x"
                rows.append(f"| {case.name} | {str(dtype)[6:]} | {method} | {times[method]:.4f} | {err:.2e} | "
                            f"{ratio} |")
            sdpas = [t for m, t in times.items() if m.startswith("sdpa")]
            for label in built:
                if sdpas and label in times:
                    rows.append(f"| {case.name} | {str(dtype)[6:]} | **best SDPA / {label}** | | | "
                                f"**{min(sdpas) / times[label]:.2f}x** |")
            print("\n".join(rows[-len(methods) - len(built):]), flush=True)
            del args, reference
            torch.cuda.empty_cache()
    text = "\n".join(rows) + "\n"
    print(text)
    if paths:
        with open(paths[0], "w") as f:
            f.write(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + text)
    return 0


def _with_backend(backend: SDPBackend, fn, args):  # noqa: ANN001, ANN202 - a benchmark helper
    with sdpa_kernel([backend]):
        return fn(*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
