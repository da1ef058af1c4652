"""Stage 2 — capture: the forward as ATen ops with shapes, dtypes and strides, traced on fake tensors."""

from __future__ import annotations

import resource

import pytest
import torch
from optimizer_helpers import EXAMPLES, run_kernelfuse, write_problem

from kernelfuse.capture import Ref, TensorMeta, capture, contiguous_strides
from kernelfuse.errors import CaptureError
from kernelfuse.load import load_problem

EXPECTED_OPS = {
    "gemm_add_relu": ["t.default", "mm.default", "add.Tensor", "relu.default"],
    "gemm_sigmoid_scaling_residualadd": ["t.default", "addmm.default", "sigmoid.default", "mul.Tensor", "add.Tensor"],
    "conv2d_relu_biasadd": ["convolution.default", "relu.default", "add.Tensor"],
}


def _ops(graph):
    return [n.op for n in graph.nodes if n.op not in ("input", "param", "buffer")]


@pytest.fixture(scope="module")
def graphs():
    return {name: capture(load_problem(EXAMPLES / f"{name}.py")) for name in EXPECTED_OPS}


@pytest.mark.parametrize("name", list(EXPECTED_OPS))
def test_example_op_sequences(graphs, name):
    assert _ops(graphs[name]) == EXPECTED_OPS[name]


def test_gemm_add_relu_metadata(graphs):
    g = graphs["gemm_add_relu"]
    by_op = {n.op: n for n in g.nodes}
    (x,) = g.inputs
    assert x.target == 0 and x.meta == TensorMeta((1024, 8192), torch.float32, (8192, 1))
    state = {n.target: n for n in g.state}
    assert set(state) == {"gemm.weight", "bias"}
    assert state["gemm.weight"].op == "param" and state["gemm.weight"].meta.shape == (8192, 8192)
    assert state["bias"].meta == TensorMeta((8192,), torch.float32, (1,))
    t = by_op["t.default"]
    assert t.args == (Ref(state["gemm.weight"].name),)
    assert t.meta.shape == (8192, 8192) and t.meta.stride == (1, 8192) and not t.meta.is_contiguous
    mm = by_op["mm.default"]
    assert mm.args == (Ref(x.name), Ref(t.name))
    assert mm.meta == TensorMeta((1024, 8192), torch.float32, (8192, 1))
    assert by_op["add.Tensor"].args == (Ref(mm.name), Ref(state["bias"].name))
    assert g.outputs == (Ref(by_op["relu.default"].name),)
    assert [u.name for u in g.users(mm.name)] == [by_op["add.Tensor"].name]


def test_gemm_sigmoid_residual_structure(graphs):
    g = graphs["gemm_sigmoid_scaling_residualadd"]
    by_op = {n.op: n for n in g.nodes}
    addmm = by_op["addmm.default"]
    assert addmm.meta.shape == (1024, 8192)
    assert by_op["mul.Tensor"].args == (Ref(by_op["sigmoid.default"].name), 2.0)
    # the residual reads the addmm output a second time
    assert by_op["add.Tensor"].args == (Ref(by_op["mul.Tensor"].name), Ref(addmm.name))
    assert sorted(u.op for u in g.users(addmm.name)) == ["add.Tensor", "sigmoid.default"]


def test_conv_metadata(graphs):
    g = graphs["conv2d_relu_biasadd"]
    conv = next(n for n in g.nodes if n.op == "convolution.default")
    assert conv.meta == TensorMeta((128, 128, 126, 126), torch.float32, contiguous_strides((128, 128, 126, 126)))
    assert conv.args[3:] == ((1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    bias = next(n for n in g.state if n.target == "bias")
    assert bias.meta.shape == (128, 1, 1) and bias.meta.stride == (1, 1, 1)
    weight = g[conv.args[1]]
    assert weight.target == "conv.weight" and weight.meta.shape == (128, 64, 3, 3)


def test_strides_of_non_contiguous_values(tmp_path):
    path = write_problem(tmp_path, "perm", """
        def forward(self, x):
            y = x.permute(0, 2, 1)
            return y * 2.0
        """, "[torch.rand(3, 4, 5)]")
    g = capture(load_problem(path))
    perm = next(n for n in g.nodes if n.op == "permute.default")
    assert perm.meta.shape == (3, 5, 4) and perm.meta.stride == (20, 1, 5)
    mul = next(n for n in g.nodes if n.op == "mul.Tensor")
    assert mul.meta.shape == (3, 5, 4)


def test_dtypes_are_recorded(tmp_path):
    path = write_problem(tmp_path, "half", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8, dtype=torch.bfloat16)

        def forward(self, x):
            return torch.sigmoid(self.lin(x)).float()
        """, "[torch.rand(4, 16, dtype=torch.bfloat16)]")
    g = capture(load_problem(path))
    addmm = next(n for n in g.nodes if n.op == "addmm.default")
    assert addmm.meta.dtype == torch.bfloat16
    assert g[g.outputs[0]].meta.dtype == torch.float32


def test_capture_allocates_no_real_memory(tmp_path):
    # get_inputs() asks for 2^34 floats (64 GiB): only a fake tensor may ever exist
    path = write_problem(tmp_path, "huge", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.lin(x))
        """, "[torch.rand(1 << 30, 16)]")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    g = capture(load_problem(path))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert g.inputs[0].meta.shape == (1 << 30, 16)
    out = g[g.outputs[0]]
    assert out.meta.numel == 1 << 34 and out.meta.dtype == torch.float32
    assert grown_kib < 1 << 20, f"capture grew the peak RSS by {grown_kib} KiB"


def test_multiple_outputs_and_inputs(tmp_path):
    path = write_problem(tmp_path, "multi", """
        def forward(self, a, b):
            s = a + b
            return s, torch.relu(s)
        """, "[torch.rand(2, 3), torch.rand(2, 3)]")
    g = capture(load_problem(path))
    assert [n.target for n in g.inputs] == [0, 1]
    add = next(n for n in g.nodes if n.op == "add.Tensor")
    relu = next(n for n in g.nodes if n.op == "relu.default")
    assert g.outputs == (Ref(add.name), Ref(relu.name))
    assert g.is_output(add.name) and g.users(add.name) == [relu]


UNTRACEABLE = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16)

def forward(self, x):
    y = self.lin(x)
    if y.sum() > 0:  # data-dependent control flow: fake tensors have no values
        return y
    return -y
"""


def test_untraceable_forward_raises_capture_error(tmp_path):
    path = write_problem(tmp_path, "untraceable", UNTRACEABLE, "[torch.rand(4, 16)]")
    message = r"forward branches on a tensor's value at line 13 \(if y.sum\(\) > 0:"
    with pytest.raises(CaptureError, match=message) as info:
        capture(load_problem(path))
    assert info.value.exit_code == 3


def test_untraceable_forward_exit_code_3(tmp_path):
    path = write_problem(tmp_path, "untraceable", UNTRACEABLE, "[torch.rand(4, 16)]")
    out = tmp_path / "out.py"
    result = run_kernelfuse("optimize", str(path), "-o", str(out), "--cpu-only")
    assert result.returncode == 3, result.stderr
    assert "forward branches on a tensor's value at line 13" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


DATA_SIZED = """
def __init__(self):
    super().__init__()
    self.lin = nn.Linear(16, 16)

def forward(self, x):
    y = self.lin(x)
    return y[y > 0]  # as many elements as are positive
"""


def test_value_sized_output_says_why(tmp_path):
    path = write_problem(tmp_path, "data_sized", DATA_SIZED, "[torch.rand(4, 16)]")
    with pytest.raises(CaptureError, match=r"an output's size depends on the input's values at line 13") as info:
        capture(load_problem(path))
    assert "fixed shapes" in str(info.value) and info.value.exit_code == 3


def test_constructor_error_during_capture_is_a_problem_error(tmp_path):
    path = write_problem(tmp_path, "ctor", """
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3) @ torch.randn(4, 4))

        def forward(self, x):
            return x
        """, "[torch.rand(3)]")
    from kernelfuse.errors import ProblemError

    line = r"line \d+: self.w = nn.Parameter\(torch.randn\(3, 3\) @ torch.randn\(4, 4\)\)"
    with pytest.raises(ProblemError, match=line):
        capture(load_problem(path))


def test_constructor_converting_dtype_can_be_captured(tmp_path):
    path = write_problem(tmp_path, "tohalf", """
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8).half()

        def forward(self, x):
            return torch.relu(self.lin(x))
        """, "[torch.rand(4, 16).half()]")
    g = capture(load_problem(path))
    assert g[g.outputs[0]].meta.dtype == torch.float16



RECURRENT = {  # module, forward arguments (the LSTM's initial state is h and c)
    "gru": ("nn.GRU(6, 5, num_layers=2)", "[torch.rand(7, 3, 6), torch.rand(2, 3, 5)]", "gru.input"),
    "gru_bidir_batch_first": ("nn.GRU(6, 5, num_layers=2, batch_first=True, bidirectional=True)",
                              "[torch.rand(3, 7, 6), torch.rand(4, 3, 5)]", "gru.input"),
    "lstm_proj": ("nn.LSTM(6, 5, batch_first=True, proj_size=2)",
                  "[torch.rand(3, 7, 6), torch.rand(1, 3, 2), torch.rand(1, 3, 5)]", "lstm.input"),
    "rnn_relu": ("nn.RNN(6, 5, nonlinearity='relu', bidirectional=True)",
                 "[torch.rand(7, 3, 6), torch.rand(2, 3, 5)]", "rnn_relu.input"),
}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_modules_are_one_node_with_the_real_layout(tmp_path, name):
    """An RNN/LSTM/GRU is one ATen node (its CPU decomposition unrolls every step: 64 000 nodes for a 6-layer
    GRU over 512 steps), and each of its outputs has the shape and strides the real CPU kernel produces."""
    module, inputs, op = RECURRENT[name]
    path = write_problem(tmp_path, name, f"""
        def __init__(self):
            super().__init__()
            self.rnn = {module}

        def forward(self, x, *state):
            out, final = self.rnn(x, state if len(state) > 1 else state[0])
            return (out, *final) if isinstance(final, tuple) else (out, final)
        """, inputs)
    problem = load_problem(path)
    g = capture(problem)
    assert [n.op for n in g.nodes].count(op) == 1
    assert len(g.nodes) < 30  # weights, inputs, the op and its getitems: no unrolled steps
    torch.manual_seed(0)
    real = problem.make_model()(*problem.make_inputs(seed=0))
    assert len(real) == len(g.outputs)
    for ref, value in zip(g.outputs, real, strict=True):
        assert g[ref].meta == TensorMeta(tuple(value.shape), value.dtype, tuple(value.stride()))


def test_recurrent_capture_leaves_torch_as_it_was(tmp_path):
    """Keeping RNN ops whole is scoped to one capture: afterwards a plain make_fx of a GRU records its unrolled
    steps again, and no fake rule of ours is left registered."""
    from torch._decomp import decomposition_table
    from torch._subclasses.fake_impls import op_implementations_dict
    from torch.fx.experimental.proxy_tensor import make_fx

    decomposed = {op for op in (torch.ops.aten.gru.input, torch.ops.aten.lstm.input) if op in decomposition_table}

    capture(load_problem(write_problem(tmp_path, "gru", """
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(6, 5)

        def forward(self, x):
            return self.rnn(x)[0]
        """, "[torch.rand(7, 3, 6)]")))
    assert torch.ops.aten.gru.input not in op_implementations_dict
    assert {op for op in (torch.ops.aten.gru.input, torch.ops.aten.lstm.input) if op in decomposition_table} \
        == decomposed
    gru = torch.nn.GRU(6, 5)
    gm = make_fx(lambda x: gru(x)[0])(torch.rand(7, 3, 6))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.gru.input" not in targets and targets.count("aten.sigmoid_.default") == 14


def test_recurrent_op_kept_whole_is_checked_and_emitted(tmp_path):
    """A GRU with a fused epilogue behind it: the plan keeps `gru.input` a torch call, the CPU interpreter runs it
    on the real weights and the check passes, and the emitted forward calls it with the module's weights."""
    path = write_problem(tmp_path, "grufc", """
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(16, 32, num_layers=2, batch_first=True, bidirectional=True)
            self.fc = nn.Linear(64, 8)

        def forward(self, x, h0):
            out, hn = self.rnn(x, h0)
            return torch.relu(self.fc(out[:, -1, :])) * 2.0, hn
        """, "[torch.rand(4, 10, 16), torch.rand(4, 4, 32)]")
    out = tmp_path / "grufc_new.py"
    proc = run_kernelfuse("optimize", str(path), "-o", str(out), "--cpu-only")
    assert proc.returncode == 0, proc.stderr
    assert "fused k0: addmm -> relu -> mul" in proc.stdout and "CPU interpreter check (fused): ok" in proc.stdout
    assert "torch.ops.aten.gru.input(" in out.read_text()


def test_tensor_meta_density_follows_torch() -> None:
    from kernelfuse.capture import TensorMeta

    def meta(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, tuple(t.stride()))

    x = torch.empty(2, 3, 4, 5)
    cl = meta(x.contiguous(memory_format=torch.channels_last))
    assert cl.is_dense_permutation and not cl.is_dense_contiguous
    assert meta(x.transpose(1, 3)).is_dense_permutation
    assert not meta(x[:, :, ::2]).is_dense_permutation
    assert not meta(torch.empty(3, 1).expand(3, 4)).is_dense_contiguous  # a broadcast: stride 0
    unit = meta(torch.empty(2, 1, 1, 3).permute(0, 3, 1, 2))  # strides (3, 1, 3, 3): torch calls it contiguous
    assert unit.is_dense_contiguous and not unit.is_contiguous
