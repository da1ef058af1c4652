"""Host cost of an emitted file's forward, A/B in one process: microseconds per call when calls are issued back to
back (the host's time per forward, or the GPU's where that is longer) and the GPU time per call by CUDA events.

    PYTHONPATH=. python benchmarks/call_overhead.py OUT.md LABEL=FILE.py [LABEL=FILE.py ...]

Each file is loaded as a module, its ModelNew built with the problem's init inputs on the GPU and called on the
problem's inputs under torch.no_grad(). The files are measured in alternating rounds, so a drift of the machine
falls on all of them alike; the table gives each one's median over the rounds.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROUNDS, CALLS = 7, 300


def load(path: Path) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    spec = importlib.util.spec_from_file_location(f"m_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = module.ModelNew(*module.get_init_inputs()).cuda()
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in module.get_inputs()]
    return model, inputs


def one_round(model: torch.nn.Module, inputs: list) -> tuple[float, float]:
    """(host µs per call issued back to back, GPU µs per call by events)."""
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    start_event.record()
    for _ in range(CALLS):
        model(*inputs)
    end_event.record()
    torch.cuda.synchronize()
    host = (time.perf_counter() - start) / CALLS * 1e6
    return host, start_event.elapsed_time(end_event) / CALLS * 1e3


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    runs = {label: load(Path(path)) for label, path in (a.split("=", 1) for a in argv[1:])}
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    with torch.no_grad():
        for model, inputs in runs.values():
            for _ in range(20):
                model(*inputs)
        for _ in range(ROUNDS):
            for label, (model, inputs) in runs.items():
                samples[label].append(one_round(model, inputs))
    lines = [f"{torch.cuda.get_device_name()} · {ROUNDS} rounds of {CALLS} calls",
             "| file | host µs per call | GPU µs per call (events) |", "|---|---|---|"]
    for label, values in samples.items():
        host = statistics.median(v[0] for v in values)
        gpu = statistics.median(v[1] for v in values)
        lines.append(f"| {label} | {host:.1f} | {gpu:.1f} |")
    print("\n".join(lines))
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
