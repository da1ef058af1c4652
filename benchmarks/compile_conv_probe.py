"""Why does torch.compile beat us on convolution problems? Per problem: eager, torch.compile and the problem's first
convolution alone (NCHW / channels-last, cuDNN TF32 on / off), each output's error against a float64 reference,
and the CUDA kernels torch.compile's forward launches (their names say the cuDNN algorithm and whether it is TF32).

Run on the device from the repo root:
    PYTHONPATH=. python benchmarks/compile_conv_probe.py PROBLEM.py [...] > $OUT/compile_conv_probe.md
Hypothesis written before measuring: torch.compile runs the convolution channels-last with cuDNN's TF32 allowed
(PyTorch's default), where eager's NCHW call computes in full fp32 and our plan keeps fp32 (the strict policy's fp32
rule); then compile's error against float64 is >10x eager's and its conv alone is as fast as its whole forward.
"""

from __future__ import annotations

import sys

import torch

from kernelfuse.bench.timer import median_event_ms
from kernelfuse.emit.flags import _without_tf32
from kernelfuse.load import load_problem
from kernelfuse.verify import to_float64

CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
         torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def _err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    return (out.double() - ref64).abs().max().item()


def _kernels(fn, top: int = 6) -> list[str]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [f"{e.key[:90]} {e.device_time_total / 1000:.3f} ms" for e in events[:top]]


def _bias_and_benchmark(conv: torch.nn.Module, xcl: torch.Tensor, cl: torch.memory_format) -> None:
    """The channels-last call with TF32 on, with its bias and without (Inductor adds the bias in its own epilogue),
    cuDNN's benchmark mode off and on: ms and the kernels each launches."""
    wcl = conv.weight.contiguous(memory_format=cl)
    fn = {(False, 1): torch.nn.functional.conv1d, (False, 2): torch.nn.functional.conv2d,
          (False, 3): torch.nn.functional.conv3d, (True, 1): torch.nn.functional.conv_transpose1d,
          (True, 2): torch.nn.functional.conv_transpose2d, (True, 3): torch.nn.functional.conv_transpose3d
          }[(conv.transposed, conv.weight.dim() - 2)]
    extra = {"output_padding": conv.output_padding} if conv.transposed else {}
    print("\n| channels-last call, TF32 on | ms | kernels |\n|---|---|---|")
    for bench in (False, True):
        for bias in (conv.bias, None):
            torch.backends.cudnn.benchmark = bench

            def call(bias: torch.Tensor | None = bias) -> torch.Tensor:
                return fn(xcl, wcl, bias, conv.stride, conv.padding, groups=conv.groups, dilation=conv.dilation,
                          **extra)
            with torch.no_grad():
                ms = median_event_ms(call)
                names = "; ".join(k[:70] for k in _kernels(call, 3))
            print(f"| bias {'yes' if bias is not None else 'no'}, cudnn.benchmark {bench} | {ms:.3f} | {names} |")
    torch.backends.cudnn.benchmark = False


def probe(path: str) -> None:
    problem = load_problem(path)
    model = problem.make_model().cuda()
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.make_inputs(0)]
    model64 = problem.make_model().cuda().double()
    with torch.no_grad():
        ref64 = model64(*to_float64(x))
        eager = model(*x)
        compiled = torch.compile(model)
        comp = compiled(*x)
        rows = [("eager forward", median_event_ms(lambda: model(*x)), _err(eager, ref64)),
                ("torch.compile forward", median_event_ms(lambda: compiled(*x)), _err(comp, ref64))]
        conv = next(m for m in model.modules() if isinstance(m, CONVS))
        conv64 = next(m for m in model64.modules() if isinstance(m, CONVS))
        c64 = conv64(to_float64(x)[0])
        cl = torch.channels_last if conv.weight.dim() == 4 else torch.channels_last_3d
        xcl = x[0].contiguous(memory_format=cl)
        convcl = type(conv)(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                            **({"output_padding": conv.output_padding} if hasattr(conv, "output_padding") and
                               conv.transposed else {}), groups=conv.groups, bias=conv.bias is not None).cuda()
        convcl.load_state_dict(conv.state_dict())
        convcl = convcl.to(memory_format=cl)
        for tf32 in (False, True):
            for label, mod, inp in (("NCHW", conv, x[0]), ("channels-last", convcl, xcl)):
                def call(mod: torch.nn.Module = mod, inp: torch.Tensor = inp, tf32: bool = tf32) -> torch.Tensor:
                    return mod(inp) if tf32 else _without_tf32(lambda: mod(inp))  # TF32 on: PyTorch's default
                rows.append((f"conv alone {label}, TF32 {'on' if tf32 else 'off'}", median_event_ms(call),
                             _err(call(), c64)))
    print(f"\n## {problem.name}\n\nTF32 defaults: cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
          f"matmul precision={torch.get_float32_matmul_precision()}\n")
    print("| what | ms | max abs err vs float64 |\n|---|---|---|")
    for label, ms, err in rows:
        print(f"| {label} | {ms:.3f} | {err:.2e} |")
    _bias_and_benchmark(conv, xcl, cl)
    print("\ntorch.compile's kernels (CUDA time, one forward):\n")
    with torch.no_grad():
        for line in _kernels(lambda: compiled(*x)):
            print(f"- `{line}`")
        print("\neager's kernels:\n")
        for line in _kernels(lambda: model(*x)):
            print(f"- `{line}`")
    sys.stdout.flush()


if __name__ == "__main__":
    print(f"# torch.compile vs convolutions: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for arg in sys.argv[1:]:
        probe(arg)
