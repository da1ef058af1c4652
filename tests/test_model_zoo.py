"""The model zoo (benchmarks/zoo: transformers and torchvision architectures built from configs with random
weights, and a diffusion UNet block) on the CPU, at each file's SMALL sizes: every model loads, captures, plans
and passes the CPU check (every plan interpreted against eager, every emitted file run), and the CUDA of the file
`optimize` would write (the first variant) compiles with nvcc. Skipped where transformers or torchvision is not
installed (the `zoo` extra; CI installs both). On the GPU: `kernelfuse bench benchmarks/zoo`."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from optimizer_helpers import AsCuda

from kernelfuse.capture import capture
from kernelfuse.cpucheck import check_plans
from kernelfuse.fuzz import device
from kernelfuse.fuzz.run import load_emitted, run_problem
from kernelfuse.load import load_problem
from kernelfuse.pipeline import build_model, emit_file
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo"
MODELS = sorted(ZOO.glob("*.py"))


def shrunk(path: Path, tmp_path: Path) -> Path:
    """A copy of a zoo file with its size constants set to its own SMALL values."""
    text = path.read_text()
    small = ast.literal_eval(re.search(r"^SMALL = (\{.*?\})$", text, re.M | re.S).group(1))
    for key, value in small.items():
        text, count = re.subn(rf"^{key} = \d+$", f"{key} = {value}", text, flags=re.M)
        assert count == 1, f"{path.name}: SMALL names {key}, which is not a size constant of the file"
    out = tmp_path / path.name
    out.write_text(text)
    return out


def test_the_zoo_has_the_architectures_the_issue_names():
    assert {p.stem for p in MODELS} >= {"gpt2", "llama", "bert", "vit", "bart", "whisper_encoder", "resnet50",
                                        "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "swin_t",
                                        "unet_block"}


@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_zoo_model_passes_the_cpu_check_and_compiles(path, tmp_path):
    for package in ("transformers", "torchvision"):
        if f"import {package}" in path.read_text() or f"from {package} " in path.read_text():
            if importlib.util.find_spec(package) is None:
                pytest.skip(f"{package} is not installed (pip install 'kernelfuse[zoo]')")
    run = run_problem(shrunk(path, tmp_path))
    assert run.outcome.status == "ok", run.outcome.describe()
    assert run.emitted and any(e.cuda for e in run.emitted), "no variant generated a kernel"
    nvcc = device.find_nvcc()
    if nvcc is None:
        return
    first = next(e.cuda for e in run.emitted if e.cuda)
    assert device.compile_all([first], nvcc) == {}


@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_zoo_model_as_constructed_takes_the_fused_path(path, tmp_path):
    """Most zoo models are a training-mode wrapper around a library model built with .eval(): as constructed, the
    emitted guard must let the kernels serve the call (one mode flag for the whole model made it fall back on
    every call), and in other modes it must not (eval-mode kernels on training-mode BatchNorm/Dropout)."""
    for package in ("transformers", "torchvision"):
        if f"import {package}" in path.read_text() or f"from {package} " in path.read_text():
            if importlib.util.find_spec(package) is None:
                pytest.skip(f"{package} is not installed (pip install 'kernelfuse[zoo]')")
    small = shrunk(path, tmp_path)
    problem = load_problem(small)
    plan = plan_variants(rewrite(capture(problem)))[0]
    scope = load_emitted(emit_file(problem, plan, "zoo test"), f"zoo_{path.stem}")
    model = scope["ModelNew"](*problem.init_inputs())
    inputs = tuple(AsCuda(t) for t in problem.make_inputs(0) if isinstance(t, torch.Tensor))
    with torch.no_grad():
        assert scope["_fallback_reason"](AsCuda(model), inputs) is None
        model.train(not model.training)  # every module in the other mode than the top one was built in
        assert scope["_fallback_reason"](AsCuda(model), inputs)[0] == "mode"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_zoo_model_captures_under_bf16_autocast_without_a_gpu(name, tmp_path):
    # GPT-2's KV cache makes `torch.tensor([], device=x.device)` in forward: on the fake CUDA device of the bf16
    # capture that asked torch to initialise CUDA ("no NVIDIA driver") until the trace kept it fake
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'kernelfuse[zoo]')")
    problem = load_problem(shrunk(ZOO / f"{name}.py", tmp_path))
    model = build_model(problem)
    graph = rewrite(capture(problem, model, autocast=torch.bfloat16))
    plans = plan_variants(graph, "bf16")
    assert graph.autocast == torch.bfloat16 and any(n.op == "_to_copy.default" for n in graph.nodes)
    assert any(st.aten == "_to_copy.default" for p in plans[:1] for s in p.generated for st in s.prologue.statements), \
        "no cast fused into a kernel"
    (check,) = check_plans(problem, model, graph, plans[:1])
    assert check.ok, check


def _bf16_capture(name: str, tmp_path: Path) -> tuple:
    """(problem, model, graph) of a torchvision zoo model's small config captured under bf16 autocast."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install 'kernelfuse[zoo]')")
    problem = load_problem(shrunk(ZOO / f"{name}.py", tmp_path))
    model = build_model(problem)
    return problem, model, rewrite(capture(problem, model, autocast=torch.bfloat16))


def test_swin_under_bf16_autocast_runs_its_window_attention_in_kernels(tmp_path):
    # autocast adds Swin's fp32 relative-position bias to bf16 scores in fp32, softmaxes in fp32 and casts the
    # probabilities back to bf16: no attention matched until those casts joined the pattern (12 bmm pairs ran as
    # cuBLAS calls on the GPU). The shifted windows' masks (a 5-d view between two adds) are a window mask.
    problem, model, graph = _bf16_capture("swin_t", tmp_path)
    plan = plan_variants(graph, "bf16")[0]
    assert sum(n.op == "_softmax.default" for n in graph.nodes) == len(plan.attention) == 12
    assert sum(a.windows is not None for a in plan.attention) == 2  # the shifted blocks of more than one window
    assert {a.out_meta.dtype for a in plan.attention} == {torch.bfloat16}
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check


def test_resnet_under_bf16_autocast_runs_every_batch_norm_in_a_kernel(tmp_path):
    # autocast's eval-mode batch norm (bf16 input, fp32 parameters) was a torch call per norm, and the ReLU and
    # residual add after it kernels of their own: one pass per norm now, checked against the captured ops
    problem, model, graph = _bf16_capture("resnet50", tmp_path)
    norms = [n for n in graph.nodes if "batch_norm" in n.op]
    plan = plan_variants(graph, "bf16")[0]
    fused = {name for s in plan.generated if s.spec is not None and s.spec.kind == "affine_norm" for name in s.replaces}
    assert norms and all(n.name in fused for n in norms), plan.summary()
    assert not any(n.op.startswith("empty") for n in graph.nodes)  # the norms' reserve buffers, read by nothing
    (check,) = check_plans(problem, model, graph, [plan])
    assert check.ok, check
