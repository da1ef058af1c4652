"""Generated kernels on the GPU: every family of the zoo fixture (one model, one extension) against eager."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kernelfuse.capture import build_model, capture
from kernelfuse.codegen import generate
from kernelfuse.emit import emit_modelnew
from kernelfuse.load import load_problem
from kernelfuse.plan import plan_variants
from kernelfuse.rewrite import rewrite

ZOO = Path(__file__).parent / "fixtures" / "problems" / "zoo_generated.py"


def _emitted(tmp_path: Path, problem_path: Path) -> dict:
    problem = load_problem(problem_path)
    plan = plan_variants(rewrite(capture(problem, build_model(problem))))[-1]
    assert plan.generated, plan.summary()
    path = tmp_path / f"{problem_path.stem}_new.py"
    path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
    return runpy.run_path(str(path))


def _pair(tmp_path: Path, problem_path: Path, seed: int) -> tuple:
    """(reference Model, emitted ModelNew, CUDA inputs drawn under `seed`), both models built under seed 0."""
    ns = _emitted(tmp_path, problem_path)
    torch.manual_seed(seed)
    inputs = [t.cuda() for t in ns["get_inputs"]()]
    torch.manual_seed(0)
    ref = runpy.run_path(str(problem_path))["Model"]().cuda()
    torch.manual_seed(0)
    return ref, ns["ModelNew"]().cuda(), inputs


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_zoo_matches_eager(tmp_path: Path, seed: int) -> None:
    ref, new, inputs = _pair(tmp_path, ZOO, seed)
    with torch.no_grad():
        expected = ref(*inputs)
        got = new(*inputs)
    bad = []
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g.shape == e.shape and g.dtype == e.dtype, i
        if not torch.allclose(g, e, atol=1e-4, rtol=1e-4, equal_nan=True):
            bad.append(f"output {i}: max abs err {(g - e).abs().max().item():.3g}")
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        e, g = ref.get_buffer(name), new.get_buffer(name)
        if not torch.allclose(g.float(), e.float(), atol=1e-5, rtol=1e-5):
            bad.append(f"buffer {name}: {(g.float() - e.float()).abs().max().item():.3g}")
    assert not bad, bad


@pytest.mark.gpu
def test_zoo_special_values(tmp_path: Path) -> None:
    """NaN, +-inf and all--inf rows go through reductions, softmax and logsumexp as eager's do."""
    ns = _emitted(tmp_path, ZOO)
    inputs = [t.cuda() for t in ns["get_inputs"]()]
    a, b = inputs[0], inputs[1]
    a[0, 3] = float("nan")
    a[1, :] = float("-inf")
    a[2, 5] = float("inf")
    b[0, 0, 0, 0] = float("nan")
    b[1, :, 2, 2] = float("-inf")
    torch.manual_seed(0)
    ref = runpy.run_path(str(ZOO))["Model"]().cuda()
    torch.manual_seed(0)
    new = ns["ModelNew"]().cuda()
    with torch.no_grad():
        expected, got = ref(*inputs), new(*inputs)
    for i in (0, 2, 3, 4, 5, 6, 15, 18):  # the branches of a and b that are not normalised
        e, g = expected[i], got[i]
        assert torch.equal(torch.isnan(e), torch.isnan(g)), i
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(g)), i
        assert torch.allclose(g[finite], e[finite], atol=1e-4, rtol=1e-4), i


FIXTURES = Path(__file__).parent / "fixtures" / "problems"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["zoo_mapped", "zoo_onchip"])
def test_row_kernels_match_eager(tmp_path: Path, name: str) -> None:
    """zoo_mapped: RMS/L1 norms, max-subtract and a long-row min-scale as one kernel each, at the sizes the
    scheduler maps. zoo_onchip: rows too long for a block's registers (log_softmax, softmax, a mapped L1 norm,
    instance, layer and group norm) kept in the shared memory of several blocks; on sm_80+ the on-chip kernels
    must be the ones that ran."""
    ref, new, inputs = _pair(tmp_path, FIXTURES / f"{name}.py", 3)
    with torch.no_grad():
        expected = ref(*inputs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = new(*inputs)
            torch.cuda.synchronize()
    errs = [(g - e).abs().max().item() for e, g in zip(expected, got, strict=True)]
    assert all(g.shape == e.shape for e, g in zip(expected, got, strict=True))
    assert all(err <= 1e-4 for err in errs), errs
    ran = {e.key for e in prof.key_averages()}
    if name == "zoo_onchip" and torch.cuda.get_device_capability()[0] >= 8:
        assert sum("_onchip_kernel" in k for k in ran) == len(expected), sorted(ran)


@pytest.mark.gpu
def test_a_binding_check_raises_and_a_right_call_computes(tmp_path: Path) -> None:
    """A tensor of another shape or layout than the kernel was built for is a ValueError naming both, raised by
    the Python binding before anything launches; a right call goes through ctypes and computes."""
    from optimizer_helpers import write_problem

    problem = write_problem(tmp_path, "softmax", "def forward(self, x):\n    return torch.softmax(x, dim=-1)",
                            "[torch.randn(8, 100)]")
    ext = _emitted(tmp_path, problem)["_extension"]()
    with pytest.raises(ValueError, match=r"has shape \[3\], the kernel was built for \[8, 100\]"):
        ext.k0(torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match=r"has strides \[1, 8\], the kernel was built for \[100, 1\]"):
        ext.k0(torch.zeros(100, 8, device="cuda").t())
    assert torch.allclose(ext.k0(torch.ones(8, 100, device="cuda")), torch.full((8, 100), 0.01, device="cuda"))


@pytest.mark.gpu
def test_arg_reductions_match_eager_index_for_index(tmp_path: Path) -> None:
    """argmin/argmax kernels (strided rows, contiguous rows, a split over every dim) give eager's int64 indices
    exactly, ties and NaNs included, and they are the kernels that ran."""
    ref, new, inputs = _pair(tmp_path, FIXTURES / "zoo_arg.py", 0)
    with torch.no_grad():
        expected = ref(*inputs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = new(*inputs)
            torch.cuda.synchronize()
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g.dtype == torch.int64 and g.shape == e.shape, i
        assert torch.equal(g, e), (i, (g != e).sum().item())
    ran = {e.key for e in prof.key_averages()}
    assert not any("argm" in k.lower() for k in ran), sorted(ran)  # no ATen arg-reduction ran


@pytest.mark.gpu
def test_concatenations_sharing_a_buffer_match_eager(tmp_path: Path) -> None:
    """zoo_dense_cat in every plan variant (NCHW, channels-last graph): the batch norms and channel sums read views
    of the concatenations' shared buffers; outputs and running statistics match eager's, and no concatenation
    kernel runs (each operand is copied into its slice once). cuDNN's TF32 is off on both sides: a convolution
    would turn the norm kernel's last-bit differences into TF32 roundings."""
    problem = load_problem(FIXTURES / "zoo_dense_cat.py")
    plans = plan_variants(rewrite(capture(problem, build_model(problem))))
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for plan in plans:
            path = tmp_path / f"dense_{plan.variant}.py"
            path.write_text(emit_modelnew(problem, plan, generate(plan), "GPU test"))
            ns = runpy.run_path(str(path))
            torch.manual_seed(0)
            ref = runpy.run_path(str(FIXTURES / "zoo_dense_cat.py"))["Model"]().cuda()
            torch.manual_seed(0)
            new = ns["ModelNew"]().cuda()
            torch.manual_seed(5)
            inputs = [t.cuda() for t in ns["get_inputs"]()]
            with torch.no_grad():
                expected = ref(*inputs)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    got = new(*inputs)
                    torch.cuda.synchronize()
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape and torch.allclose(g, e, atol=1e-4, rtol=1e-4), plan.variant
            for name in ("bns.2.running_mean", "bns.2.running_var"):
                assert torch.allclose(new.get_buffer(name), ref.get_buffer(name), atol=1e-5, rtol=1e-5), name
            ran = {e.key for e in prof.key_averages()}
            assert not any("CatArray" in k for k in ran), (plan.variant, sorted(ran))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.gpu
def test_a_channels_last_vgg_stack_matches_eager(tmp_path: Path) -> None:
    """The channels-last graph's conv+bias+ReLU calls, its pools writing channels-last, the flatten's NCHW copy."""
    path = Path(__file__).parent / "fixtures" / "problems" / "zoo_vgg_cl.py"
    ref, new, inputs = _pair(tmp_path, path, 0)
    with torch.no_grad():
        torch.testing.assert_close(new(*inputs), ref(*inputs), atol=1e-4, rtol=1e-4)
