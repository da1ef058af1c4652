"""Times the generated kernels of a few problems against eager and torch.compile, in one process, on one GPU.

    PYTHONPATH=. python benchmarks/level1_probe.py PROBLEM.py [PROBLEM.py ...] [--out TABLE.md]
        [--onchip 512:48,256:24,...]

For each problem every fused plan variant is emitted as a ModelNew file, built and timed whether or not the
optimizer would ship it (the probe asks how fast the kernels are, not what ships); its largest error against eager
on the same inputs is printed beside it. Times are medians of CUDA events with the L2 flushed before each call
(kernelfuse.bench.timer); the floor is the bytes a forward must move (inputs, state, outputs) over the measured
device-to-device copy bandwidth (kernelfuse.bench.floor).

--onchip times each plan once per configuration of the long-row kernel (kernelfuse.codegen.onchip): THREADS:KB
is its block size and the row chunk each block keeps in shared memory. (Stop 31 also compared 4-byte against
16-byte copies and one-pass against two-pass statistics, with switches since removed: benchmarks/NOTES.md.)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kernelfuse.bench.floor import measure_ceilings, min_bytes
from kernelfuse.bench.timer import Timer, median_event_ms
from kernelfuse.capture import capture
from kernelfuse.codegen import onchip, reduce
from kernelfuse.load import load_problem
from kernelfuse.pipeline import emit_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite
from kernelfuse.verify.compare import flatten_outputs

REPS = 20


def _outputs(value: object) -> list[torch.Tensor]:
    return [t for t in flatten_outputs(value) if isinstance(t, torch.Tensor)]


def _max_error(expected: object, got: object) -> float:
    pairs = zip(_outputs(expected), _outputs(got), strict=True)
    return max(((e.double() - g.double()).abs().max().item() for e, g in pairs), default=0.0)


def _load_modelnew(text: str, folder: Path, name: str) -> type:
    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.ModelNew


@contextmanager
def onchip_config(config: str | None) -> Iterator[None]:
    """The long-row kernel built as `config` says (THREADS:KB) while the block runs; None: as shipped."""
    if config is None:
        yield
        return
    saved = onchip.ONCHIP_THREADS, onchip.CHUNK_BYTES, onchip.ONCHIP_MAX_ROW
    threads, kb = config.split(":")
    onchip.ONCHIP_THREADS = reduce.ONCHIP_THREADS = int(threads)
    onchip.CHUNK_BYTES = int(kb) * 1024
    onchip.ONCHIP_MAX_ROW = onchip.ONCHIP_MAX_BLOCKS * onchip.CHUNK_BYTES // 4
    try:
        yield
    finally:
        onchip.ONCHIP_THREADS, onchip.CHUNK_BYTES, onchip.ONCHIP_MAX_ROW = saved
        reduce.ONCHIP_THREADS = saved[0]


def probe(path: Path, bandwidth: float, folder: Path, configs: list[str | None]) -> list[str]:
    """Table rows for one problem: eager, torch.compile and each plan variant (under each on-chip config)."""
    problem = load_problem(path)
    built = []
    for config in configs:
        with onchip_config(config):
            for plan in plan_variants(rewrite(capture(problem))):
                if plan.generated or plan.fused:
                    built.append((plan, config, emit_file(problem, plan, "")))
    model = problem.make_model().cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.make_inputs(0)]
    with torch.no_grad():
        expected = model(*inputs)
        floor = min_bytes(model, inputs, expected) / bandwidth * 1e3
        eager = median_event_ms(lambda: model(*inputs), REPS)
        compiled = torch.compile(model)
        compiled(*inputs)
        compile_ms = median_event_ms(lambda: compiled(*inputs), REPS)
        rows = [f"| {problem.name} | eager | {eager:.3f} | 1.000x | {eager / compile_ms:.3f}x | 0 | {floor:.3f} | "
                f"{eager / floor:.2f} |",
                f"| {problem.name} | torch.compile | {compile_ms:.3f} | {eager / compile_ms:.3f}x | 1.000x | "
                f"{_max_error(expected, compiled(*inputs)):.1e} | {floor:.3f} | {compile_ms / floor:.2f} |"]
        for i, (plan, config, text) in enumerate(built):
            label = f"ours ({plan.variant}: {', '.join(g.family for g in plan.generated) or 'anchors'})"
            label += f" [on-chip {config}]" if config else ""
            cls = _load_modelnew(text, folder, f"probe_{problem.name}_{i}")
            ours = cls(*problem.init_inputs()).cuda()
            ours.load_state_dict(model.state_dict())  # the same weights and running statistics as eager's now
            error = _max_error(model(*inputs), ours(*inputs))
            ms = median_event_ms(lambda m=ours: m(*inputs), REPS)
            rows.append(f"| {problem.name} | {label} | {ms:.3f} | {eager / ms:.3f}x | {compile_ms / ms:.3f}x | "
                        f"{error:.1e} | {floor:.3f} | {ms / floor:.2f} |")
        if not built:
            rows.append(f"| {problem.name} | ours | - | - | - | - | {floor:.3f} | - |")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("problems", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    parser.add_argument("--onchip", default=None,
                        help="long-row kernel configurations THREADS:KB, comma-separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("level1_probe: no CUDA device; run it on the GPU host", file=sys.stderr)
        return 2
    ceilings = measure_ceilings(Timer(torch.device("cuda")), "fp32")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth "
             f"{ceilings.bytes_per_s / 1e12:.2f} TB/s, median of {REPS} (L2 flushed)", "",
             "| problem | version | ms | vs eager | vs compile | max abs err vs eager | floor ms | / floor |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.problems:
            try:
                rows = probe(path, ceilings.bytes_per_s, Path(tmp), args.onchip.split(",") if args.onchip else [None])
            except Exception as err:  # noqa: BLE001 - one problem's failure is a row, the others still run
                rows = [f"| {path.stem} | failed | {type(err).__name__}: {str(err)[:200]} | | | | | |"]
            print("\n".join(rows), flush=True)
            lines += rows
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
