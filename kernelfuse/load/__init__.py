"""Stage 1 — load: a problem file becomes a `Problem` (factories for the model and its inputs)."""

from kernelfuse.load.problem import DEFAULT_SEED, Problem, class_source, load_problem

__all__ = ["DEFAULT_SEED", "Problem", "class_source", "load_problem"]
