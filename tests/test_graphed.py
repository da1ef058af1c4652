"""CUDA-graph variants: when the optimizer judges one (a launch-bound forward), when it ships, and the emitted
runtime's rule for when a captured graph may serve a call (run on the CPU with the capture replaced by a plain
call: the bookkeeping is what is tested here; tests/test_graphed_gpu.py replays real graphs)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from kernelfuse import choose
from kernelfuse.capture import build_model, capture, draws_random_numbers
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite
from tests.test_pipeline_choice import EXAMPLES, _run, _verdict

FIXTURES = Path(__file__).parent / "fixtures" / "problems"


def _busy(verdict, busy_ms: float):  # noqa: ANN001, ANN202
    return dataclasses.replace(verdict, details={"streams": {"candidate_busy_ms": busy_ms}})


def test_launch_bound_forward_ships_its_graph(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused+graph": _verdict(True, 1.0, eager=2.8), "fused": _busy(_verdict(True, 2.7, eager=2.8), 1.2),
              "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert judged == ["fused", "fused+graph"]
    assert result.shipped == "fused+graph" and result.final.runtime_ms == 1.0
    assert "graph.replay((x,))" in text and "def _fused_forward(self, x):" in text
    assert "class _CudaGraph" in text


def test_kernel_bound_forward_is_not_graphed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = {"fused+graph": _verdict(True, 1.0, eager=2.8), "fused": _busy(_verdict(True, 2.7, eager=2.8), 2.6),
              "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert judged == ["fused"] and result.shipped == "fused"  # busy 2.6 of 2.7 ms: no graph judged
    assert "_CudaGraph" not in text


def test_graph_is_judged_where_the_idle_time_exceeds_what_a_replay_adds(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """A forward busy for 0.93 of its call (as transformers' forwards are) is judged graphed where its copies are
    small: x and the output (1024 x 8192 fp32 each, 64 MiB) take 0.09 ms; busy for 2.6 of 2.7 ms it is not."""
    problem = load_problem(EXAMPLES / "gemm_add_relu.py")
    graph = rewrite(capture(problem, build_model(problem)))
    copies = 2 * 2 * 1024 * 8192 * 4 / (choose.GRAPH_COPY_GBPS * 1e6)
    assert choose.graph_predicted_ms(graph, 2.5) == pytest.approx(2.5 + copies + choose.GRAPH_REPLAY_MS)
    script = {"fused+graph": _verdict(True, 2.55, eager=2.8), "fused": _busy(_verdict(True, 2.7, eager=2.8), 2.5),
              "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert judged == ["fused", "fused+graph"] and result.shipped == "fused+graph"


@pytest.mark.parametrize("graph_ms", [2.75, 2.68])  # slower; faster by less than the 2% a graph must gain
def test_graph_that_does_not_gain_does_not_ship(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                graph_ms: float) -> None:
    script = {"fused+graph": _verdict(True, graph_ms, eager=2.8),
              "fused": _busy(_verdict(True, 2.7, eager=2.8), 1.0), "unfused": _verdict(True, 2.8, eager=2.8)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert judged == ["fused", "fused+graph"] and result.shipped == "fused"
    assert result.notes == [f"fused+graph does not ship ({graph_ms:.3f} ms against 2.700 ms)"]
    assert "_CudaGraph" not in text


def test_unfused_ship_graphs_the_fastest_verified_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fusion alone did not pay (ResNet101: 0.98x eager), but its kernels replayed from a graph do."""
    script = {"fused+graph": _verdict(True, 1.4, eager=2.8), "fused": _verdict(True, 2.9, eager=2.8),
              "unfused": _busy(_verdict(True, 2.8, eager=2.8), 1.1)}
    result, text, judged = _run(monkeypatch, tmp_path, "gemm_add_relu", script)
    assert judged == ["fused", "unfused", "fused+graph"]
    assert result.shipped == "fused+graph" and "graph.replay((x,))" in text
    assert result.notes[-1] == "fused+graph ships: 1.400 ms against 2.800 ms without the graph"


def test_random_ops_are_never_graphed() -> None:
    problem = load_problem(FIXTURES / "tiny_bn_dropout.py")
    graph = rewrite(capture(problem, build_model(problem)))
    assert graph.training and draws_random_numbers(graph)
    problem = load_problem(FIXTURES / "tiny_gemm_add_relu.py")
    assert not draws_random_numbers(rewrite(capture(problem, build_model(problem))))


_SDPA = "nn.functional.scaled_dot_product_attention"


@pytest.mark.parametrize(("module", "call", "random"), [
    ("nn.Dropout(0.0)", "self.m(x)", False),  # KernelBench's transformers: dropout 0 draws nothing
    ("nn.Dropout(0.1)", "self.m(x)", True),
    ("nn.LSTM(8, 8, num_layers=2, dropout=0.0)", "self.m(x)[0]", False),  # tagged seeded for its dropout
    ("nn.LSTM(8, 8, num_layers=2, dropout=0.5)", "self.m(x)[0]", True),
    # transformers' Llama: a mask by position, the scale by keyword, no dropout (the keyword was once read as
    # the dropout probability, and the model was never graphed)
    ("nn.Identity()", f"{_SDPA}(x, x, x, x[..., :3], scale=0.5)", False),
    ("nn.Identity()", f"{_SDPA}(x, x, x, dropout_p=0.1, scale=0.5)", True),
])
def test_dropout_with_probability_zero_draws_nothing(tmp_path: Path, module: str, call: str, random: bool) -> None:
    path = tmp_path / "problem.py"
    path.write_text(f"""import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = {module}

    def forward(self, x):
        return torch.relu({call})


def get_inputs():
    return [torch.rand(5, 3, 8)]


def get_init_inputs():
    return []
""")
    problem = load_problem(path)
    graph = rewrite(capture(problem, build_model(problem)))
    assert graph.training and draws_random_numbers(graph) is random


# --- the emitted runtime, its capture replaced by plain calls -------------------------------------------------

class _Counting:
    """Stands in for the capture: records by running the forward, 'replays' by running it again on the static
    inputs and writing the result into the recorded output (as a replay writes the graph's memory)."""

    launches = 0

    def _record(self, forward):  # noqa: ANN001, ANN202
        self.forward = forward
        return forward(*self.static)

    def _launch(self) -> None:
        _Counting.launches += 1
        self.out.copy_(self.forward(*self.static))


def _namespace(tmp_path: Path) -> dict:
    """The emitted file of an ops-only plan of BatchNorm in eval mode (runs on the CPU), executed."""
    source = tmp_path / "problem.py"
    source.write_text('''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.scale = torch.rand(8) + 0.5  # a plain tensor attribute: state the graph reads too

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)) * self.scale)


def get_inputs():
    return [torch.rand(4, 8)]


def get_init_inputs():
    return []
''')
    problem = load_problem(source)
    model = build_model(problem).eval()
    plan = plan_variants(rewrite(capture(problem, model)), max_fusions=0)[0].as_graphed()
    text = emit_modelnew(problem, plan, None, "test")
    namespace: dict = {}
    exec(compile(text, str(tmp_path / "new.py"), "exec"), namespace)  # noqa: S102 - the emitted file under test
    graph_cls = namespace["_CudaGraph"]
    namespace["_CudaGraph"] = type("CountingGraph", (_Counting, graph_cls), {})
    _Counting.launches = 0
    return namespace


def _model(namespace: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return namespace["ModelNew"]().eval()


def _call(namespace: dict, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ModelNew.forward does past its guard (which wants CUDA tensors)."""
    graph = model.__dict__.get("_cuda_graph")
    if graph is not None and graph.serves((x,)):
        return graph.replay((x,))
    return namespace["_graphed"](model, model._fused_forward, (x,))


def _captured(tmp_path: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    """A model whose graph was captured (two calls), and the input it was captured with."""
    namespace = _namespace(tmp_path)
    model = _model(namespace)
    x = torch.rand(4, 8)
    with torch.no_grad():
        _call(namespace, model, x)
        _call(namespace, model, x)
    return model, x


def test_emitted_file_runs_the_original_ops_off_the_gpu(tmp_path: Path) -> None:
    namespace = _namespace(tmp_path)
    model = _model(namespace)
    x = torch.rand(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), model._reference_forward(x))  # CPU input: the guard sends it to the ops
    assert model.__dict__.get("_cuda_graph") is None


def test_first_call_warms_up_the_second_captures_then_replays(tmp_path: Path) -> None:
    namespace = _namespace(tmp_path)
    model = _model(namespace)
    xs = [torch.rand(4, 8) for _ in range(4)]
    with torch.no_grad():
        outs = [_call(namespace, model, x) for x in xs]
        assert model.__dict__.get("_cuda_graph") is not None
        assert _Counting.launches == 3  # call 2 replays after capturing, calls 3 and 4 replay
        for x, out in zip(xs, outs, strict=True):
            assert torch.allclose(out, model._reference_forward(x))
    assert len({o.data_ptr() for o in outs}) == 4  # each result is a clone: none aliases the graph or another


@pytest.mark.parametrize("change", ["weight_in_place", "weight_replaced", "storage_moved", "submodule_replaced",
                                    "train_mode", "numerics_flag", "input_shape", "input_strides", "autograd",
                                    "inference_mode", "attribute_replaced", "attribute_in_place"])
def test_graph_does_not_serve_after_a_change(tmp_path: Path, change: str) -> None:
    model, x = _captured(tmp_path)
    graph = model.__dict__["_cuda_graph"]
    with torch.no_grad():
        assert graph.serves((x,))
    flag = torch.backends.cudnn.benchmark
    try:
        with torch.no_grad():
            if change == "weight_in_place":
                model.fc.weight.mul_(2)
            elif change == "weight_replaced":
                model.fc.weight = torch.nn.Parameter(model.fc.weight.detach().clone())
            elif change == "storage_moved":
                model.fc.weight.data = model.fc.weight.data.clone()
            elif change == "submodule_replaced":
                model.bn = torch.nn.BatchNorm1d(8).eval()
            elif change == "train_mode":
                model.bn.train()
            elif change == "numerics_flag":
                torch.backends.cudnn.benchmark = not flag
            elif change == "input_shape":
                x = torch.rand(5, 8)
            elif change == "input_strides":
                x = torch.rand(8, 4).t()
            elif change == "attribute_replaced":
                model.scale = torch.rand(8)
            elif change == "attribute_in_place":
                model.scale.mul_(2)
        if change == "autograd":
            assert not graph.serves((x,))  # grad enabled and the weights require it
        elif change == "inference_mode":
            with torch.inference_mode():
                assert not graph.serves((x,))
        else:
            with torch.no_grad():
                assert not graph.serves((x,))
    finally:
        torch.backends.cudnn.benchmark = flag


def test_graph_serves_an_unchanged_call(tmp_path: Path) -> None:
    model, _ = _captured(tmp_path)
    with torch.no_grad():
        assert model.__dict__["_cuda_graph"].serves((torch.rand(4, 8),))  # other values, same signature, weights


def test_failed_capture_warns_once_and_runs_plainly(tmp_path: Path) -> None:
    namespace = _namespace(tmp_path)

    class Failing(namespace["_CudaGraph"]):
        def _record(self, forward):  # noqa: ANN001, ANN202
            raise RuntimeError("operation not permitted when stream is capturing")

    namespace["_CudaGraph"] = Failing
    model = _model(namespace)
    x = torch.rand(4, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [_call(namespace, model, x) for _ in range(4)]
    assert [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)] != []
    assert len([w for w in caught if "CUDA graph capture failed" in str(w.message)]) == 1
    assert model.__dict__.get("_cuda_graph") is None and model.__dict__["_cuda_graph_broken"]
    with torch.no_grad():
        for out in outs:
            assert torch.allclose(out, model._reference_forward(x))


def test_replays_count_as_fused_calls_and_declined_calls_say_why(tmp_path: Path) -> None:
    """The graphed forward counts like the plain one (see tests/test_fallback_stats.py): a replay is a fused call,
    a call the graph and the guard decline runs the original ops with its reason."""
    namespace = _namespace(tmp_path)
    model = _model(namespace)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.rand(4, 8))  # no graph yet, and the guard declines a CPU tensor
        x = torch.rand(4, 8)
        _call(namespace, model, x)  # one by one, then captured (past the guard: not counted by it)
        _call(namespace, model, x)
        model(torch.rand(4, 8))  # the graph serves it: a replay
        model(torch.rand(5, 8))  # not the graph's shape: the guard declines
    stats = model.kernelfuse_stats()
    assert stats["fused_calls"] == 1 and stats["fallback_reasons"] == {"device": 1, "shape": 1}
    assert stats["last_fallback"] == "input x has shape [5, 8], the kernels were built for [4, 8]"
    assert len([w for w in caught if issubclass(w.category, namespace["KernelfuseFallbackWarning"])]) == 2


def test_launch_bound_choice_also_graphs_the_plan_with_the_least_gpu_time(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """Timed without a graph, launch overhead decides between plans; a graph removes it. The plan that ships
    ungraphed (channels-last, fastest at 5.0 ms) is graphed, and so is the one with the least GPU time (NCHW,
    busy 1.0 ms): its graph is faster and ships. (The problem's input and output take 2.1 ms to copy.)"""
    script = {"fused-nhwc+graph": _verdict(True, 3.7, eager=5.6), "fused-nchw+graph": _verdict(True, 3.2, eager=5.6),
              "fused-nhwc": _busy(_verdict(True, 5.0, eager=5.6), 1.5),
              "fused-nchw": _busy(_verdict(True, 5.2, eager=5.6), 1.0),
              "fused-igemm": _busy(_verdict(True, 5.4, eager=5.6), 1.2),
              "unfused": _verdict(True, 5.6, eager=5.6)}
    result, text, judged = _run(monkeypatch, tmp_path, "conv2d_relu_biasadd", script)
    assert judged[-2:] == ["fused-nhwc+graph", "fused-nchw+graph"]
    assert result.shipped == "fused-nchw+graph" and result.final.runtime_ms == 3.2
    assert "graph.replay(" in text
