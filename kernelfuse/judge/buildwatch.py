"""Watch the candidate's extension builds: time each `load_inline`/`load`, keep its flags, or stub it out.

With a GPU the real functions run, timed, so the verdict can say which extension failed, with which flags, and how
long building took. Without one (CI), the calls are replaced by stubs that record the request and return a module
whose functions say they were not built, so the candidate can still be imported and constructed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.utils.cpp_extension as cpp_extension

WATCHED = ("load_inline", "load")


@dataclass(frozen=True)
class ExtensionBuild:
    """One extension request: which function, its name and flags, seconds spent, and the error if it failed."""

    function: str
    name: str
    seconds: float
    ok: bool
    error: str | None
    flags: tuple[str, ...]
    stubbed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "name": self.name, "seconds": round(self.seconds, 3), "ok": self.ok,
                "error": self.error, "flags": list(self.flags), "stubbed": self.stubbed}


class UnbuiltExtension:
    """Stands in for an extension that was not built: any function of it raises when called."""

    def __init__(self, name: str, reason: str) -> None:
        self._name, self._reason = name, reason

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def not_built(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError(f"extension {self._name!r} was not built ({self._reason}); {attr}() cannot run")

        return not_built


def _flags(kwargs: dict[str, Any]) -> tuple[str, ...]:
    flags: list[str] = []
    for key in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags"):
        value = kwargs.get(key) or ()
        flags += [value] if isinstance(value, str) else [str(v) for v in value]
    return tuple(f for f in flags if f)


@contextmanager
def watch_builds(records: list[ExtensionBuild], stub_reason: str | None = None) -> Iterator[None]:
    """Within the block, `torch.utils.cpp_extension.load_inline`/`load` are wrapped (or stubbed when `stub_reason`
    is given); each call appends an ExtensionBuild to `records`. The originals are restored afterwards."""
    originals = {name: getattr(cpp_extension, name) for name in WATCHED}

    def wrap(function: str) -> Callable[..., Any]:
        original = originals[function]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = str(kwargs.get("name", args[0] if args else "?"))
            flags = _flags(kwargs)
            if stub_reason is not None:
                records.append(ExtensionBuild(function, name, 0.0, False, None, flags, True))
                return UnbuiltExtension(name, stub_reason)
            start = time.perf_counter()
            try:
                module = original(*args, **kwargs)
            except BaseException as err:
                records.append(ExtensionBuild(function, name, time.perf_counter() - start, False,
                                              f"{type(err).__name__}: {str(err)[:2000]}", flags, False))
                # Without verbose=True torch keeps the compiler output in the message: put it in the log, where
                # the judge looks for the key error lines.
                print(f"kernelfuse: building extension {name!r} failed:\n{err}", file=sys.stderr, flush=True)
                raise
            records.append(ExtensionBuild(function, name, time.perf_counter() - start, True, None, flags, False))
            return module

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    for name in WATCHED:
        setattr(cpp_extension, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cpp_extension, name, original)
