"""Probe: time the library-call variants the planner chooses between, on the GPU at hand.

Run on the device from the repo root: PYTHONPATH=. python benchmarks/probe_layouts.py. Prints one table;
timings are medians of CUDA-event measurements with an L2 flush before each trial (kernelfuse.bench's timer).
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.nn.functional as F

from kernelfuse.bench.timer import median_event_ms as median_ms


def main() -> None:
    print("torch", torch.__version__, "gpu", torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    from torch.utils.cpp_extension import load_inline

    print("load_inline no_implicit_headers:", "no_implicit_headers" in inspect.signature(load_inline).parameters)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        x = torch.rand(128, 64, 128, 128, device="cuda")
        conv = torch.nn.Conv2d(64, 128, 3).cuda()
        b2 = torch.randn(128, 1, 1, device="cuda")
        w, b1 = conv.weight, conv.bias

        def eager():
            return torch.relu(conv(x)) + b2

        rows.append(("conv eager NCHW", median_ms(eager)))
        rows.append(("conv alone NCHW", median_ms(lambda: F.conv2d(x, w, b1))))
        one = (1, 1)
        rows.append(("cudnn_conv_relu NCHW",
                     median_ms(lambda: torch.cudnn_convolution_relu(x, w, b1, one, (0, 0), one, 1))))
        xcl = x.contiguous(memory_format=torch.channels_last)
        wcl = w.contiguous(memory_format=torch.channels_last)
        rows.append(("x->channels_last", median_ms(lambda: x.contiguous(memory_format=torch.channels_last))))
        rows.append(("conv alone NHWC (x,w cl)", median_ms(lambda: F.conv2d(xcl, wcl, b1))))
        rows.append(("cudnn_conv_relu NHWC (x,w cl)",
                     median_ms(lambda: torch.cudnn_convolution_relu(xcl, wcl, b1, one, (0, 0), one, 1))))
        y = torch.cudnn_convolution_relu(xcl, wcl, b1, (1, 1), (0, 0), (1, 1), 1)
        print("NHWC out strides", y.stride(), "is cl", y.is_contiguous(memory_format=torch.channels_last))
        rows.append(("NHWC->NCHW .contiguous()", median_ms(lambda: y.contiguous())))
        rows.append(("NHWC add_ in place", median_ms(lambda: y.add_(0.0))))
        ref = eager()
        ref64 = torch.relu(F.conv2d(x.double(), w.double(), b1.double())) + b2.double()
        got = torch.cudnn_convolution_relu(xcl, wcl, b1, (1, 1), (0, 0), (1, 1), 1) + b2
        print("err eager vs f64", (ref.double() - ref64).abs().max().item(),
              "NHWC vs f64", (got.double() - ref64).abs().max().item(), "NHWC vs eager", (got - ref).abs().max().item())
        t0 = time.perf_counter()
        compiled = torch.compile(eager)
        compiled()
        torch.cuda.synchronize()
        print("compile s", round(time.perf_counter() - t0, 1))
        rows.append(("conv torch.compile", median_ms(compiled)))
        print("compile out strides", compiled().stride())
        torch._dynamo.reset()

        a = torch.rand(1024, 8192, device="cuda")
        lin = torch.nn.Linear(8192, 8192, bias=False).cuda()
        bias = torch.randn(8192, device="cuda")
        rows.append(("gemm eager (mm+add+relu)", median_ms(lambda: torch.relu(lin(a) + bias))))
        rows.append(("mm alone", median_ms(lambda: torch.mm(a, lin.weight.t()))))
        out = torch.mm(a, lin.weight.t())
        rows.append(("add_ in place 1024x8192", median_ms(lambda: out.add_(bias))))
        compiled = torch.compile(lambda: torch.relu(lin(a) + bias))
        compiled()
        rows.append(("gemm torch.compile", median_ms(compiled)))
    print()
    print(f"{'variant':34s} {'median ms':>10s}")
    for name, ms in rows:
        print(f"{name:34s} {ms:10.3f}")


if __name__ == "__main__":
    main()
