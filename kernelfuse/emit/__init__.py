"""Stage 6 — emit: the self-contained ModelNew file, the product a user reads and ships."""

from kernelfuse.emit.modelnew import emit_modelnew, emit_reference

__all__ = ["emit_modelnew", "emit_reference"]
