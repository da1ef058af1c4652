"""The rewrite stage as a whole: the rules' order, switches and record (each rule switched off by name, all of them
off, an unknown name a usage error, every rule documented once), the float32 graph it leaves, a graph rewritten
after its reader index was built, and the rules through the optimize pipeline and the command line."""

from __future__ import annotations

import pytest
import torch
from rewrite_helpers import Fn, run_graph, signed

from kernelfuse.capture import capture_module
from kernelfuse.rewrite import RULE_NAMES, apply_rules
from kernelfuse.rewrite.rules import UnknownRewriteError

# ---- the stage: order, switches, record -------------------------------------------------------------------------

def _gemm_sum(m, x):
    return torch.logsumexp((m.lin(x) * 0.5).sum(1, keepdim=True), 1, keepdim=True)


def test_rules_switch_off_one_by_one_and_all():
    torch.manual_seed(0)
    model = Fn(_gemm_sum).double()
    x = [signed(5, 8).double()]
    graph = capture_module(model, x)
    full = apply_rules(graph)
    assert {"size1_reductions", "reduce_before_affine", "reduce_linear_output"} <= set(full.rules_fired)
    partial = apply_rules(graph, disabled={"reduce_linear_output"})
    assert "reduce_linear_output" not in partial.rules_fired and "size1_reductions" in partial.rules_fired
    assert any(n.op == "addmm.default" and n.meta.shape == (5, 6) for n in partial.graph.nodes)
    assert apply_rules(graph, disabled=RULE_NAMES).graph == graph
    assert "reduce_linear_output" in full.summary() and "none fired" in apply_rules(graph, RULE_NAMES).summary()


def test_unknown_rule_is_a_one_line_usage_error():
    with pytest.raises(UnknownRewriteError, match="unknown rewrite rule no_such_rule: the rules are") as err:
        apply_rules(capture_module(Fn(_gemm_sum), [torch.rand(2, 8)]), disabled={"no_such_rule"})
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_every_rule_is_documented_and_listed_once():
    from kernelfuse.rewrite import RULES

    assert len(set(RULE_NAMES)) == len(RULE_NAMES) == len(RULES)
    assert all(r.doc for r in RULES)


def test_float32_graph_keeps_dtypes_and_runs(tmp_path):
    """In float32 the rewritten Gemm-Sum graph runs and stays as accurate as eager against float64."""
    torch.manual_seed(0)
    model = Fn(_gemm_sum)
    x = [torch.randn(64, 8)]
    result = apply_rules(capture_module(model, x))
    with torch.no_grad():
        got = run_graph(result.graph, model, x)[0]
        eager = model(*x)
        ref = Fn(_gemm_sum).double()
        ref.load_state_dict(model.state_dict())
        exact = ref(x[0].double())
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 2 * (eager.double() - exact).abs().max() + 1e-6


# ---- the optimize pipeline and the command line -----------------------------------------------------------------

GEMM_SUM = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 32)

def forward(self, x):
    return torch.logsumexp((self.lin(x) / 2.0).sum(1, keepdim=True), 1, keepdim=True)
"""


def test_optimize_cpu_only_records_and_switches_rules(tmp_path):
    from optimizer_helpers import write_problem

    from kernelfuse.pipeline import OptimizeOptions, optimize_file

    path = write_problem(tmp_path, "gemm_sum", GEMM_SUM, "[torch.randn(4, 16)]")
    logs: list[str] = []
    result = optimize_file(path, tmp_path / "out.py", OptimizeOptions(use_gpu=False), log=logs.append)
    fired = {f.rule for f in result.rewrites}
    assert {"reduce_linear_output", "size1_reductions", "reduce_before_affine"} <= fired
    assert any("reduce_linear_output" in line for line in logs)
    assert result.cpu_checks and all(c.ok for c in result.cpu_checks), result.cpu_checks
    off = optimize_file(path, tmp_path / "off.py", OptimizeOptions(use_gpu=False,
                        disabled_rewrites=("reduce_linear_output",)), log=lambda s: None)
    assert "reduce_linear_output" not in {f.rule for f in off.rewrites} and off.rewrites
    none = optimize_file(path, tmp_path / "none.py", OptimizeOptions(use_gpu=False, no_rewrites=True),
                         log=lambda s: None)
    assert none.rewrites == ()


def test_cli_unknown_rule_exits_2(tmp_path, capsys):
    from optimizer_helpers import write_problem

    from kernelfuse.cli import main

    path = write_problem(tmp_path, "gemm_sum", GEMM_SUM, "[torch.randn(4, 16)]")
    code = main(["optimize", str(path), "-o", str(tmp_path / "o.py"), "--cpu-only", "--no-rewrite", "nope"])
    assert code == 2 and "unknown rewrite rule nope" in capsys.readouterr().err


def test_rules_see_the_rewritten_graph_after_its_readers_were_indexed():
    """A graph whose reader index was built before rewriting (the planner builds it) is rewritten as a fresh one:
    every rule works on the new nodes, not a stale index of the old ones."""
    torch.manual_seed(0)
    model = Fn(_gemm_sum).double()
    x = [signed(5, 8).double()]
    graph = capture_module(model, x)
    for node in graph.nodes:
        graph.users(node.name)
    assert {"size1_reductions", "reduce_before_affine", "reduce_linear_output"} <= set(apply_rules(graph).rules_fired)
