"""The flash-attention kernel against what a user would run instead, on level-3-like shapes, fp32 and bf16.

    PYTHONPATH=. python benchmarks/attention_probe.py [OUT.md] [--no-compile] [--bf16-only | --fp32-only]
        [--flash-configs default,warps4,...] [--short-rows w2r1,w4r1,...] [--cases Swin,ViT-B]

Per shape and dtype: our kernel (kernelfuse.codegen.attention, built through the planner from an SDPA call; fp32
in each arithmetic: exact FMA, 3xTF32, TF32),
eager's unfused attention (q @ kᵀ * scale, mask, softmax, @ v), torch's SDPA under each backend that accepts the
case (math, efficient, flash, cuDNN) and torch.compile of the unfused form. Each is checked against a float64
reference (max abs error) and timed by CUDA events with L2 flushed (median of 20). Under 3 minutes on one H100
(torch.compile's builds are most of it; --no-compile skips them). --flash-configs builds the bf16 flash kernel once
per named tiling (FLASH_CONFIGS; their builds overlap) and times each as its own "kernelfuse NAME" row.
--short-rows builds fp32's short-rows form (kernelfuse.codegen.attention_short) once per named tiling
(SHORT_ROWS_CONFIGS), in 3xTF32 and TF32 ("kernelfuse 3xtf32 short NAME", "kernelfuse tf32 short NAME" rows), or in
exact FMA for the tilings named ...fma ("kernelfuse fma short NAME"), and times it on the cases it takes
(S and L up to 64, head dims 32 and 64: Swin's windows, ViT-B's short rows). --cases keeps the cases whose names
contain one of the given words.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from unittest.mock import patch

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import capture_module
from kernelfuse.codegen import attention, attention_short, generate
from kernelfuse.codegen.attention_short import ShortRows
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import make_plan
from kernelfuse.plan.ir import Plan


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
    Case("ViT-B short rows", 64, 12, 50, 64, "none"),
    Case("GPT-2 small", 8, 12, 1024, 64, "causal"),
    Case("UNet self-attn", 4, 8, 4096, 40, "none"),
    Case("Llama-style head dim 128", 4, 32, 1024, 128, "causal"),
)
# --flash-configs: tilings of the bf16 flash kernel, kernelfuse.codegen.attention.FlashConfig fields over each case's
# default (flash_config's rule: since stop 44 the query fragments come from shared memory at head dims 65-96). At
# head dim 96 (ptxas, sm_90) 8 warps with the query in registers hold 196 registers (one block an SM); a min_blocks of
# 2 for 8 warps or 4 for 4 caps a thread at 128: 8 bytes spilled with the query fragments read from shared memory,
# none with 32-key tiles. 4 warps of 64-key tiles fit 3 blocks an SM by shared memory (65 KB each): 167 registers.
FLASH_CONFIGS = {
    "default": {},
    "qreg8": {"warps": 8, "q_in_registers": True, "min_blocks": 0},
    "warps4": {"warps": 4},
    "warps8": {"warps": 8},
    "keys32": {"keys": 32},
    "qsmem8": {"warps": 8, "q_in_registers": False, "min_blocks": 2},
    "qsmem4": {"warps": 4, "q_in_registers": False, "min_blocks": 4},
    "qsmem8_keys32": {"warps": 8, "keys": 32, "q_in_registers": False, "min_blocks": 2},
    "w8_k32_b2": {"warps": 8, "keys": 32, "min_blocks": 2},
    "w4_k32_b4": {"warps": 4, "keys": 32, "min_blocks": 4},
    "w4_b3": {"warps": 4, "min_blocks": 3},
}
# --short-rows: tilings of fp32's short-rows form, attention_short.ShortRows(windows a block, 16-row tiles a warp,
# __launch_bounds__'s blocks an SM, exact FMAs). Registers (ptxas 13, sm_90a, Swin's d32 with its bias / ViT's d64),
# 3xTF32: one row tile a warp 72-79 / 101-103, two 141 / 174; b3 and b4 cap 256-thread blocks at 85 and 64 registers
# (d32's 64 spills 40 bytes; d64's 528), w4r1b2 and w1r1b8 cap at 64 likewise. At 72-79 registers an SM holds 28
# warps of w1r1, 24 of w2r1 but only 16 of w4r1 (one 512-thread block). FMA: one row tile 90-108 / 96-116, two
# 163 / 168. Shared memory a block: 16 KB a d32 window (keys and values; FMA 12 KB and 9 KB of queries) + 18 KB for
# a bias shared by the block's windows; 27 KB a d64 window. "w8r1" does not fit a d64 block: it keeps the flash kernel.
SHORT_ROWS_CONFIGS = {
    "w1r1": ShortRows(1, 1),
    "w2r1": ShortRows(2, 1),
    "w4r1": ShortRows(4, 1),
    "w8r1": ShortRows(8, 1),
    "w2r2": ShortRows(2, 2),
    "w4r2": ShortRows(4, 2),
    "w2r1b3": ShortRows(2, 1, 3),
    "w2r1b4": ShortRows(2, 1, 4),
    "w4r1b2": ShortRows(4, 1, 2),
    "w1r1b8": ShortRows(1, 1, 8),
    "w1r1fma": ShortRows(1, 1, fma=True),
    "w2r1fma": ShortRows(2, 1, fma=True),
    "w4r1fma": ShortRows(4, 1, fma=True),
    "w2r2fma": ShortRows(2, 2, fma=True),
}
# The probe's "kernelfuse fma / 3xtf32 / tf32" rows are the flash and FMA kernels: the short-rows form (on by default
# in the planner since stop 58) runs only as the --short-rows rows, each tiling patched in
attention_short.SHORT_ROWS = attention_short.SHORT_ROWS_FMA = None
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


def short_rows_forms(names: list[str]) -> dict[str, tuple[object, list[str | None]]]:
    """fp32's short-rows form once per SHORT_ROWS_CONFIGS tiling, in 3xTF32 and TF32, or in FMA (the builds
    overlap): each label's kernels, None for the cases the form does not take."""
    example = [t for case in CASES for t in inputs_of(case, torch.float32, "meta")]
    plan = make_plan(capture_module(Attentions(), example))
    maths = ("3xtf32", "tf32")
    steps = [replace(a, kernel=f"a{i * len(CASES) + j}", math=m) for i, m in enumerate(maths)
             for j, a in enumerate(plan.attention)]
    plan = replace(plan, steps=tuple(steps))
    sources, taken = {}, {}
    for name in names:
        with patch.object(attention_short, "SHORT_ROWS", SHORT_ROWS_CONFIGS[name]):
            sources[name] = generate(plan)
            taken[name] = [s.kernel if attention.short_rows_tiling(s) else None for s in steps]
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda n: load_kernels(sources[n], f"attention_probe_short_{n}"), names))
    return {f"kernelfuse {m} short {name}": (ext, taken[name][i * len(CASES):(i + 1) * len(CASES)])
            for name, ext in zip(names, built, strict=True)
            for i, m in enumerate(("fma",) if SHORT_ROWS_CONFIGS[name].fma else maths)}


def our_kernels(dtype: torch.dtype, flash_configs: list[str],
                split_forms: bool = False) -> dict[str, tuple[object, list[str]]]:
    """The planner's kernels for every case in each arithmetic (fp32: exact FMA, 3xTF32 as the strict policy gives
    SDPA nodes, TF32 as the tf32 policy gives, and 3xTF32 in the first tensor-core kernel, where the flash kernel
    would take the case, and with `split_forms` each of SPLIT_FORMS; bf16: tensor cores, once per tiling of
    `flash_configs` if any), and each one's kernel names."""
    example = [t for case in CASES for t in inputs_of(case, dtype, "meta")]
    plan = make_plan(capture_module(Attentions(), example))
    assert len(plan.attention) == len(CASES), plan.summary()
    maths = ("fma", "3xtf32", "tf32") if dtype == torch.float32 else (plan.attention[0].math,)
    steps = [replace(a, kernel=f"a{i * len(CASES) + j}", math=m) for i, m in enumerate(maths)
             for j, a in enumerate(plan.attention)]
    if dtype == torch.bfloat16 and flash_configs:
        return flash_tilings(replace(plan, steps=tuple(steps)), flash_configs)
    kernels = load_kernels(generate(replace(plan, steps=tuple(steps))), f"attention_probe_{str(dtype)[6:]}")
    built = {f"kernelfuse {m}" if len(maths) > 1 else "kernelfuse":
             (kernels, [s.kernel for s in steps[i * len(CASES):(i + 1) * len(CASES)]]) for i, m in enumerate(maths)}
    if dtype == torch.float32:  # 3xTF32 again in the first tensor-core kernel, beside the flash kernel
        steps = [replace(a, math="3xtf32") for a in plan.attention]
        with patch.object(attention, "flash_warps", lambda step, strides: 0):
            first = load_kernels(generate(replace(plan, steps=tuple(steps))), "attention_probe_first_f32")
        built["kernelfuse 3xtf32 first kernel"] = (first, [s.kernel for s in steps])
        if split_forms:  # the 3xTF32 flash kernel with other operand splits (SPLIT_FORMS), beside the shipped one
            source = generate(replace(plan, steps=tuple(steps)))
            assert SHIPPED_SPLIT in source.cuda, "kf_tf32_parts changed: update SPLIT_FORMS"
            for name, body in SPLIT_FORMS.items():
                form = replace(source, cuda=source.cuda.replace(SHIPPED_SPLIT, body))
                built[f"kernelfuse 3xtf32 {name}"] = (load_kernels(form, f"attention_probe_{name.replace(' ', '_')}"),
                                                      [s.kernel for s in steps])
    return built


# kf_tf32_parts's 3xTF32 branch as shipped, and the forms --split-forms times against it
SHIPPED_SPLIT = """    big = __float_as_uint(x);
    const float rest = x - __uint_as_float(big & 0xffffe000u);
    small = (__float_as_uint(rest) + 0x1000u) & 0xffffe000u;"""
SPLIT_FORMS = {
    "rna split": "    big = kf_tf32(x);\n    small = kf_tf32(x - __uint_as_float(big));",  # both parts by cvt.rna
    "truncated small":  # the remainder truncated by the tensor cores too
        "    big = __float_as_uint(x);\n    small = __float_as_uint(x - __uint_as_float(big & 0xffffe000u));",
}


def flash_tilings(plan: Plan, names: list[str]) -> dict[str, tuple[object, list[str]]]:
    """The bf16 plan's kernels once per FLASH_CONFIGS tiling, each case's default config with the tiling's fields
    over it (the builds overlap: nvcc runs in subprocesses)."""
    default = attention.flash_config
    sources = {}
    for name in names:
        def tiled(step, strides, fields=FLASH_CONFIGS[name]):  # noqa: ANN001, ANN202 - flash_config's signature
            config = default(step, strides)
            return replace(config, **fields) if config.warps else config
        with patch.object(attention, "flash_config", tiled):
            sources[name] = generate(plan)
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda n: load_kernels(sources[n], f"attention_probe_flash_{n}"), names))
    kernels = [a.kernel for a in plan.attention]
    return {f"kernelfuse {name}": (ext, kernels) for name, ext in zip(names, built, strict=True)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="the table as markdown, with the GPU's name")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile rows (most of the run time)")
    parser.add_argument("--bf16-only", action="store_true", help="skip the fp32 cases")
    parser.add_argument("--fp32-only", action="store_true", help="skip the bf16 cases")
    parser.add_argument("--split-forms", action="store_true", help="fp32: time the 3xTF32 kernel's other splits")
    parser.add_argument("--flash-configs", default="", help=f"bf16 flash tilings to time, of {','.join(FLASH_CONFIGS)}")
    parser.add_argument("--short-rows", default="",
                        help=f"fp32 short-rows tilings to time, of {','.join(SHORT_ROWS_CONFIGS)}")
    parser.add_argument("--cases", default="", help="comma-separated words: only the cases whose names hold one")
    opts = parser.parse_args(argv)
    flash_configs = [n for n in opts.flash_configs.split(",") if n]
    if unknown := set(flash_configs) - set(FLASH_CONFIGS):
        parser.error(f"unknown flash configs {sorted(unknown)}, not in {list(FLASH_CONFIGS)}")
    short_configs = [n for n in opts.short_rows.split(",") if n]
    if unknown := set(short_configs) - set(SHORT_ROWS_CONFIGS):
        parser.error(f"unknown short-rows configs {sorted(unknown)}, not in {list(SHORT_ROWS_CONFIGS)}")
    if opts.cases:
        global CASES
        CASES = tuple(c for c in CASES if any(w.strip() and w.strip() in c.name for w in opts.cases.split(",")))
        if not CASES:
            parser.error(f"no case name holds any of {opts.cases!r}")
    rows = ["| case | dtype | method | ms | max abs err vs fp64 | ours: speedup |", "|---|---|---|---|---|---|"]
    dtypes = (torch.bfloat16,) if opts.bf16_only else (torch.float32,) if opts.fp32_only else \
        (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        built = our_kernels(dtype, flash_configs, opts.split_forms)
        if dtype == torch.float32 and short_configs:
            built.update(short_rows_forms(short_configs))
        for i, case in enumerate(CASES):
            args = inputs_of(case, dtype, "cuda")
            with torch.no_grad():
                reference = unfused(case)(*(t.double() for t in args))
            methods = {label: lambda a=args, f=getattr(kernels, names[i]): f(*a)  # noqa: B008 - bound per case
                       for label, (kernels, names) in built.items() if names[i] is not None}
            methods["eager unfused"] = lambda a=args, c=case: unfused(c)(*a)
            for backend, enum in BACKENDS.items():
                methods[f"sdpa {backend}"] = lambda a=args, c=case, e=enum: _with_backend(e, sdpa(c), a)
            if not opts.no_compile:
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
            print("\n".join(rows[-len(methods) - len([b for b in built if b in times]):]), flush=True)
            del args, reference
            torch.cuda.empty_cache()
    text = "\n".join(rows) + "\n"
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + text)
    return 0


def _with_backend(backend: SDPBackend, fn, args):  # noqa: ANN001, ANN202 - a benchmark helper
    with sdpa_kernel([backend]):
        return fn(*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
