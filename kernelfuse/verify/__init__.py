"""Stage — verify: is a candidate's output the reference's? Policies, comparison, float64 accuracy, poisoning.

The rules are plain functions over tensors (tested on the CPU); the judge's worker applies them per trial.
"""

from kernelfuse.verify.compare import Comparison, compare_outputs, describe, flatten_outputs
from kernelfuse.verify.float64 import (
    SLACK_FACTOR,
    SLACK_REL,
    Float64Check,
    accuracy_ok,
    as_accurate_as,
    check_float64,
    float64_model,
    max_abs_error,
    max_abs_value,
    mean_abs_error,
    no_less_accurate,
    to_float64,
)
from kernelfuse.verify.inputs import changed_inputs, fingerprint, inputs_to, same_bits
from kernelfuse.verify.numerics import NumericsFlags, flags_applied, no_tf32_flags, tf32_flags
from kernelfuse.verify.params import StateCheck, compare_state
from kernelfuse.verify.poison import POISON_BYTE, poison_free_memory
from kernelfuse.verify.policy import POLICIES, Policy, get_policy

__all__ = [
    "POISON_BYTE", "POLICIES", "SLACK_FACTOR", "SLACK_REL", "Comparison", "Float64Check", "NumericsFlags", "Policy",
    "StateCheck", "accuracy_ok", "as_accurate_as", "changed_inputs", "check_float64", "compare_outputs",
    "compare_state", "describe", "fingerprint", "flags_applied", "flatten_outputs", "float64_model", "get_policy",
    "inputs_to", "max_abs_error", "max_abs_value", "mean_abs_error", "no_less_accurate", "no_tf32_flags",
    "poison_free_memory", "same_bits", "tf32_flags", "to_float64",
]
