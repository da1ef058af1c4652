"""What the judge (parent) hands the worker (child) and how the worker reports back.

The request is a JSON file; the worker answers by rewriting one JSON outcome file at every stage (atomically), so
when the child dies (segfault, CUDA fault, timeout kill) the parent still knows how far it got and everything
measured up to then.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REQUEST_FILE = "request.json"
OUTCOME_FILE = "outcome.json"
LOG_FILE = "worker.log"


@dataclass(frozen=True)
class WorkerRequest:
    """Everything the worker needs; paths are absolute."""

    problem_path: str
    candidate_path: str
    line_offset: int
    outcome_path: str
    trials: int
    precision: str
    seed: int
    timing_reps: int
    warmup: int
    baselines: tuple[str, ...]
    device: str
    float64: str
    time_incorrect: bool
    input_sets: int = 4
    implausible_margin: float = 0.5
    mode: str = "train"
    robust: bool = False
    call_checks: bool = True

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> WorkerRequest:
        data = json.loads(Path(path).read_text())
        data["baselines"] = tuple(data["baselines"])
        return cls(**data)


def write_outcome(path: str | Path, outcome: dict[str, Any]) -> None:
    """Replace the outcome file atomically (write a sibling, then rename)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome, indent=1, default=_jsonable))
    os.replace(tmp, path)


def read_outcome(path: str | Path) -> dict[str, Any]:
    """The last outcome the worker wrote, or {} if it wrote none (or it is unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)
