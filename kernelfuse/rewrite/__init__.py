"""Stage 3 — rewrite: exact algebraic clean-ups of the Graph before planning."""

from kernelfuse.rewrite.rules import PASSES, div_by_scalar_to_mul, drop_identities, rewrite

__all__ = ["PASSES", "div_by_scalar_to_mul", "drop_identities", "rewrite"]
