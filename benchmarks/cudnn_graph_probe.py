"""cuDNN's graph API as the convolution-with-epilogue route (issue 22's third candidate), measured on the GPU.

For each problem's first Conv2d, with its shapes: cuDNN's runtime-fusion graph (conv_fprop, then the epilogue as
pointwise nodes in the same graph, and once more with genstats: the per-channel sum and sum of squares a training
batch norm needs, from the same kernel) against torch's channels-last convolution alone (the bare anchor) and
eager's whole chain. Two epilogues: level-2 54's (bias, times a per-channel tensor, leaky ReLU, GELU) and 4's
(bias, mish, mish written as x tanh(softplus(x))). Output channels-last and NCHW. Reports ms (CUDA events, median),
plan build seconds and max error against float64, beside eager's.

Needs `pip install 'kernelfuse[cudnn-graph]'` (nvidia-cudnn-frontend's `cudnn` module, imported after torch so that
it uses torch's bundled libcudnn). Run from the repo root on the GPU machine:
    PYTHONPATH=. python benchmarks/cudnn_graph_probe.py PROBLEM.py [PROBLEM.py ...] > $OUT/cudnn_graph_probe.md
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.load import load_problem


def _chain54(g, cudnn, y, m):
    y = g.mul(a=y, b=m, compute_data_type=cudnn.data_type.FLOAT)
    y = g.leaky_relu(input=y, negative_slope=0.01)
    return g.gelu(input=y)


def _mish(g, cudnn, y):
    t = g.tanh(input=g.softplus(input=y))
    return g.mul(a=y, b=t, compute_data_type=cudnn.data_type.FLOAT)


def _chain4(g, cudnn, y, m):
    return _mish(g, cudnn, _mish(g, cudnn, y))


def _torch54(y, m):
    return F.gelu(F.leaky_relu(y * m, 0.01))


def _torch4(y, m):
    return F.mish(F.mish(y))


EPILOGUES = {"54-chain": (_chain54, _torch54), "mish-mish": (_chain4, _torch4), "bare": (None, None)}


def graph_conv(cudnn, x, w, b, m, conv: torch.nn.Conv2d, epilogue: Callable | None, out_layout: str,
               stats: bool = False):
    """(run(), output tensor, build seconds, (per-channel sum, sum of squares) or None) of one cuDNN graph:
    conv_fprop [+ bias + epilogue] [+ genstats: the statistics a training batch norm needs, from the same kernel]."""
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    X = g.tensor(name="X", dim=list(x.size()), stride=list(x.stride()), data_type=cudnn.data_type.FLOAT)
    W = g.tensor(name="W", dim=list(w.size()), stride=list(w.stride()), data_type=cudnn.data_type.FLOAT)
    y = g.conv_fprop(image=X, weight=W, padding=list(conv.padding), stride=list(conv.stride),
                     dilation=list(conv.dilation))
    feeds = {X: x, W: w}
    if epilogue is not None:
        B = g.tensor(name="B", dim=list(b.size()), stride=list(b.stride()), data_type=cudnn.data_type.FLOAT)
        M = g.tensor(name="M", dim=list(m.size()), stride=list(m.stride()), data_type=cudnn.data_type.FLOAT)
        feeds.update({B: b, M: m})
        y = epilogue(g, cudnn, g.bias(input=y, bias=B), M)
    n, k = x.shape[0], w.shape[0]
    oh, ow = [(s + 2 * p - d * (r - 1) - 1) // st + 1 for s, p, d, r, st in
              zip(x.shape[2:], conv.padding, conv.dilation, w.shape[2:], conv.stride, strict=True)]
    out = torch.empty(n, k, oh, ow, device="cuda")
    if out_layout == "nhwc":
        out = out.contiguous(memory_format=torch.channels_last)
    y.set_output(True).set_dim(list(out.size())).set_stride(list(out.stride())).set_data_type(cudnn.data_type.FLOAT)
    totals = g.genstats(input=y) if stats else ()
    for total in totals:
        total.set_output(True).set_dim([1, k, 1, 1]).set_stride([k, 1, k, k]).set_data_type(cudnn.data_type.FLOAT)
    start = time.perf_counter()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    built = time.perf_counter() - start
    workspace = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
    feeds[y] = out
    sums = None
    if stats:
        sums = tuple(torch.empty(1, k, 1, 1, device="cuda") for _ in range(2))
        feeds.update({total: t for total, t in zip(totals, sums, strict=True)})
    return (lambda: g.execute(feeds, workspace, handle=handle)), out, built, sums


def _kernels(run: Callable) -> str:
    """The kernels one call launches, by name (cut short)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.self_device_time_total > 0]
    return "; ".join(n[:70] for n in names)


def probe(path: str, cudnn) -> None:
    problem = load_problem(path)
    torch.manual_seed(0)
    model = problem.make_model().cuda()
    conv = next(mod for mod in model.modules() if isinstance(mod, torch.nn.Conv2d))
    (x,) = [t.cuda() for t in problem.get_inputs()][:1]
    w, k = conv.weight.detach(), conv.out_channels
    b = conv.bias.detach().reshape(1, k, 1, 1).contiguous()
    m = (torch.rand(1, k, 1, 1, device="cuda") + 0.5).contiguous()
    xl, wl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    name = path.rsplit("/", 1)[-1].removesuffix(".py")
    print(f"\n### {name}: x {tuple(x.shape)}, weight {tuple(w.shape)}\n")
    print("| epilogue | method | ms | build s | max abs err vs fp64 | eager's err |\n|---|---|---|---|---|---|")
    bare = median_event_ms(lambda: F.conv2d(xl, wl, None, conv.stride, conv.padding, conv.dilation))
    print(f"| bare | torch conv, channels-last in and out | {bare:.3f} | | | |")
    ref_conv = F.conv2d(x.double(), w.double(), conv.bias.double(), conv.stride, conv.padding, conv.dilation)
    for label, (epi, torch_epi) in EPILOGUES.items():
        if torch_epi is not None:
            ref = torch_epi(ref_conv, m.double())
            eager = lambda torch_epi=torch_epi: torch_epi(F.conv2d(x, w, conv.bias, conv.stride, conv.padding,  # noqa: E731
                                                                   conv.dilation), m)
            eager_err = (eager().double() - ref).abs().max().item()
            print(f"| {label} | eager, NCHW | {median_event_ms(eager):.3f} | | {eager_err:.2e} | |")
        else:
            ref, eager_err = ref_conv - conv.bias.double().reshape(1, k, 1, 1), None
        for layout, stats in (("nhwc", False), ("nchw", False), ("nhwc", True)):
            what = f"cuDNN graph, out {layout}{' + genstats' if stats else ''}"
            try:
                run, out, built, sums = graph_conv(cudnn, xl, wl, b, m, conv, epi, layout, stats)
                run()
                torch.cuda.synchronize()
                err = (out.double() - ref).abs().max().item()
                eager_col = f"{eager_err:.2e}" if eager_err is not None else ""
                if sums is not None:  # relative errors of the channel sums and sums of squares against float64
                    want = (ref.sum((0, 2, 3)), (ref * ref).sum((0, 2, 3)))
                    rel = [((got.double().flatten() - expect).abs() / expect.abs().clamp_min(1e-30)).max().item()
                           for got, expect in zip(sums, want, strict=True)]
                    eager_col += f" (stats rel. err {rel[0]:.1e}, {rel[1]:.1e})"
                print(f"| {label} | {what} ({_kernels(run)}) | {median_event_ms(run):.3f} | "
                      f"{built:.2f} | {err:.2e} | {eager_col} |")
            except Exception as e:  # noqa: BLE001 - a probe: an unsupported graph is a result
                print(f"| {label} | {what} | n/a | | {str(e).splitlines()[0][:160]} | |")
        sys.stdout.flush()


def main() -> int:
    torch.backends.cudnn.allow_tf32 = True
    import cudnn  # after torch: its libcudnn is the one loaded

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN backend {cudnn.backend_version()}, "
          f"frontend {getattr(cudnn, '__version__', '?')}")
    for path in sys.argv[1:]:
        probe(path, cudnn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
