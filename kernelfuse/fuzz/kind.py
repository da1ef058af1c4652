"""What a fuzzer op kind is (its parameters' draw and their rendering against shapes), and `Invalid` for shapes
they do not fit: apart from the kinds themselves so the modules that define kinds (ops, layers) and the generator
share them without importing each other.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Shape = tuple[int, ...]
Params = dict[str, object]


class Invalid(Exception):
    """These parameters do not fit these shapes."""


@dataclass(frozen=True)
class Kind:
    name: str
    arity: int  # operands that are model values (a second operand is another value: a multi-branch graph)
    weight: float
    draw: Callable[[random.Random, list[Shape]], Params]
    render: Callable[[Params, list[Shape]], tuple[list[str], str]]
    min_rank: int = 0
    max_rank: int = 5
