"""The bare anchors (kernelfuse.bench.anchors): a forward's convolutions and matrix products recorded with their
argument layouts and counted, then each distinct call timed alone on stand-ins of the same layout."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernelfuse.bench.anchors import TensorSpec, record_anchors, time_anchors
from kernelfuse.bench.timer import Timer


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()


def test_anchor_calls_are_recorded_with_their_layouts_and_counted():
    model, x = _model(), torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    with torch.no_grad():
        calls = record_anchors(lambda: (model(x), model(x), torch.relu(x)))
    assert sorted(c.op.__name__ for c in calls) == ["addmm.default", "convolution.default"]
    assert set(calls.values()) == {2}  # two forwards: each anchor twice; the relu is no anchor
    conv = next(c for c in calls if c.op.__name__ == "convolution.default")
    assert conv.args[0] == TensorSpec((2, 3, 8, 8), x.stride(), torch.float32)  # channels-last strides kept
    assert conv.describe() == "convolution [2, 3, 8, 8] x [8, 3, 3, 3] x [8]"


def test_each_distinct_call_is_timed_once_and_the_sum_counts_repeats():
    model, x = _model(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        calls = record_anchors(lambda: [model(x) for _ in range(3)])
        timed = time_anchors(calls, Timer(torch.device("cpu")), torch.device("cpu"))
    assert [row["count"] for row in timed["calls"]] == [3, 3]
    assert timed["ms"] == sum(row["count"] * row["ms"] for row in timed["calls"]) > 0


def test_a_broadcast_operand_keeps_its_zero_strides():
    bias = torch.randn(10).expand(4, 10)  # stride (0, 1): addmm's input, as Linear passes a bias
    a, b = torch.randn(4, 6), torch.randn(6, 10)
    calls = record_anchors(lambda: torch.addmm(bias, a, b))
    (call,) = calls
    assert call.args[0].stride == (0, 1)
    assert time_anchors(calls, Timer(torch.device("cpu")), torch.device("cpu"))["ms"] > 0
