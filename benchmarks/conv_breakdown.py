"""Stage-by-stage timing of the channels-last convolution plan (seed problem 3), per transpose tile size.

Run on the device from the repo root: PYTHONPATH=. python benchmarks/conv_breakdown.py
Prediction written before measuring: input transpose ~0.27 ms (1.07 GB at ~4 TB/s), cuDNN conv+bias+relu NHWC
0.84 ms (probe), epilogue transpose ~0.5 ms (2.08 GB) -> ~1.6 ms end to end.
"""

from __future__ import annotations

import torch

from kernelfuse.bench.timer import median_event_ms as median_ms
from kernelfuse.capture import capture
from kernelfuse.codegen import CodegenOptions, generate
from kernelfuse.emit.module import load_kernels
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite


def main() -> None:
    problem = load_problem("examples/conv2d_relu_biasadd.py")
    plan = plan_variants(rewrite(capture(problem)))[0]
    assert plan.variant == "fused-nhwc"
    torch.manual_seed(42)
    model = problem.make_model().cuda()
    x = problem.make_inputs(0)[0].cuda()
    w, b1, b2 = model.conv.weight, model.conv.bias, model.bias
    rows = []
    with torch.no_grad():
        ref = model(x)
        y = torch.cudnn_convolution_relu(x.contiguous(memory_format=torch.channels_last),
                                         w.contiguous(memory_format=torch.channels_last), b1, [1, 1], [0, 0], [1, 1], 1)
        rows.append(("clone of the 1.04 GB output (copy ceiling)", median_ms(lambda: y.clone())))
        rows.append(("x.contiguous(channels_last) (torch)",
                     median_ms(lambda: x.contiguous(memory_format=torch.channels_last))))
        rows.append(("w.contiguous(channels_last)", median_ms(lambda: w.contiguous(memory_format=torch.channels_last))))
        xcl = x.contiguous(memory_format=torch.channels_last)
        wcl = w.contiguous(memory_format=torch.channels_last)
        rows.append(("cudnn_convolution_relu NHWC", median_ms(
            lambda: torch.cudnn_convolution_relu(xcl, wcl, b1, [1, 1], [0, 0], [1, 1], 1))))
        for tile in (32, 64):
            ext = load_kernels(generate(plan, CodegenOptions(tile=tile)), f"breakdown_tile{tile}")
            assert torch.equal(ext.to_channels_last(x), xcl)
            out = ext.k0(y, b2)
            err = (out - ref).abs().max().item()
            rows.append((f"tile {tile}: to_channels_last (ours)", median_ms(lambda e=ext: e.to_channels_last(x))))
            rows.append((f"tile {tile}: epilogue transpose k0 (err {err:.1e})", median_ms(lambda e=ext: e.k0(y, b2))))

            def full(e=ext):
                x_cl = e.to_channels_last(x)
                acc = torch.cudnn_convolution_relu(x_cl, w.contiguous(memory_format=torch.channels_last),
                                                   b1, [1, 1], [0, 0], [1, 1], 1)
                return e.k0(acc, b2)

            rows.append((f"tile {tile}: whole forward", median_ms(full)))
        rows.append(("eager", median_ms(lambda: model(x))))
    print(f"\n{'stage':52s} {'median ms':>10s}")
    for name, ms in rows:
        print(f"{name:52s} {ms:10.3f}")


if __name__ == "__main__":
    main()
