"""Load a problem file (KernelBench format) into a `Problem`: factories for the model and its inputs.

A problem file defines `class Model(nn.Module)`, `get_init_inputs()` and `get_inputs()`. Loading executes the
file once in a fresh module namespace; nothing is constructed until a factory is called, so a 1 GB problem costs
nothing to load.
"""

from __future__ import annotations

import ast
import linecache
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelfuse.errors import ProblemError
from kernelfuse.load.parsing import compile_source, parse_source
from kernelfuse.load.paths import read_source

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
DEFAULT_SEED = 42
PROBLEM_MODULE_PREFIX = "kernelfuse_problem_"  # a problem file's module name: its classes are in the emitted file


@dataclass(frozen=True)
class Problem:
    """A loaded problem: the file's text and the three names it must define."""

    path: Path
    source: str
    module: types.ModuleType = field(repr=False)
    model_cls: type = field(repr=False)
    get_inputs: Callable[[], list] = field(repr=False)
    get_init_inputs: Callable[[], list] = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.stem

    def init_inputs(self) -> list:
        """Constructor arguments, as `get_init_inputs()` gives them."""
        return list(_call_user(self, self.get_init_inputs, "get_init_inputs()"))

    def make_model(self, seed: int = DEFAULT_SEED, init_inputs: list | None = None) -> torch.nn.Module:
        """`torch.manual_seed(seed); Model(*init_inputs)` on the CPU, as KernelBench builds it."""
        args = self.init_inputs() if init_inputs is None else init_inputs
        torch.manual_seed(seed)
        return _call_user(self, lambda: self.model_cls(*args), "Model(*get_init_inputs())")

    def make_inputs(self, seed: int, device: torch.device | str | None = None) -> list:
        """`torch.manual_seed(seed); get_inputs()`: fresh random inputs for one trial, as CPU tensors, or made on
        `device` when given.

        On a GPU the factories run there (`with torch.device(device)`): the CPU's serial generator takes ~16 s for
        the 6.4 GB `torch.rand` of a level-1 elementwise problem, and a judgement draws inputs 8 times or more.
        The draws differ from the CPU's for the same seed (another generator), still seeded and the same for every
        model judged. A get_inputs that cannot run under a device (it calls numpy, say) runs on the CPU and is
        copied over."""
        torch.manual_seed(seed)
        if device is None or torch.device(device).type == "cpu":
            return list(_call_user(self, self.get_inputs, "get_inputs()"))
        try:
            with torch.device(device):
                made = list(self.get_inputs())
        except Exception:  # noqa: BLE001 - the CPU route below reports the user's own error if there is one
            made = self.make_inputs(seed)
        return [x.to(device) if isinstance(x, torch.Tensor) else x for x in made]


def load_problem(path: str | Path) -> Problem:
    """Execute a problem file and check that it defines Model, get_inputs and get_init_inputs.

    Raises ProblemError (exit code 2) with a one-line cause for a missing file, a syntax error, an exception at
    import, or a missing name.
    """
    path = Path(path)
    source = read_source(path)
    try:
        code = compile_source(source, str(path))
    except SyntaxError as err:
        raise ProblemError(f"{path}:{err.lineno}: syntax error: {err.msg}") from None
    module = types.ModuleType(f"{PROBLEM_MODULE_PREFIX}{path.stem}")
    module.__file__ = str(path)
    # Register the text so tracebacks (and inspect.getsource on the classes) can show the problem's own lines.
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    except ModuleNotFoundError as err:  # a third-party package the problem imports: say how to get it
        fix = f": install it (pip install {err.name.split('.')[0]})" if err.name else ""
        raise ProblemError(f"{path}: the problem needs a module that is not installed, {_describe(err, path)}{fix}") \
            from None
    except Exception as err:  # noqa: BLE001 - any failure of user code becomes a clean error
        raise ProblemError(f"{path}: importing the problem raised {_describe(err, path)}") from None
    missing = [name for name in REQUIRED_NAMES if name not in module.__dict__]
    if missing:
        raise ProblemError(f"{path}: missing {', '.join(missing)} (a problem file defines {', '.join(REQUIRED_NAMES)})")
    model_cls = module.Model
    if not (isinstance(model_cls, type) and issubclass(model_cls, torch.nn.Module)):
        raise ProblemError(f"{path}: Model must be a subclass of torch.nn.Module")
    return Problem(path, source, module, model_cls, module.get_inputs, module.get_init_inputs)


def _call_user(problem: Problem, fn: Callable[[], Any], what: str) -> Any:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - user code: report its own failing line
        raise ProblemError(f"{problem.path}: {what} raised {_describe(err, problem.path)}") from None


def _describe(err: BaseException, path: Path) -> str:
    """`ValueError: msg (line 12: x = foo())`, naming the deepest frame inside the problem file."""
    line = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if frame.filename == str(path):
            line = f" (line {frame.lineno}: {frame.line.strip() if frame.line else '?'})"
            break
    return f"{type(err).__name__}: {err}{line}"


def class_source(problem: Problem, class_name: str = "Model") -> ast.ClassDef:
    """The class definition node of `class_name` in the problem's source."""
    tree = parse_source(problem.source, str(problem.path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return node
    raise ProblemError(f"{problem.path}: no top-level 'class {class_name}' in the source")
