"""Stage 3 — rewrite: exact algebraic simplifications of the Graph before planning, as named, switchable rules."""

from kernelfuse.rewrite.engine import RuleFiring
from kernelfuse.rewrite.rules import (
    RULE_NAMES,
    RULES,
    RewriteResult,
    Rule,
    apply_rules,
    div_by_scalar_to_mul,
    drop_identities,
    rewrite,
)

__all__ = ["RULES", "RULE_NAMES", "RewriteResult", "Rule", "RuleFiring", "apply_rules", "div_by_scalar_to_mul",
           "drop_identities", "rewrite"]
