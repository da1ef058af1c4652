"""GPU probe: tilings of the dense implicit-GEMM convolution (kernelfuse.codegen.conv_tc, and its wgmma form
kernelfuse.codegen.conv_wgmma) against cuDNN.

For each problem file, its first convolution the dense kernel takes is built once per configuration and timed (CUDA
events, median of 20, L2 flushed) bare (no epilogue) and with the epilogue inside, next to cuDNN alone in NCHW and
channels-last (operands converted beforehand) and the NCHW -> channels-last copy of the input a channels-last
configuration needs (torch's). A 1-d convolution (which the TMA kernel takes as 2-d of H = 1) has no cuDNN
channels-last call (cudnn_cl n/a); its channels-last input is the (N, C, 1, L) view's. "tma-prerounded" times the
TMA kernel's pre-rounded form on the binding's copy rounded to nearest TF32, made beforehand (its own time printed
beside: the file's copy kernel, rounding). Checked: ours against cuDNN under eager's flags (max abs difference).

Run on the GPU host from the repo root:
  PYTHONPATH=. python benchmarks/conv_tc_probe.py PROBLEM.py [PROBLEM.py ...] [--configs mma,wgmma,...]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import torch

import kernelfuse.codegen.conv_igemm as conv_igemm
from benchmarks.conv_igemm_probe import _bare
from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.codegen.conv_geometry import conv_shape
from kernelfuse.codegen.conv_igemm import dense_kernel
from kernelfuse.codegen.conv_tc import dense_config
from kernelfuse.emit.module import load_kernels
from kernelfuse.load import load_problem
from kernelfuse.plan import Plan, owned_anchor_variants
from kernelfuse.plan.interpret import run_env, run_fused
from kernelfuse.rewrite import apply_rules

# DenseConfig changes from dense_config's tiling with its TMA form off; "mma" names keep the mma.sync kernel (no wgmma
# or TMA form in the file), "wgmma" ones run the wgmma form on a compute-capability 9.0 GPU where its tiles cover 3/4
# of the SMs (kernelfuse.codegen.conv_wgmma), "tma" ones the TMA im2col form (kernelfuse.codegen.conv_tma, where
# its tma_shape holds: dense_config's default there) on a channels-last input, operands rounded to nearest TF32 as
# the mma.sync kernel's (A in the consumers' registers, B by descriptor: the binding's copy of the weight rounded once),
# or truncated (tma-trunc); tma-prerounded is tma's file, its pre-rounded form (A and B by descriptor, as the
# binding's rounding copies made them) called on the input's copy (PREROUNDED)
CONFIGS = {
    "mma": {},
    "mma-truncated": {"round_tf32": False},
    "mma-unroll4": {"epilogue_unroll": 4},
    "mma-unroll8": {"epilogue_unroll": 8},
    "mma-8warps": {"warps_n": 4},
    "mma-nhwc": {"a_nhwc": True},
    "mma-stages4": {"stages": 4},
    "wgmma": {"wgmma": True},
    "wgmma-truncated": {"wgmma": True, "round_tf32": False},
    "wgmma-s4": {"wgmma": True, "wg_stages": 4},
    "wgmma-s4-2blocks": {"wgmma": True, "wg_stages": 4, "wg_min_blocks": 2},
    "wgmma-s4-2blocks-trunc": {"wgmma": True, "wg_stages": 4, "wg_min_blocks": 2, "round_tf32": False},
    "wgmma-regA": {"wgmma": True, "wg_a_regs": True},
    "wgmma-regA-s4-2blocks": {"wgmma": True, "wg_a_regs": True, "wg_stages": 4, "wg_min_blocks": 2},
    "mma-nhwc-trunc": {"a_nhwc": True, "round_tf32": False},
    "tma": {"tma": True},
    "tma-unroll4": {"tma": True, "tma_epilogue_unroll": 4},
    "tma-trunc": {"tma": True, "round_tf32": False},
    "tma-prerounded": {"tma": True},
}
PREROUNDED = {"tma-prerounded"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="+", type=Path)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    for path in args.problems:
        started = time.perf_counter()
        try:
            for line in probe(path, args.configs.split(",")):
                print(line, flush=True)
        except Exception as err:  # one problem's failure is a line, not the end of the run
            print(f"{path.stem[:30]} ERROR {type(err).__name__}: {str(err)[:300]}", flush=True)
        print(f"# {path.name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()


def probe(path: Path, configs: list[str]) -> list[str]:
    problem = load_problem(path)
    graph = apply_rules(capture(problem)).graph
    convs = frozenset(n.name for n in graph.nodes if n.op == "convolution.default")
    (plan,) = owned_anchor_variants(graph, measured=convs)  # TF32, as eager's cuDNN call on this GPU
    steps = [s for s in plan.fused if dense_kernel(plan.graph, s)]
    if not steps:
        return [f"{path.stem[:30]} no convolution the dense kernel takes"]
    step = steps[0]
    bare = _bare(step)
    device = torch.device("cuda")
    model = build_model(problem).to(device).eval()
    state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    with torch.no_grad():
        env = run_env(plan, state, problem.make_inputs(0, device))
    node = step.anchor.node
    x, wk = env[node.args[0].name].contiguous(), env[node.args[1].name]
    w, b = wk.contiguous(), env[node.args[2].name] if node.args[2] is not None else None
    operands = [env[o.ref.name] for o in step.epilogue.operands]
    conv_args = node.args[3:9]
    fmt = torch.channels_last if x.dim() <= 4 else torch.channels_last_3d
    x4 = x.unsqueeze(2) if x.dim() == 3 else x  # a 1-d convolution's input as the TMA kernel's binding views it
    xc = x4.contiguous(memory_format=fmt)
    wc = w.contiguous(memory_format=fmt) if x.dim() > 3 else None
    with torch.no_grad():
        ref = run_fused(plan.graph, step, env)
        shape = conv_shape(plan.graph, step)
        cudnn_cl = "n/a" if wc is None else \
            f"{median_event_ms(lambda: torch.convolution(xc, wc, b, *conv_args)):.3f}"
        lines = [f"{path.stem[:30]} {step.kernel} M={shape.m} N={shape.cog} K={shape.kg} | cudnn_nchw="
                 f"{median_event_ms(lambda: torch.convolution(x, w, b, *conv_args)):.3f} cudnn_cl={cudnn_cl} to_cl="
                 f"{median_event_ms(lambda: x4.contiguous(memory_format=fmt)):.3f} ms"]
        bare = replace(bare, kernel=f"{step.kernel}b")
        if x.dim() == 3 and any(CONFIGS[n].get("a_nhwc") for n in configs):  # the dense kernel reads 1-d as NCL
            lines.append("  (the channels-last dense configurations skipped: a 1-d convolution)")
            configs = [n for n in configs if not CONFIGS[n].get("a_nhwc")]
        cfgs = {name: replace(dense_config(shape), **{"tma": False, **CONFIGS[name]}) for name in configs}
        sources = {}
        for name, cfg in cfgs.items():
            with patch.object(conv_igemm, "dense_config", lambda s, cfg=cfg: cfg):
                sources[name] = generate(Plan(plan.graph, (step, bare), f"probe_{name}"))
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:  # nvcc runs in subprocesses: the builds overlap
            exts = pool.map(lambda n: load_kernels(sources[n], f"cp_{problem.name}_{n}"), cfgs)
            built = dict(zip(cfgs, exts, strict=True))
        lines.append(f"  built {len(cfgs)} configurations in {time.perf_counter() - started:.1f} s")
        for name, cfg in cfgs.items():
            ext = built[name]
            # the layout the kernel that runs reads, so that no copy is timed: channels-last for the TMA kernel
            tma_runs = "_kernel_tma" in sources[name].cuda and ext._conv_tma_ready(x)
            xin = xc if cfg.a_nhwc or tma_runs else x
            fused, unfused, copy = getattr(ext, step.kernel), getattr(ext, bare.kernel), ""
            if name in PREROUNDED:
                if not tma_runs:
                    lines.append(f"  {name:24s} the TMA kernel does not run here")
                    continue
                copy = " (rounding copy beforehand: " \
                       f"{median_event_ms(lambda: ext.to_channels_last(x4, round_tf32=True)):.3f} ms)"  # noqa: B023
                xin = ext.to_channels_last(x4, round_tf32=True)
                fused = _prerounded(ext, step.kernel, torch.empty_like(fused(xin, wk, b, *operands)))
                unfused = _prerounded(ext, bare.kernel, torch.empty_like(unfused(xin, wk, b)))
            out = fused(xin, wk, b, *operands)
            diff = (out - ref).abs().max().item()
            t_bare = median_event_ms(lambda: unfused(xin, wk, b))  # noqa: B023
            t_fused = median_event_ms(lambda: fused(xin, wk, b, *operands))  # noqa: B023
            form = "tma" if "_kernel_tma" in sources[name].cuda else "wgmma" if "_kernel_wg" in sources[name].cuda \
                else "mma.sync"
            if form == "tma":  # the launch counters: whether the TMA branch ran (not just was carried), which form
                launches, prerounded = _tma_launches(ext)
                form += f"(launches={launches}, prerounded={prerounded})"
            lines.append(f"  {name:24s} bn={cfg.bn} {form} bare={t_bare:.3f} "
                         f"fused={t_fused:.3f} ms{copy}  max|ours-cudnn|={diff:.1e}")
    return lines


def _prerounded(ext: object, kernel: str, out: torch.Tensor) -> Callable:
    """`kernel`'s pre-rounded TMA form called straight on an input already rounded and channels-last (the binding's
    method would route such an input to the rounding form: it runs the pre-rounded one only on a copy of its
    own), writing `out` (allocated as the method allocates its output); the weight rounded to nearest TF32 as the
    method rounds it for the TMA forms (the binding's cache: made once, then looked up at each call, as there)."""
    launcher = getattr(ext, f"_{kernel}_tma_prerounded")

    def call(x, w, b, *operands):
        w = ext._tf32_weight(w, kernel)
        bias = b.data_ptr() if b is not None else None
        ext._launch(launcher, kernel, x, x.data_ptr(), w.data_ptr(), bias, out.data_ptr(),
                    *(o.data_ptr() for o in operands))
        return out

    return call


def _tma_launches(ext: object) -> tuple[int, int]:
    """(TMA kernel launches, those of the pre-rounded form); -1 where the library has no TMA kernel."""
    lib = getattr(ext, "_lib", None)
    if lib is None or not hasattr(lib, "kf_conv_tma_launches"):
        return -1, -1
    lib.kf_conv_tma_launches.restype = ctypes.c_longlong
    lib.kf_conv_tma_prerounded_launches.restype = ctypes.c_longlong
    return int(lib.kf_conv_tma_launches()), int(lib.kf_conv_tma_prerounded_launches())


if __name__ == "__main__":
    main()
