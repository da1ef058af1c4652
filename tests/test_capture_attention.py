"""Attention is captured whole (`aten.scaled_dot_product_attention`): traced on the CPU it would become
`_scaled_dot_product_flash_attention_for_cpu`, which has no CUDA kernel, and every plan of a transformer failed on
the GPU (level-3 ViT). Whole, the op dispatches to the device's own attention kernels, like eager's call."""

from __future__ import annotations

from pathlib import Path

import pytest
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem

MODELS = {
    "multihead": ("""
def __init__(self):
    super().__init__()
    self.attn = nn.MultiheadAttention(16, 4)
    self.fc = nn.Linear(16, 16)

def forward(self, x):
    return torch.relu(self.fc(self.attn(x, x, x, need_weights=False)[0]))
""", "[torch.rand(6, 2, 16)]"),
    "direct_call": ("""
def __init__(self):
    super().__init__()
    self.qkv = nn.Linear(16, 48)

def forward(self, x):
    q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0
""", "[torch.rand(2, 6, 16)]"),
    # attention reached through a registry of functions outside the class (transformers' ALL_ATTENTION_FUNCTIONS):
    # no class source names it, the first trace finds its CPU kernel and capture traces again with it whole
    "registry": ("""
def __init__(self):
    super().__init__()
    self.qkv = nn.Linear(16, 48)

def forward(self, x):
    q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4)
    return ATTENTION_FUNCTIONS["sdpa"](q, k, v) * 2.0
""", "[torch.rand(2, 6, 16)]", """
def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTION_FUNCTIONS = {"sdpa": _sdpa}
"""),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_is_one_device_neutral_node(tmp_path: Path, name: str) -> None:
    body, inputs, *header = MODELS[name]
    problem, graph, plans = pipeline(write_problem(tmp_path, name, body, inputs, header="".join(header)))
    ops = [n.op for n in graph.nodes]
    assert "scaled_dot_product_attention.default" in ops
    assert not any("for_cpu" in op or "_flash_attention" in op for op in ops), ops
    for plan in plans:  # the plan (attention a torch call, the rest fused) computes what the model does
        assert_interpreter_matches(problem, plan, atol=1e-6, rtol=1e-5)
