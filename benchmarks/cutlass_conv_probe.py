"""GPU probe for issue 22's route choice: CUTLASS 3.x's sm90 TF32 implicit-GEMM convolution against cuDNN.

Builds `cutlass_conv_probe.cu` once per variant (in parallel, each build timed on its own) with the headers of the
`nvidia-cutlass` wheel, then for each problem file's first Conv2d times (CUDA events, median of 20, L2 flushed):
cuDNN in NCHW and channels-last (eager's TF32 flags), CUTLASS bare (NHWC out; 128x128 and 128x64 tiles), CUTLASS
with bias + mish(mish(.)) applied by an epilogue visitor (NHWC out), CUTLASS writing NCHW straight from the
accumulators (variant 2: its output was wrong at stop 43, so its time means nothing until that is found), and the
NCHW -> NHWC input copy a channels-last route needs. Checked against float64 (the first two images): the error of
eager's cuDNN call and of CUTLASS, with operands rounded to TF32 (round to nearest, as cuDNN does) and without (the
tensor cores then drop the low bits). Results and the decision: benchmarks/NOTES.md, "Stop 43".

Run on the GPU host from the repo root (needs `pip install 'kernelfuse[cutlass]'`, i.e. nvidia-cutlass):
  PYTHONPATH=. python benchmarks/cutlass_conv_probe.py PROBLEM.py [PROBLEM.py ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import build_model
from kernelfuse.load import load_problem

VARIANTS = {0: "bare 128x128", 1: "bias+mish2 128x128", 2: "bare NCHW-out 128x128", 3: "bare 128x64"}
SOURCE = Path(__file__).with_suffix(".cu")


def cutlass_include() -> Path:
    """The CUTLASS headers shipped inside the nvidia-cutlass wheel (cutlass_library/source/include)."""
    import cutlass_library

    return Path(cutlass_library.__file__).parent / "source" / "include"


def build(variant: int) -> tuple[object, float]:
    inc = cutlass_include()
    started = time.perf_counter()
    ext = load(
        f"kf_cutlass_probe{variant}",
        [str(SOURCE)],
        extra_include_paths=[str(inc), str(inc.parent / "tools" / "util" / "include")],
        extra_cuda_cflags=[f"-DKF_VARIANT={variant}", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                           "--expt-relaxed-constexpr", "-std=c++17"],
        verbose=False,
    )
    return ext, time.perf_counter() - started


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round to nearest TF32 (10 mantissa bits), ties away from zero: cvt.rna.tf32.f32's result."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view_as(t)


def mish2(t: torch.Tensor) -> torch.Tensor:
    return F.mish(F.mish(t))


def probe(path: Path, exts: dict[int, object]) -> list[str]:
    problem = load_problem(path)
    device = torch.device("cuda")
    model = build_model(problem).to(device).eval()
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    (x, *_) = problem.make_inputs(0, device)
    w, b = conv.weight.detach(), conv.bias.detach() if conv.bias is not None else torch.zeros(conv.out_channels,
                                                                                                 device=device)
    pad, stride, dil = list(conv.padding), list(conv.stride), list(conv.dilation)
    assert conv.groups == 1, "the probe covers ungrouped convolutions"
    with torch.no_grad():
        # float64 on the first two images only: cuDNN's float64 convolution is slow at these sizes
        ref64 = F.conv2d(x[:2].double(), w.double(), b.double(), stride, pad, dil)
        eager = F.conv2d(x, w, b, stride, pad, dil)
        n, k, p, q = eager.shape
        xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        xr, wr = round_tf32(xc).contiguous(memory_format=torch.channels_last), round_tf32(wc).contiguous(
            memory_format=torch.channels_last)
        zero = torch.zeros(k, device=device)
        nhwc = torch.empty(n, k, p, q, device=device).contiguous(memory_format=torch.channels_last)
        nchw = torch.empty(n, k, p, q, device=device)
        flops = 2 * n * p * q * k * w[0].numel()
        ms = {
            "cudnn_nchw": median_event_ms(lambda: F.conv2d(x, w, b, stride, pad, dil)),
            "cudnn_cl": median_event_ms(lambda: F.conv2d(xc, wc, b, stride, pad, dil)),
            "to_cl": median_event_ms(lambda: x.contiguous(memory_format=torch.channels_last)),
        }
        errs = {"eager": (eager[:2].double() - ref64).abs().max().item()}
        for v, ext in exts.items():
            out = nchw if v == 2 else nhwc
            bias = b if v == 1 else zero
            ext.run(xr, wr, bias, out, pad, stride, dil)
            got = out[:2].double() + (0 if v == 1 else b.double().view(1, -1, 1, 1))
            want = mish2(ref64) if v == 1 else ref64
            errs[f"v{v}"] = (got - want).abs().max().item()
            if v == 0:
                ext.run(xc, wc, zero, out, pad, stride, dil)
                errs["v0_truncated"] = (out[:2].double() + b.double().view(1, -1, 1, 1) - ref64).abs().max().item()
            ms[f"v{v}"] = median_event_ms(lambda ext=ext, out=out, bias=bias: ext.run(xr, wr, bias, out, pad, stride,
                                                                                       dil))
        errs["eager_mish2"] = (mish2(eager[:2]).double() - mish2(ref64)).abs().max().item()
    lines = [f"{path.stem[:36]}  N={n} C={x.shape[1]} K={k} {p}x{q} kernel={tuple(w.shape[2:])}  "
             f"{flops / 1e9:.1f} GFLOP"]
    for name, t in ms.items():
        label = VARIANTS.get(int(name[1:]), name) if name.startswith("v") else name
        tflops = f"  {flops / t / 1e9:.0f} TFLOP/s" if name not in ("to_cl",) else ""
        lines.append(f"  {name:12s} {label:24s} {t:8.3f} ms{tflops}")
    lines.append("  max |err| vs float64: " + ", ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="+", type=Path)
    parser.add_argument("--variants", default=",".join(str(v) for v in VARIANTS))
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = True  # eager's default for convolutions
    variants = [int(v) for v in args.variants.split(",")]
    os.environ.setdefault("MAX_JOBS", "4")
    started = time.perf_counter()
    with ThreadPoolExecutor(len(variants)) as pool:
        built = dict(zip(variants, pool.map(build, variants), strict=True))
    print(f"# built {len(variants)} variants in {time.perf_counter() - started:.1f} s (in parallel); each: "
          + ", ".join(f"v{v}={t:.1f} s" for v, (_, t) in built.items()), flush=True)
    exts = {v: ext for v, (ext, _) in built.items()}
    for path in args.problems:
        try:
            for line in probe(path, exts):
                print(line, flush=True)
        except Exception as err:  # one problem's failure is a line, not the end of the run
            print(f"{path.stem[:36]} ERROR {type(err).__name__}: {str(err)[:300]}", flush=True)
        torch.cuda.empty_cache()
    print(f"# total {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
