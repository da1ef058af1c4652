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

from kernelfuse.fuzz import device
from kernelfuse.fuzz.run import run_problem

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
