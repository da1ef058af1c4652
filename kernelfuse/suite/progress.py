"""Progress on stderr: a live line (done/total, verified, faster than eager, failed, ETA) redrawn in place on a
terminal; elsewhere (logs, CI) one plain line per finished problem and no redraws."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Counts finished problems; `finished(record)` after each one, `close()` at the end."""

    def __init__(self, total: int, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.done = self.verified = self.faster = self.failed = 0
        self.started = time.monotonic()

    def finished(self, record: dict[str, Any]) -> None:
        self.done += 1
        if record.get("correctness"):
            self.verified += 1
            if (record.get("speedup_eager") or 0.0) > 1.0:
                self.faster += 1
        elif record.get("status") != "not_verified":
            self.failed += 1
        if self.live:
            self.stream.write("\r\033[K" + self.line())
        else:
            self.stream.write(f"[{self.done}/{self.total}] {describe(record)}\n")
        self.stream.flush()

    def line(self) -> str:
        """`[12/50] verified 10 · faster 7 · failed 2 · 3:10 elapsed · ETA 9:40`."""
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        return (f"[{self.done}/{self.total}] verified {self.verified} · faster {self.faster} · failed {self.failed}"
                f" · {_clock(elapsed)} elapsed" + (f" · ETA {_clock(eta)}" if eta is not None else ""))

    def close(self) -> None:
        if self.live and self.done:
            self.stream.write("\n")
            self.stream.flush()


def describe(record: dict[str, Any]) -> str:
    """One line per finished problem: key, status, speedups and its wall time."""
    text = f"{record['key']}: {record.get('status')}"
    for name, label in (("speedup_eager", "eager"), ("speedup_compile", "compile")):
        if record.get(name):
            text += f" {record[name]:.3f}x {label}"
    if not record.get("correctness") and record.get("reason"):
        text += f" ({str(record['reason'])[:120]})"
    wall = (record.get("judge_wall_s") or 0.0) + (record.get("build_wall_s") or 0.0)
    return text + f" [{wall:.1f} s]"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
