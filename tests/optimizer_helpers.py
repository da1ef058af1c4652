"""Shared helpers for the optimizer-stage tests (load, capture, rewrite, plan, codegen, emit).

Problems are written as small files into pytest's tmp_path, so each test states the exact model it exercises.
The bundled examples are used at full size where only fake tensors are involved (capture, plan, codegen), and
as shrunken copies where real tensors are computed on the CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from kernelfuse.capture import Graph, capture
from kernelfuse.load import Problem, load_problem
from kernelfuse.plan import Plan, interpret, owned_anchor_variants, plan_variants
from kernelfuse.rewrite import rewrite

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
EXAMPLE_NAMES = ("gemm_add_relu", "gemm_sigmoid_scaling_residualadd", "conv2d_relu_biasadd")

# Constants of the bundled examples, cut down so real tensors on the CPU cost milliseconds.
SMALL = {
    "batch_size": 4,
    "in_features": 32,
    "out_features": 48,
    "input_size": 32,
    "hidden_size": 48,
    "in_channels": 3,
    "out_channels": 8,
    "height = width": 10,
}


def problem_text(model_body: str, inputs: str, init: str = "[]", header: str = "") -> str:
    """A problem file: `model_body` is the body of `class Model(nn.Module)` (methods, 4-space indented)."""
    return (
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
        + textwrap.dedent(header)
        + "\n\nclass Model(nn.Module):\n"
        + textwrap.indent(textwrap.dedent(model_body).strip("\n"), "    ")
        + f"\n\n\ndef get_inputs():\n    return {inputs}\n\n\ndef get_init_inputs():\n    return {init}\n"
    )


def write_problem(tmp_path: Path, name: str, model_body: str, inputs: str, init: str = "[]", header: str = "") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(problem_text(model_body, inputs, init, header))
    return path


def shrunk_example(name: str, tmp_path: Path) -> Path:
    """A copy of a bundled example with its size constants replaced by SMALL values."""
    text = (EXAMPLES / f"{name}.py").read_text()
    for key, value in SMALL.items():
        text = re.sub(rf"^{re.escape(key)} = \d+$", f"{key} = {value}", text, flags=re.M)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def pipeline(path: str | Path) -> tuple[Problem, Graph, list[Plan]]:
    problem = load_problem(path)
    graph = rewrite(capture(problem))
    return problem, graph, plan_variants(graph)


def run_both(problem: Problem, plan: Plan, seed: int = 0, inputs: list | None = None):
    """(model outputs, interpreter outputs) on the problem's own inputs and weights, on the CPU."""
    model = problem.make_model()
    if inputs is None:
        inputs = problem.make_inputs(seed)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        expected = model(*inputs)
        got = interpret(plan, state, inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    return expected, got


def assert_interpreter_matches(problem: Problem, plan: Plan, atol: float = 0.0, rtol: float = 0.0,
                               inputs: list | None = None) -> None:
    expected, got = run_both(problem, plan, inputs=inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, equal_nan=True)


def run_kernelfuse(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m kernelfuse ARGS` in a child process, from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kernelfuse", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def fused_names(plan: Plan) -> set[str]:
    return {name for step in plan.fused for name in step.replaces}


class AsCuda:
    """A tensor or module seen as if it lived on a CUDA device (for an emitted guard run without a GPU); everything
    else is the real object's."""

    is_cuda = True

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def _parameters(self):  # the guard walks the module tree through these two
        return {k: AsCuda(p) for k, p in self._inner._parameters.items() if p is not None}

    @property
    def _modules(self):
        return {k: AsCuda(m) for k, m in self._inner._modules.items() if m is not None}


def owned_tf32_plan(graph: Graph) -> Plan:
    """The owned-anchor plan with every convolution measured TF32 (as eager's cuDNN call on a GPU)."""
    convs = frozenset(n.name for n in graph.nodes if n.op == "convolution.default")
    (plan,) = owned_anchor_variants(graph, measured=convs)
    return plan
