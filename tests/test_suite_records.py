"""JSONL records: written as they land, one per problem, and a killed run resumes with nothing lost or doubled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.records import RecordStore, read_records


def test_append_writes_complete_lines_and_refuses_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "out" / "r.jsonl"
    store = RecordStore(path, resume=False)
    assert store.append({"key": "a", "x": 1}) and store.append({"key": "b"})
    assert not store.append({"key": "a", "x": 2})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["a", "b"]
    assert path.read_text().endswith("\n")


def test_existing_file_needs_resume(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    RecordStore(path, resume=False).append({"key": "a"})
    with pytest.raises(SuiteError, match="--resume"):
        RecordStore(path, resume=False)


def test_resume_cuts_a_partial_last_line_and_keeps_first_record_per_key(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a", "v": 1}\n{"key": "b", "v": 2}\n{"key": "a", "v": 3}\n{"key": "c", "v')
    store = RecordStore(path, resume=True)
    assert store.done == {"a", "b"}
    assert [r["v"] for r in store.records] == [1, 2]
    assert store.append({"key": "c", "v": 4})
    assert [r["key"] for r in read_records(path)] == ["a", "b", "a", "c"]  # the cut line is gone, c is whole
    assert read_records(path)[-1]["v"] == 4


def test_resume_of_missing_file_starts_empty(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "new.jsonl", resume=True)
    assert store.done == set() and store.records == []
