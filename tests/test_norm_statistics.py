"""A group norm whose output a reduction over other dims reads (level-2 92's form): its statistics in a kernel of
their own, its normalisation inside the reduction's prologue (kernelfuse.rewrite.norms, the `moments` kind)."""

from __future__ import annotations

import runpy

import pytest
import torch
from emulation_helpers import emulated_against_interpreter
from optimizer_helpers import assert_interpreter_matches, pipeline, write_problem
from rewrite_helpers import prove
from torch import nn

from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew

RULE = "norm_statistics_apart"

MODEL = """
def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(3, 8, 3, padding=1)
    self.norm = nn.GroupNorm(2, 8)

def forward(self, x):
{body}
"""


def _plans(tmp_path, body: str):
    return pipeline(write_problem(tmp_path, "gn", MODEL.format(body=body), "[torch.randn(2, 3, 6, 6)]"))


@pytest.mark.parametrize("reduce", ["torch.logsumexp(z, dim=1)", "z.amin(dim=1, keepdim=True)", "z.mean()"])
def test_the_normalisation_moves_into_the_reduction(tmp_path, reduce):
    """conv -> GroupNorm -> tanh -> + conv -> a reduction: one statistics kernel reading the raw conv output, the
    normalisation inside the reduction's kernel, no normalised tensor stored; the CPU check, and every generated
    kernel emulated on the CPU against the interpreter."""
    problem, graph, plans = _plans(tmp_path, f"""
    y = self.conv(x)
    z = torch.tanh(self.norm(y)) + y
    return {reduce}
    """)
    for plan in plans:
        moments = [s for s in plan.generated if s.family == "moments"]
        assert len(moments) == 1 and not any(s.family == "norm" for s in plan.generated), plan.summary()
        reduction = next(s for s in plan.generated if s.reduce_node is not None and s.family != "moments")
        ops = [st.op for st in reduction.prologue.statements]
        assert "tanh" in ops and ops.count("mul") >= 1, ops  # x * a + b, then the chain, in the reduction
        if plan.variant != "fused-igemm":  # the conv's bias is recomputed in both kernels, never stored
            anchor = plan.fused[0]
            assert not anchor.needs_kernel and moments[0].source.ref.name == reduction.source.ref.name == anchor.out
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)
    assert emulated_against_interpreter(plans[0], tmp_path, ulps=4) >= 3


@pytest.mark.parametrize("body, fires", [
    ("return torch.logsumexp(torch.tanh(m.norm(x)) + x, dim=1)", True),
    ("return m.norm(x).sum(dim=(2, 3))", True),
    ("return torch.tanh(m.norm(x))", False),  # nothing reduces it: the norm kernel stays
    ("y = m.norm(x)\n    return y, y.sum(dim=1)", False),  # the normalised tensor is returned too
    ("return torch.softmax(m.norm(x), dim=1)", False),  # a broadcasting reader writes the whole tensor anyway
])
def test_the_rule_is_exact_in_float64(body, fires):
    """The rewritten graph equals the original (and eager) in float64, where it fires; it fires only where a plain
    reduction reads the norm's output through pointwise ops."""
    norm = nn.GroupNorm(3, 6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
        norm.bias.copy_(torch.randn(6))
    scope: dict = {"torch": torch}
    exec(f"def fn(m, x):\n    {body}\n", scope)

    def forward(m, x):
        m.norm = norm
        return scope["fn"](m, x)

    prove(forward, torch.randn(2, 6, 5, 4) * 3 + 1, rule=RULE, fires=fires)


def test_a_norm_without_weight_and_bias_is_left_alone(tmp_path):
    """A norm without weight and bias keeps its norm kernel (the rule takes the affine form only)."""
    _, graph, _ = _plans(tmp_path, """
    y = self.conv(x)
    return torch.nn.functional.group_norm(y, 2).sum(dim=1)
    """)
    assert not any(n.op == "stack.default" for n in graph.nodes)


RESIDUAL = """
def __init__(self):
    super().__init__()
    self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
    self.b1 = nn.BatchNorm2d(8)
    self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    self.b2 = nn.BatchNorm2d(8)
    self.down = nn.Conv2d(3, 8, 1, bias=False)
    self.bd = nn.BatchNorm2d(8)

def forward(self, x):
    y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
    y += self.bd(self.down(x))
    return torch.relu(y)
"""


def test_a_residual_of_two_batch_norms_is_one_pass(tmp_path):
    """A ResNet block in training mode (level-3 8's form): bn2's and the downsample norm's outputs meet in the
    residual add. Both become statistics kernels (split across blocks: 512 elements a channel) and one pointwise
    kernel normalises both branches and adds them; bn1, read by a convolution, keeps its norm kernel. The running
    statistics are updated as ATen does (emulated kernels against the interpreter)."""
    problem, graph, plans = pipeline(write_problem(tmp_path, "res", RESIDUAL, "[torch.randn(2, 3, 16, 16)]"))
    for plan in plans:
        families = sorted(s.family for s in plan.generated if s.spec is not None)
        assert families == ["moments", "moments", "norm"], plan.summary()
        last = plan.generated[-1]
        assert last.family == "pointwise" and "add -> add -> relu" in last.chain(plan.graph), plan.summary()
        assert_interpreter_matches(problem, plan, atol=1e-5, rtol=1e-5)
    nchw = {p.variant: p for p in plans}["fused-nchw"]
    assert emulated_against_interpreter(nchw, tmp_path, ulps=4) == len(nchw.generated)


def test_the_batch_norm_form_is_exact_in_float64():
    """The residual of two training batch norms, rewritten, equals the original in float64; one norm alone (its
    output read by a convolution-free chain to the output) is left alone."""
    bn1, bn2 = nn.BatchNorm2d(6).double(), nn.BatchNorm2d(6).double()
    with torch.no_grad():
        for bn in (bn1, bn2):
            bn.weight.copy_(torch.randn(6))
            bn.bias.copy_(torch.randn(6))

    def residual(m, x):
        m.bn1, m.bn2 = bn1, bn2
        return torch.relu(bn1(x) + bn2(x * 2 + 1))

    def alone(m, x):
        m.bn1 = bn1
        return torch.relu(bn1(x)) * 2

    x = torch.randn(4, 6, 5, 3) * 3 + 1
    prove(residual, x, rule=RULE)
    prove(alone, x, rule=RULE, fires=False)


@pytest.mark.gpu
@pytest.mark.parametrize("body, shape", [
    (MODEL.format(body="""
    y = self.conv(x)
    return torch.logsumexp(torch.tanh(self.norm(y)) + y, dim=1)
    """), (4, 3, 40, 40)),
    (RESIDUAL, (4, 3, 48, 48)),  # 9216 elements a channel: split statistics
])
def test_gpu_the_split_norms_match_eager(tmp_path, monkeypatch, body, shape):
    """The NCHW plan emitted and run on the GPU against eager (training mode: the batch norms' running
    statistics too), TF32 off (the implicit-GEMM variants compute at fp32 accuracy, eager's cuDNN call in TF32
    would not)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    problem, _, plans = pipeline(write_problem(tmp_path, "gpu", body, f"[torch.randn{shape}]"))
    for plan in (p for p in plans if p.variant == "fused-nchw"):
        path = tmp_path / f"{plan.variant}.py"
        path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
        ns = runpy.run_path(str(path))
        torch.manual_seed(0)
        ref = runpy.run_path(str(problem.path))["Model"]().cuda()
        torch.manual_seed(0)
        new = ns["ModelNew"]().cuda()
        x = torch.randn(shape, device="cuda")
        with torch.no_grad():
            expected, got = ref(x), new(x)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=plan.variant)
        for name, buffer in ref.named_buffers():
            torch.testing.assert_close(new.get_buffer(name).float(), buffer.float(), atol=1e-5, rtol=1e-5,
                                       msg=f"{plan.variant} {name}")
