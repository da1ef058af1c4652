"""Parse and compile Python source one call at a time in this process.

CPython 3.11's parser keeps its recursion-depth count per interpreter, not per thread, so `ast.parse` or
`compile` running in two threads at once can fail with "AST constructor recursion depth mismatch" (seen when
several judge evaluations ran in a thread pool). Every parse in kernelfuse goes through this lock.
"""

from __future__ import annotations

import ast
import threading
from types import CodeType

_LOCK = threading.Lock()


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse`, serialised."""
    with _LOCK:
        return ast.parse(source, filename)


def compile_source(source: str, filename: str) -> CodeType:
    """`compile(source, filename, "exec")`, serialised."""
    with _LOCK:
        return compile(source, filename, "exec")
