"""float64 accuracy rule, numerics flags, parameter check, input checks, policies (CPU)."""

from __future__ import annotations

import pytest
import torch

from kernelfuse.verify import (
    SLACK_FACTOR,
    NumericsFlags,
    accuracy_ok,
    changed_inputs,
    check_float64,
    compare_state,
    fingerprint,
    flags_applied,
    float64_model,
    get_policy,
    inputs_to,
    max_abs_error,
    max_abs_value,
    no_tf32_flags,
    same_bits,
    tf32_flags,
    to_float64,
)


def test_policies():
    assert (get_policy("strict").atol, get_policy("tf32").atol, get_policy("bf16").rtol) == (1e-4, 1e-2, 1e-2)
    assert get_policy("tf32").baseline == "tf32"
    with pytest.raises(ValueError, match="choose one of strict, tf32, bf16"):
        get_policy("fp8")


def test_accuracy_rule():
    assert accuracy_ok(2e-5, 1e-5, 10.0)
    assert not accuracy_ok(3e-5, 1e-5, 1.0)
    assert accuracy_ok(1e-7, 0.0, 1.0)  # a few ulps of slack where eager is exact
    assert not accuracy_ok(1e-5, 0.0, 1.0)


def test_check_float64_on_a_real_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)
    x = torch.rand(32, 256)
    ref64 = float64_model(model)(*to_float64([x]))
    eager = model(x)
    bf16 = torch.nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16()).float()
    good = check_float64(eager.clone(), eager, eager, ref64)
    bad = check_float64(bf16, eager, eager, ref64)
    assert good.ok and good.reason is None
    assert not bad.ok and bad.ours_err > SLACK_FACTOR * bad.base_err
    assert "less accurate than the policy allows" in bad.reason and "that of eager (" in bad.reason
    assert max_abs_error(eager, ref64) == good.eager_err
    assert max_abs_value(torch.tensor([-3.0, float("inf"), 2.0])) == 3.0


class _ClosureModel(torch.nn.Module):
    """MiniGPT's pattern (level 3, 44): a lambda over submodules, which a deep copy does not re-point."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 8)})
        m = self.mlp
        self.mlpf = lambda x: torch.relu(m.fc(x))

    def forward(self, x):
        return self.mlpf(x)


def test_float64_copy_of_a_model_with_closures_over_its_layers():
    torch.manual_seed(0)
    model = _ClosureModel()
    with torch.no_grad():
        model.mlp.fc.weight.add_(1.0)  # state that differs from a fresh construction: the copy must take it over
    x = torch.rand(4, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        float64_model(model)(*to_float64([x]))  # the deep copy still calls the float32 layer
    ref64 = float64_model(model, _ClosureModel)(*to_float64([x]))
    assert ref64.dtype == torch.float64
    torch.testing.assert_close(ref64.float(), model(x))
    assert model.mlp.fc.weight.dtype == torch.float32  # the original is left as it is


def test_reference64_that_cannot_run_in_float64_leaves_the_trial_to_eager():
    from kernelfuse.judge.calls import Models, reference64_output

    model = _ClosureModel()
    models = Models(model, model, float64_model(model))
    out, why = reference64_output(models, [torch.rand(4, 8)], torch.device("cpu"), 0)
    assert out is None and "does not run in float64" in why and "dtype" in why


def test_numerics_flags_capture_apply_and_changes():
    before = NumericsFlags.capture()
    try:
        torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
        after = NumericsFlags.capture()
        assert after.changes_from(before)
        before.apply()
        assert NumericsFlags.capture().changes_from(before) == []
        with flags_applied(tf32_flags(before)):
            assert NumericsFlags.capture().effective()["matmul TF32"] == "True"
        assert NumericsFlags.capture().changes_from(before) == []
        with flags_applied(no_tf32_flags(before)):
            eff = NumericsFlags.capture().effective()
            assert (eff["matmul TF32"], eff["cuDNN TF32"]) == ("False", "False")
    finally:
        before.apply()


def test_lowering_is_told_apart_from_raising():
    base = NumericsFlags.capture()
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = False
        changed = NumericsFlags.capture()
    finally:
        base.apply()
    lowered = changed.lowers_precision_from(no_tf32_flags(base))
    assert lowered == ["matmul TF32: False -> True"]


class Net(torch.nn.Module):
    def __init__(self, order: str = "ab"):
        super().__init__()
        for name in order:
            setattr(self, name, torch.nn.Parameter(torch.randn(3)))
        self.register_buffer("stat", torch.zeros(2))


def test_compare_state():
    torch.manual_seed(1)
    a = Net()
    torch.manual_seed(1)
    assert compare_state(a, Net()).ok
    torch.manual_seed(1)
    swapped = compare_state(a, Net("ba"))
    assert swapped.value == ("a", "b") and not swapped.ok
    torch.manual_seed(1)
    other = compare_state(a, Net("ac"))
    assert other.missing == ("b",) and other.extra == ("c",)
    assert "missing: b; extra: c" in other.summary()


def test_inputs_are_copied_and_checked_bitwise():
    x = torch.tensor([1.0, float("nan")])
    copy = inputs_to([x, 3, [1, 2]], torch.device("cpu"))
    assert copy[0] is not x and same_bits(copy[0], x) and copy[1:] == [3, [1, 2]]
    copy[0][0] = 2.0
    assert changed_inputs([x, 3], copy) == [0]
    assert not same_bits(torch.zeros(2), torch.zeros(3))


def test_fingerprint_tells_outputs_apart():
    a = torch.randn(1000)
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a) != fingerprint(a + 1e-3)
