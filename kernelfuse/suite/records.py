"""One JSONL record per problem, appended and flushed to disk as each result lands, so a killed suite loses
nothing it finished and `--resume` knows exactly what is left.

A kill can cut the last line short: on resume a trailing partial line is cut off (that problem runs again) and
records already present are never written twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kernelfuse.suite.discover import SuiteError


class RecordStore:
    """Append-only JSONL of records keyed by `record["key"]`; `done` holds the keys already written."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists() and path.stat().st_size and not resume:
            raise SuiteError(f"{path} already holds records: pass --resume to continue it, or remove it to start over")
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            self.records = _read_and_repair(path)
        self.done = {r["key"] for r in self.records}

    def append(self, record: dict[str, Any]) -> bool:
        """Write `record` (a dict with a "key") and fsync it; False (nothing written) if its key is done already."""
        if record["key"] in self.done:
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done.add(record["key"])
        self.records.append(record)
        return True


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSONL file (a cut-off last line is skipped, not repaired)."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "key" in record:
            records.append(record)
    return records


def _read_and_repair(path: Path) -> list[dict[str, Any]]:
    """Records of `path`, first truncating a partial last line left by a kill mid-write; first record per key."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
    unique: dict[str, dict[str, Any]] = {}
    for record in read_records(path):
        unique.setdefault(record["key"], record)
    return list(unique.values())
