"""GPU probe: the implicit-GEMM convolution with its epilogue inside against cuDNN plus today's epilogue kernel.

For each problem file given, every convolution anchor of the fused-igemm plan is built and, on one GPU:
  planned as the optimizer plans it: TF32 tensor cores, or 3xTF32 where eager's cuDNN call computes in full fp32;
  checked: ours against the library chain under eager's flags (cuDNN, TF32 allowed) and both against float64 on
           the first images (the judge's rule, kernelfuse.verify.float64.accuracy_ok);
  timed (CUDA events, median of 20, L2 flushed before each call): cuDNN alone NCHW, cuDNN alone channels-last
           (operands converted beforehand), today's library anchor + epilogue kernel (NCHW and channels-last plans,
           the faster one), our bare convolution (no epilogue) and ours with the epilogue inside.

Run on the GPU host from the repo root:
  PYTHONPATH=. python benchmarks/conv_igemm_probe.py PROBLEM.py [PROBLEM.py ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import torch

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.codegen.conv_geometry import conv_shape
from kernelfuse.codegen.conv_igemm import dense_kernel, tile_config
from kernelfuse.codegen.conv_tc import dense_config
from kernelfuse.emit.module import load_kernels
from kernelfuse.load import load_problem
from kernelfuse.plan import Plan, fuse, make_plan
from kernelfuse.plan.fuse import PlanOptions
from kernelfuse.plan.interpret import run_env, run_fused
from kernelfuse.plan.ir import Epilogue, FusedStep
from kernelfuse.rewrite import apply_rules
from kernelfuse.verify.float64 import accuracy_ok

REF_IMAGES = 2  # float64 reference on the first images only (per-image work; operands must not vary by image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="+", type=Path)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False  # eager's default
    rows = []
    for path in args.problems:
        started = time.perf_counter()
        try:
            rows += probe(path)
        except Exception as err:  # one problem's failure is a row of the table, not the end of the run
            rows.append((path.stem[:28], "-", f"ERROR {type(err).__name__}: {str(err)[:150]}"))
        print(f"# {path.name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    print(f"\n{'problem':28s} {'kernel':6s} result")
    for problem, kernel, text in rows:
        print(f"{problem:28s} {kernel:6s} {text}")


def probe(path: Path) -> list[tuple[str, str, str]]:
    problem = load_problem(path)
    graph = apply_rules(capture(problem)).graph
    # today's library path with the epilogue left in the anchor's step (no reduction kernel takes it over)
    library = {layout: make_plan(graph, PlanOptions(conv_layout=layout, generated=False))
               for layout in ("nchw", "nhwc")}
    device = torch.device("cuda")
    model = build_model(problem).to(device).eval()
    state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    inputs = problem.make_inputs(0, device)
    with torch.no_grad():
        env = run_env(library["nchw"], state, inputs)
    # as the optimizer plans it: 3xTF32 where eager's call computes in full fp32 (kernelfuse.bench.layout)
    options = PlanOptions(conv_layout="nchw", cudnn_fused_relu=False, conv_impl="generated",
                          fp32_convs=_fp32_convs(graph, env))
    igemm = make_plan(graph, options)
    with patch.object(fuse, "tap_major_weights", lambda g, exact: g):  # the general kernel: no tap-major weights
        general = make_plan(graph, options)
    steps = [s for s in igemm.fused if s.anchor.epilogue_inside]
    if not steps:
        return [(path.stem[:28], "-", "no generated convolution in the plan")]
    started = time.perf_counter()
    exts = {"igemm": load_kernels(generate(igemm), f"probe_{problem.name}_igemm")}
    if any(dense_kernel(igemm.graph, s) for s in steps):
        exts["general"] = load_kernels(generate(general), f"probe_{problem.name}_general")
    for layout, plan in library.items():
        sources = generate(plan)
        exts[layout] = load_kernels(sources, f"probe_{problem.name}_{layout}") if sources else None
    bare_plan = Plan(igemm.graph, tuple(_bare(s) for s in steps), "bare")
    exts["bare"] = load_kernels(generate(bare_plan), f"probe_{problem.name}_bare")
    build_s = time.perf_counter() - started
    with torch.no_grad():
        env.update(run_env(igemm, state, inputs))  # the tap-major weight copies
    rows = []
    with torch.no_grad():
        for step, bare in zip(steps, bare_plan.fused, strict=True):
            rows.append((path.stem[:28], step.kernel, _probe_step(igemm.graph, step, bare, library, exts, env,
                                                                  build_s)))
    return rows


def _fp32_convs(graph, env: dict) -> tuple[str, ...]:
    """The convolutions whose eager result (cuDNN, TF32 allowed) equals the TF32-free one: eager is fp32 there."""
    found = []
    previous = torch.backends.cudnn.allow_tf32
    with torch.no_grad():
        for node in graph.nodes:
            if node.op != "convolution.default":
                continue
            x, w = env[node.args[0].name], env[node.args[1].name]
            b = env[node.args[2].name] if node.args[2] is not None else None
            torch.backends.cudnn.allow_tf32 = True
            tf32 = torch.convolution(x, w, b, *node.args[3:9])
            torch.backends.cudnn.allow_tf32 = False
            full = torch.convolution(x, w, b, *node.args[3:9])
            torch.backends.cudnn.allow_tf32 = previous
            if torch.allclose(tf32, full, rtol=1e-5, atol=1e-5 * float(full.abs().max())):
                found.append(node.name)
            del tf32, full
    return tuple(found)


def _bare(step: FusedStep) -> FusedStep:
    """The same convolution without its epilogue: what the fused kernel costs beyond the convolution itself."""
    node = step.anchor.node
    return replace(step, epilogue=Epilogue((), (), node.meta), replaces=(node.name,), out=node.name)


def _library_step(plan: Plan, step: FusedStep) -> FusedStep | None:
    return next((s for s in plan.fused if s.anchor.node.name == step.anchor.node.name), None)


def _probe_step(graph, step: FusedStep, bare: FusedStep, library: dict[str, Plan], exts: dict, env: dict,
                build_s: float) -> str:
    node = step.anchor.node
    dense = dense_kernel(graph, step)
    x, wk = env[node.args[0].name].contiguous(), env[node.args[1].name]  # wk: the weight as the kernel reads it
    w = wk.contiguous()
    if not dense:
        wk = w
    b = env[node.args[2].name] if node.args[2] is not None else None
    conv_args = node.args[3:9]
    operands = [env[o.ref.name] for o in step.epilogue.operands]
    ours = getattr(exts["igemm"], step.kernel)(x, wk, b, *operands)
    eager = run_fused(graph, step, env)  # cuDNN under eager's flags, then the epilogue as torch ops
    diff = (ours - eager).abs().max().item()
    accuracy = _float64_check(graph, step, env, ours, eager)
    times = {"cudnn_nchw": median_event_ms(lambda: torch.convolution(x, w, b, *conv_args))}
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if x.dim() in (4, 5):
        xc, wc = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
        times["cudnn_cl"] = median_event_ms(lambda: torch.convolution(xc, wc, b, *conv_args))
    for layout, plan in library.items():
        lib = _library_step(plan, step)
        if lib is not None:
            lib_operands = [env[o.ref.name] for o in lib.epilogue.operands]
            times[f"lib_{layout}+epi"] = median_event_ms(_library_call(lib, exts[layout], x, w, b, conv_args,
                                                                       lib_operands))
    if dense and "general" in exts:
        times["general_fused"] = median_event_ms(lambda: getattr(exts["general"], step.kernel)(x, w, b, *operands))
    times["ours_bare"] = median_event_ms(lambda: getattr(exts["bare"], bare.kernel)(x, wk, b))
    times["ours_fused"] = median_event_ms(lambda: getattr(exts["igemm"], step.kernel)(x, wk, b, *operands))
    shape = conv_shape(graph, step)
    cfg = tile_config(shape)
    best_lib = min((v for k, v in times.items() if k.startswith("lib_")), default=float("nan"))
    fields = " ".join(f"{k}={v:.3f}" for k, v in times.items())
    kind = f"dense BN={dense_config(shape).bn}" if dense else f"general BN={cfg.bn}"
    return (f"M={shape.m} N={shape.cog} K={shape.kg} g={shape.groups} T={int(shape.transposed)} {kind} "
            f"build={build_s:.1f}s | {'3xTF32' if step.anchor.fp32 else 'TF32'} max|ours-eager|={diff:.2e} "
            f"{accuracy} | "
            f"{fields} ms | "
            f"fused/bare={times['ours_fused'] / times['ours_bare']:.2f} lib/ours={best_lib / times['ours_fused']:.2f}")


def _library_call(step: FusedStep, ext, x, w, b, conv_args, operands):
    """Today's path: cuDNN (channels-last operands converted by our kernel; with bias+ReLU where the plan fuses
    them), then the epilogue kernel if any."""
    nhwc = step.anchor.layout == "nhwc"
    fmt = torch.channels_last if w.dim() == 4 else torch.channels_last_3d
    wl = w.contiguous(memory_format=fmt) if nhwc else w
    stride, padding, dilation, _, _, groups = conv_args

    def run():
        xl = ext.to_channels_last(x) if nhwc else x
        if step.anchor.fused_relu:
            acc = torch.cudnn_convolution_relu(xl, wl, b, stride, padding, dilation, groups)
        else:
            acc = torch.convolution(xl, wl, b, *conv_args)
        return getattr(ext, step.kernel)(acc, *operands) if step.needs_kernel else acc
    return run


def _float64_check(graph, step: FusedStep, env: dict, ours: torch.Tensor, eager: torch.Tensor) -> str:
    """ours and eager against float64 on the first images, where no operand varies by image."""
    node = step.anchor.node
    n = min(REF_IMAGES, ours.shape[0])
    names = {r.name for r in node.args[:3] if r is not None} | {o.ref.name for o in step.epilogue.operands}
    local = {}
    for name in names:
        t = env[name]
        if name == node.args[0].name:
            t = t[:n]
        elif t.dim() == ours.dim() and t.shape[0] == ours.shape[0] and t.shape[0] != 1:
            return "f64=skipped (operand varies by image)"
        local[name] = t.double()
    ref = run_fused(graph, step, local)
    ours_err = (ours[:n].double() - ref).abs().max().item()
    eager_err = (eager[:n].double() - ref).abs().max().item()
    ok = accuracy_ok(ours_err, eager_err, ref.abs().max().item())
    return f"f64 ours={ours_err:.2e} eager={eager_err:.2e} {'OK' if ok else 'FAIL'}"


if __name__ == "__main__":
    main()
