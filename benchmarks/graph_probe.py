"""How much of a model's forward is host launch overhead? Per problem: eager ms (events, L2 flushed), the sum of
its CUDA kernel times (profiler), and the same forward replayed from one CUDA graph (input copied into the graph's
static buffer, output cloned out of it: what a graphed ModelNew would pay per call).

Run on the device from the repo root:
    PYTHONPATH=. python benchmarks/graph_probe.py PROBLEM.py [...] > $OUT/graph_probe.md
Hypothesis written before measuring: the deep level-3 models (ResNet101, DenseNet201: hundreds of small launches)
and the small-batch ones are launch-bound, eager within 10% of the graph-replay time only where kernels dominate;
where kernel time is under half of eager's, a graphed plan should gain ≥ 1.5x over eager.
"""

from __future__ import annotations

import sys

import torch

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.load import load_problem


def _kernel_ms(fn) -> float:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000


def _graphed(model: torch.nn.Module, inputs: list[torch.Tensor]):  # noqa: ANN202
    static = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(*static)  # warm-up: cuBLAS/cuDNN handles and workspaces before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*static)

    def call() -> torch.Tensor:
        for s, t in zip(static, inputs, strict=True):
            if isinstance(t, torch.Tensor):
                s.copy_(t)
        graph.replay()
        return out.clone()
    return call


def _row(path: str) -> str:
    problem = load_problem(path)
    torch.manual_seed(0)
    model = problem.make_model().cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.make_inputs(0)]

    def call() -> torch.Tensor:
        return model(*inputs)
    with torch.no_grad():
        eager = median_event_ms(call)
        kernels = _kernel_ms(call)
        graphed = _graphed(model, inputs)
        graph = median_event_ms(graphed)
        diff = (graphed() - call()).abs().max().item()
    return (f"| {problem.name} | {eager:.3f} | {kernels:.3f} | {kernels / eager:.2f} | {graph:.3f} | "
            f"{eager / graph:.2f}x | {diff:.2g} |")


def main(paths: list[str]) -> None:
    print("| problem | eager ms | kernel ms | kernels / eager | graph ms | eager / graph | max diff |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        try:
            print(_row(path), flush=True)
        except Exception as err:  # noqa: BLE001 - one problem's failure is a row, not the end of the table
            print(f"| {path} | failed: {type(err).__name__}: {str(err)[:120]} |||||", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
