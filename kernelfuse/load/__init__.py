"""Stage 1 — load: a problem file becomes a `Problem` (factories for the model and its inputs)."""

from kernelfuse.load.paths import check_output_path, read_source
from kernelfuse.load.problem import DEFAULT_SEED, Problem, class_source, load_problem

__all__ = ["DEFAULT_SEED", "Problem", "check_output_path", "class_source", "load_problem", "read_source"]
