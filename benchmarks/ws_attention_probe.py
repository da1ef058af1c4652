"""The warp-specialized wgmma attention (kernelfuse.codegen.attention_wgmma_ws) through the planner, per tiling
(CONFIGS), against the wgmma kernel it would replace (the same library, the form's run-time switch off), torch's
SDPA backends (cuDNN, flash) and float64: the measurements that set its gate (attention_wgmma_ws.WS_MIN_KEYS).

Run from the repo root on an H100/H200 (the configs' builds overlap in the parent; then each config runs in a child
process, so a hang or a trap costs only it; about 1-2 min of builds and under a minute a config, so a batch of four
or five should fit a 10-minute slot):
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --configs ws64    # the head-dim-64 configs below
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --configs ws128   # the head-dim-128 ones
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --configs ws-d64-3wg,ws-d128-pp  # any of them
    PYTHONPATH=. python benchmarks/wgmma_attention_probe.py --configs ws      # all (may not fit 10 minutes)
    PYTHONPATH=. python benchmarks/ws_attention_probe.py --configs ws --compile-only  # ptxas only, no GPU
Per config: one library holding every shape of its head dim (one attention step each; the gate on from one key),
each step checked (the form ran, by kf_attention_ws_launches; the wgmma kernel ran with the switch off; both within
3x SDPA's error against float64) and timed (CUDA events, L2 flushed, median of 20), then a summary table: per
shape the fastest SDPA backend's ms and each kernel's ratio to it. A row marked WRONG failed its check; a first
call not done within HANG_S seconds is reported as a HANG and ends that config's child at once (an mbarrier that
never completes); CHILD_TIMEOUT_S is the backstop.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelfuse.capture import capture_module
from kernelfuse.codegen import attention_wgmma_ws, generate
from kernelfuse.codegen.attention_wgmma_ws import WsConfig
from kernelfuse.emit.module import load_kernels
from kernelfuse.plan import make_plan

# (batch, heads, sequence, causal) per head dim: the long rows where the wgmma kernel is 0.70-0.76x of cuDNN, and
# GPT-2's two shapes (where it is already faster: the form must not lose there if the gate takes them)
SHAPES = {
    64: [(4, 16, 4096, False), (2, 16, 8192, False), (8, 16, 2048, True), (8, 12, 1024, True), (64, 12, 256, False)],
    128: [(4, 16, 4096, False), (8, 16, 2048, True), (8, 12, 1024, True)],
}
DEFAULT = attention_wgmma_ws.WS_CONFIG
# name: (head dim, tiling); "-pp": ping-pong between the consumer warpgroups
CONFIGS = {
    "ws-d64-3wg": (64, DEFAULT[64]),
    "ws-d64-3wg-pp": (64, replace(DEFAULT[64], pingpong=True)),
    "ws-d64-2wg": (64, WsConfig(consumers=2, keys=128, stages=3, producer_regs=24, consumer_regs=240)),
    "ws-d64-2wg-pp": (64, WsConfig(consumers=2, keys=128, stages=3, producer_regs=24, consumer_regs=240,
                                   pingpong=True)),
    "ws-d128-pp": (128, DEFAULT[128]),
    "ws-d128": (128, replace(DEFAULT[128], pingpong=False)),
    "ws-d128-176-pp": (128, replace(DEFAULT[128], keys=176)),
    "ws-d64-3wg-persist": (64, replace(DEFAULT[64], persistent=True)),
    "ws-d128-pp-persist": (128, replace(DEFAULT[128], persistent=True)),
}
CHILD_TIMEOUT_S = 420  # the build (~1-2 min), float64 references of 8192-key rows, the timings
HANG_S = 20  # a first call of one of our kernels not done by then is taken for a hang (the child ends at once)


class Attentions(torch.nn.Module):
    """SDPA on each (q, k, v) triple in turn, causal where `causal` says: one attention step each."""

    def __init__(self, causal: list[bool]) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.scaled_dot_product_attention(*xs[3 * i:3 * i + 3], is_causal=c)
                     for i, c in enumerate(self.causal))


def configured(name: str):  # noqa: ANN201 - the plan and its sources
    """Config `name` in force (its head dim's tiling, the gate on from one key): the plan of its head dim's shapes
    and the generated sources."""
    d, config = CONFIGS[name]
    attention_wgmma_ws.WS_CONFIG[d] = config
    attention_wgmma_ws.WS_MIN_KEYS[d] = 1
    shapes = SHAPES[d]
    meta = [torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta") for b, h, s, _ in shapes for _ in range(3)]
    plan = make_plan(capture_module(Attentions([c for *_, c in shapes]), meta))
    assert len(plan.attention) == len(shapes) and not plan.generated, plan.summary()
    return plan, generate(plan)


def finished(seconds: float) -> bool:
    """Whether the work queued on the current stream completes within `seconds` (polled)."""
    done = torch.cuda.Event()
    done.record()
    start = time.time()
    while not done.query():
        if time.time() - start > seconds:
            return False
        time.sleep(0.001)
    return True


def library_name(name: str) -> str:
    return f"kf_ws_probe_{name.replace('-', '_')}"


def _count(lib, name: str) -> int:  # noqa: ANN001 - the loaded library
    fn = getattr(lib._lib, name)
    fn.restype = ctypes.c_longlong
    return fn()


def run_config(name: str) -> None:
    """Build config `name`'s library (or load it: the parent built it), then check and time each shape: rows of
    the table."""
    d, config = CONFIGS[name]
    plan, sources = configured(name)
    t0 = time.time()
    lib = load_kernels(sources, library_name(name))
    print(f"<!-- {name}: {config}, built in {time.time() - t0:.0f} s -->", flush=True)
    for (b, h, s, causal), step in zip(SHAPES[d], plan.attention, strict=True):
        assert step.dims == (b, h, h, s, s, d) and step.causal == causal, (step.dims, step.causal)
        time_shape(lib, name, step.kernel, (b, h, s, d), causal)
    lib._lib.kf_attention_ws_enable(1)


def time_shape(lib, name: str, kernel: str, shape: tuple[int, int, int, int], causal: bool) -> None:  # noqa: ANN001
    """One shape's rows: cuDNN, flash, the wgmma kernel (the form's switch off), the form; each checked against
    float64 (and ours by the launch counters) and timed."""
    from wgmma_attention_probe import reference, tflops

    from kernelfuse.bench.timer import median_event_ms

    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    want = reference(q, k, v, causal)
    case = f"{b}, {h}, {s}, {causal}, {d}"

    def sdpa(backend):  # noqa: ANN001, ANN202
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return call

    def ours():  # noqa: ANN202
        return getattr(lib, kernel)(q, k, v)

    rows = [("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION)),
            ("kf wgmma", ours), (f"kf {name}", ours)]
    best = ref_err = None
    for method, call in rows:
        lib._lib.kf_attention_ws_enable(int(method != "kf wgmma"))  # the form's switch for this row
        try:
            before = _count(lib, "kf_attention_ws_launches"), _count(lib, "kf_attention_wgmma_launches")
            out = call()
            if not finished(HANG_S):  # an mbarrier that never completes: end the child now, not at its timeout
                print(f"| {case} | {method} | n/a | | | HANG: not done after {HANG_S} s |", flush=True)
                os._exit(3)
            ran = ""
            if method.startswith("kf"):
                ws_ran = _count(lib, "kf_attention_ws_launches") - before[0]
                hopper = _count(lib, "kf_attention_wgmma_launches") - before[1]
                if hopper != 1 or ws_ran != int(method != "kf wgmma"):
                    ran = f" (WRONG kernel: ws {ws_ran}, wgmma {hopper})"
            err = (out.double() - want).abs().max().item()
            ms = median_event_ms(call, 20)
        except RuntimeError as e:
            print(f"| {case} | {method} | n/a | | | {str(e).splitlines()[0][:80]} |", flush=True)
            continue
        if method.startswith("sdpa"):
            best = ms if best is None else min(best, ms)
            ref_err = err if ref_err is None else min(ref_err, err)
        flag = " WRONG" if ref_err is not None and err > 3 * ref_err + 1e-3 else ""
        ratio = f"{best / ms:.3f}" if best else "-"
        print(f"| {case} | {method} | {ms:.4f} | {tflops(b, h, s, d, causal, ms):.0f} | {ratio} | "
              f"{err:.2e}{flag}{ran} |", flush=True)


def compile_only(names: list[str]) -> None:
    """ptxas's registers and spills of each config's kernels (sm_90a; no GPU needed)."""
    import re
    import tempfile

    for name in names:
        _, sources = configured(name)
        with tempfile.TemporaryDirectory() as tmp:
            cu = f"{tmp}/ws.cu"
            with open(cu, "w") as f:
                f.write(sources.cuda)
            log = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-O3", "-Xptxas", "-v", "-c", cu, "-o",
                                  f"{tmp}/ws.o"], capture_output=True, text=True).stderr
        for entry in log.split("Compiling entry function")[1:]:
            head = entry.split("\n")[0]
            if "ws_kernel" not in head:
                continue
            kernel = re.search(r"kf_attention_ws_kernelILi(\d+)ELb(\d)", head)
            regs = re.search(r"Used (\d+) registers", entry)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry)
            flagged = sum("(C75" in line and kernel[0] in line for line in log.splitlines())
            print(f"{name}: d {kernel[1]} causal {kernel[2]}: {regs[1] if regs else '?'} registers at launch, "
                  f"spills {spills[1] if spills else '?'}/{spills[2] if spills else '?'} bytes, "
                  f"{flagged} C75xx (wgmma serialized or fenced by ptxas)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="ws",
                        help=f"'ws' (all), 'ws64', 'ws128' or a comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--compile-only", action="store_true", help="ptxas registers and spills, no GPU")
    parser.add_argument("--child", help="(internal) one config's run")
    args = parser.parse_args(argv)
    if args.child:
        run_config(args.child)
        return
    groups = {"ws": list(CONFIGS), **{f"ws{d}": [n for n, (dim, _) in CONFIGS.items() if dim == d] for d in SHAPES}}
    names = groups.get(args.configs) or args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    assert not unknown, f"unknown configs {unknown}; known: {list(CONFIGS)}"
    if args.compile_only:
        compile_only(names)
        return
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16. ratio = the fastest SDPA "
          "backend's ms / this ms (the goal: >= 0.9); TFLOP/s counts 4 B H S² D, halved for causal\n")
    print("| batch, heads, seq, causal, d | method | ms | TFLOP/s | ratio | max abs err vs fp64 |\n"
          "|---|---|---|---|---|---|", flush=True)
    t0 = time.time()
    sources = {name: configured(name)[1] for name in names}  # one at a time: configured sets module globals
    with ThreadPoolExecutor(len(names)) as pool:  # the builds overlap; the children load them from torch's cache
        list(pool.map(lambda name: load_kernels(sources[name], library_name(name)), names))
    print(f"<!-- builds: {time.time() - t0:.0f} s -->", flush=True)
    rows = []
    for name in names:
        try:
            child = subprocess.run([sys.executable, __file__, "--child", name], timeout=CHILD_TIMEOUT_S,
                                   capture_output=True, text=True)
            out = child.stdout
            if child.returncode != 0:
                out += f"<!-- {name}: exit {child.returncode}: {child.stderr.strip()[-600:]} -->\n"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"<!-- {name}: TIMEOUT after {CHILD_TIMEOUT_S} s (a hang?) -->\n"
        sys.stdout.write(out)
        sys.stdout.flush()
        rows += [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    summary(rows)


def summary(rows: list[list[str]]) -> None:
    """Per shape: the fastest SDPA backend's ms, then each of our kernels' ratio to it (the wgmma kernel's best
    over the configs' runs; WRONG where a check failed)."""
    cases: dict[str, dict[str, str]] = {}
    for case, method, ms, *rest in rows:
        entry = cases.setdefault(case, {})
        if ms == "n/a":  # failed to run (HANG, an error): shown as such unless another run of it timed
            if not method.startswith("sdpa"):
                entry.setdefault(method, "n/a")
            continue
        wrong = " WRONG" if "WRONG" in rest[-1] else ""
        if method.startswith("sdpa"):
            entry["sdpa"] = min(entry.get("sdpa", ms), ms, key=float)
        elif method not in entry or entry[method] == "n/a" or float(ms) < float(entry[method].split()[0]):
            entry[method] = ms + wrong
    methods = sorted({m for entry in cases.values() for m in entry if m != "sdpa"}, key=lambda m: m != "kf wgmma")
    print("\nSummary: ratio = the fastest SDPA backend's ms / ours (>= 0.9 the goal)\n")
    print("| batch, heads, seq, causal, d | best SDPA ms | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for case, entry in cases.items():
        if "sdpa" not in entry:
            continue
        cells = []
        for m in methods:
            value = entry.get(m)
            if value is None or value == "n/a":
                cells.append(value or "")
                continue
            ratio = float(entry["sdpa"]) / float(value.split()[0])
            cells.append(f"{ratio:.3f}" + (" WRONG" if "WRONG" in value else ""))
        print(f"| {case} | {entry['sdpa']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
