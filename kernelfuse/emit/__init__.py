"""Stage 6 — emit: the self-contained ModelNew file, the product a user reads and ships."""

from kernelfuse.emit.modelnew import check_emittable, emit_modelnew, emit_reference

__all__ = ["check_emittable", "emit_modelnew", "emit_reference"]
