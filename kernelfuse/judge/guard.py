"""Catch a candidate that patches torch, the timers or the judge itself, or leaves threads running.

Before the candidate is imported the judge records the identity of every public function and class attribute in
the places a patch would go (torch, torch.nn.functional, torch.Tensor, torch.cuda and its Event/Stream, every
nn module class, time, the judge's own verify/bench modules). After import, construction and each call, any
attribute that is no longer the same object is a patch: the candidate is rejected with the names. New Python
threads still alive after a candidate call are work escaping the timed region, except torch's own: a thread started
from torch.compile's code (Inductor's compile workers and their pool threads, when the candidate calls
torch.compile itself) is named as such instead (`compiler_threads`). Where a thread was started is recorded by
`record_thread_origins` (the code file of the first frame outside threading and concurrent.futures); a candidate
that runs its own code under a file name inside torch's package is out of scope (README, Limits).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import time
import types
from dataclasses import dataclass

import torch

JUDGE_MODULES = (
    "kernelfuse.verify.compare", "kernelfuse.verify.float64", "kernelfuse.verify.inputs", "kernelfuse.verify.numerics",
    "kernelfuse.verify.poison", "kernelfuse.verify.params", "kernelfuse.bench.timer", "kernelfuse.bench.alternate",
    "kernelfuse.bench.stats", "kernelfuse.bench.crosscheck", "kernelfuse.bench.floor", "kernelfuse.judge.guard",
    "kernelfuse.judge.worker", "kernelfuse.judge.trials", "kernelfuse.judge.timing", "kernelfuse.judge.timedcheck",
    "kernelfuse.judge.outputs", "kernelfuse.judge.devicestate", "kernelfuse.judge.calls", "kernelfuse.judge.outcome",
    "kernelfuse.judge.sidechecks",
)


def _watched() -> list[tuple[str, object]]:
    """(display prefix, namespace) pairs whose attributes are snapshotted."""
    spaces: list[tuple[str, object]] = [
        ("torch", torch), ("torch.nn.functional", torch.nn.functional), ("torch.Tensor", torch.Tensor),
        ("torch.cuda", torch.cuda), ("torch.cuda.Event", torch.cuda.Event), ("torch.cuda.Stream", torch.cuda.Stream),
        ("torch.nn.Module", torch.nn.Module), ("torch.testing", torch.testing), ("torch.linalg", torch.linalg),
        ("torch.autograd", torch.autograd), ("torch._C._nn", torch._C._nn),
        ("torch._C._VariableFunctions", torch._C._VariableFunctions), ("time", time),
        ("torch.utils.flop_counter", importlib.import_module("torch.utils.flop_counter")),
    ]
    for name, cls in vars(torch.nn).items():
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls is not torch.nn.Module:
            spaces.append((f"torch.nn.{name}", cls))
    for module_name in JUDGE_MODULES:
        try:
            spaces.append((module_name, importlib.import_module(module_name)))
        except ImportError:
            continue
    return spaces


def _attributes(space: object) -> dict[str, object]:
    if isinstance(space, type):
        # Resolve through the MRO from the class dicts (raw values have stable identities): a patch that shadows an
        # inherited attribute, e.g. torch.Tensor.__eq__ = ..., then shows as a change.
        resolved: dict[str, object] = {}
        for klass in reversed(space.__mro__[:-1]):
            resolved.update((k, v) for k, v in vars(klass).items() if _is_code(v))
        return resolved
    if isinstance(space, types.ModuleType):
        return {k: v for k, v in vars(space).items() if callable(v) or inspect.isclass(v)}
    try:
        return {k: getattr(space, k) for k in dir(space) if not k.startswith("__")}
    except Exception:  # noqa: BLE001 - an odd namespace: watch nothing in it
        return {}


def _is_code(value: object) -> bool:
    """Functions, methods and descriptors: what a patch replaces (plain data attributes may change legitimately)."""
    return callable(value) or isinstance(value, (property, staticmethod, classmethod)) or \
        inspect.ismethoddescriptor(value) or inspect.isdatadescriptor(value)


@dataclass(frozen=True)
class Snapshot:
    """Attribute identities at one moment; the objects are held so their ids cannot be reused."""

    entries: tuple[tuple[str, str, object], ...]

    @classmethod
    def take(cls) -> Snapshot:
        entries = []
        for prefix, space in _watched():
            for key, value in _attributes(space).items():
                entries.append((prefix, key, value))
        return cls(tuple(entries))

    def changes(self) -> list[str]:
        """Qualified names whose object is no longer the one recorded (replaced or deleted)."""
        current_attrs = {prefix: _attributes(space) for prefix, space in _watched()}
        changed = []
        for prefix, key, value in self.entries:
            current = current_attrs.get(prefix, {}).get(key, _MISSING)
            if current is not value:
                changed.append(f"{prefix}.{key}" + (" (deleted)" if current is _MISSING else ""))
        return sorted(set(changed))


class _Missing:
    pass


_MISSING = _Missing()


TORCH_DIR = os.path.dirname(torch.__file__)
COMPILER_DIRS = tuple(os.path.join(TORCH_DIR, d) + os.sep for d in ("_inductor", "_dynamo", "_functorch", "compiler"))
THREADING_FILES = (threading.__file__, os.path.dirname(importlib.import_module("concurrent.futures").__file__))


def record_thread_origins() -> None:
    """From now on every started thread remembers the code file that started it (see `compiler_threads`)."""
    original = threading.Thread.start
    if getattr(original, "kernelfuse_origin", False):
        return

    def start(self: threading.Thread) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(THREADING_FILES):
            frame = frame.f_back
        self.kernelfuse_origin = frame.f_code.co_filename if frame is not None else ""
        original(self)

    start.kernelfuse_origin = True  # type: ignore[attr-defined]
    threading.Thread.start = start  # type: ignore[method-assign]


def _compiler_thread(thread: threading.Thread) -> bool:
    """Started by torch.compile's own code, running torch's own callback (a candidate's callback in torch's timer
    is the candidate's)."""
    return str(getattr(thread, "kernelfuse_origin", "")).startswith(COMPILER_DIRS) and not _borrowed_timer(thread)


def _borrowed_timer(thread: threading.Thread) -> bool:
    timer = getattr(getattr(thread, "_target", None), "__self__", None)
    call = getattr(timer, "call", None)
    return (type(timer).__module__ == "torch._inductor.compile_worker.timer"
            and not str(getattr(call, "__module__", "")).startswith("torch."))


def compiler_threads(before: frozenset[threading.Thread]) -> list[str]:
    """Names of live threads, new since `before`, that torch.compile's own code started."""
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive() and _compiler_thread(t)]


def python_threads() -> frozenset[threading.Thread]:
    """The live Python threads, as objects: a thread that ends frees its ident for the next one the OS starts, so
    a new thread could pass for one that was running before if threads were told apart by ident (a candidate's
    thread was missed so, seen when the threads of an earlier judgement were still ending)."""
    return frozenset(threading.enumerate())


def new_threads(before: frozenset[threading.Thread]) -> list[str]:
    """Names of live threads that were not running in `before` (torch's own, for the judge's baseline, aside)."""
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not _torch_own(t)
            and not _compiler_thread(t) and not _progress_monitor(t)]


def _progress_monitor(thread: threading.Thread) -> bool:
    """tqdm's progress-bar monitor (Inductor's progress bars start one): it runs tqdm's own loop, which only
    refreshes bars, so no candidate work can escape in it. Its exact class, with tqdm's run method, not a subclass."""
    cls = type(thread)
    return (cls.__module__ == "tqdm._monitor" and cls.__name__ == "TMonitor"
            and getattr(cls.run, "__module__", None) == "tqdm._monitor")


def _torch_own(thread: threading.Thread) -> bool:
    """Inductor's compile-worker idle timer: torch starts it (lazily, at any later compile event) for the judge's
    torch.compile baseline, and it calls torch's own shutdown. Not the candidate's work."""
    timer = getattr(getattr(thread, "_target", None), "__self__", None)
    call = getattr(timer, "call", None)
    return (type(timer).__module__ == "torch._inductor.compile_worker.timer"
            and str(getattr(call, "__module__", "")).startswith("torch."))
