"""Reply parsing: which fenced block is the candidate, and saying which one was used."""

from __future__ import annotations

from pathlib import Path

import pytest
from judge_support import CANDIDATES, seed_path

from kernelfuse.judge import NoCodeError, extract_candidate
from kernelfuse.judge.reply import choose_block, fenced_blocks


def _write(tmp_path: Path, text: str, name: str = "reply.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_last_python_block_is_used(tmp_path):
    text = "intro\n```python\nclass ModelNew: pass  # first\n```\nmore\n```python\nclass ModelNew: pass  # last\n```\n"
    cand = extract_candidate(_write(tmp_path, text))
    assert "last" in cand.source and cand.origin == "reply"
    assert (cand.block.first_line, cand.block.last_line) == (7, 7)
    assert cand.describe() == "reply: python block 2 of 2 (lines 7-7; 2 fenced blocks in all)"
    assert cand.line_offset == 6


def test_stray_fences_after_the_block_are_ignored(tmp_path):
    # Seed 003's shape: the block closes, then lines that start with ``` followed by prose.
    text = "```python\nclass ModelNew:\n    pass\n```\n``` This code replaces things.\n``` It is fast.\n"
    cand = extract_candidate(_write(tmp_path, text))
    assert cand.source == "class ModelNew:\n    pass\n"
    assert cand.n_blocks == 2 and cand.n_python_blocks == 1


def test_a_usage_block_after_the_model_is_skipped(tmp_path):
    text = "```python\nclass ModelNew:\n    pass\n```\n```python\nm = ModelNew()\n```\n"
    cand = extract_candidate(_write(tmp_path, text))
    assert "class ModelNew" in cand.source and cand.block.index == 1


def test_tilde_and_longer_fences(tmp_path):
    text = "~~~~ py\nclass ModelNew:\n    s = '```'\n~~~~\n"
    blocks = fenced_blocks(text)
    assert len(blocks) == 1 and blocks[0].language == "py" and "```" in blocks[0].code
    assert choose_block(blocks).index == 1


def test_unclosed_block_runs_to_the_end(tmp_path):
    cand = extract_candidate(_write(tmp_path, "text\n```python\nclass ModelNew:\n    pass\n"))
    assert cand.source.startswith("class ModelNew") and cand.block.last_line == 4


def test_untagged_block_with_model_new_is_a_fallback(tmp_path):
    cand = extract_candidate(_write(tmp_path, "```\nclass ModelNew:\n    pass\n```\n"))
    assert "ModelNew" in cand.source


def test_reply_without_python_raises(tmp_path):
    with pytest.raises(NoCodeError):
        extract_candidate(_write(tmp_path, "no code here\n```bash\nls\n```\n"))


def test_python_file_is_used_whole():
    cand = extract_candidate(CANDIDATES / "good.py")
    assert cand.origin == "python file" and cand.block is None and cand.line_offset == 0
    assert cand.describe() == "python file"


def test_crlf_reply(tmp_path):
    cand = extract_candidate(_write(tmp_path, "a\r\n```python\r\nclass ModelNew:\r\n    pass\r\n```\r\n"))
    assert cand.source == "class ModelNew:\n    pass\n"


def test_seed_002():
    cand = extract_candidate(seed_path("002"))
    assert (cand.block.first_line, cand.block.last_line) == (384, 457)
    assert "fused_add_relu_cuda" in cand.source and cand.source.rstrip().endswith("bias_shape]")


def test_seed_003_takes_the_block_before_the_stray_fences():
    cand = extract_candidate(seed_path("003"))
    assert (cand.block.first_line, cand.block.last_line) == (373, 431)
    assert '"-std=c++14"' in cand.source
    assert cand.source.rstrip().endswith("self.scaling_factor)")
    assert "This code replaces" not in cand.source


def test_seed_004_uses_the_second_of_two_blocks():
    cand = extract_candidate(seed_path("004"))
    assert cand.describe().startswith("reply: python block 2 of 2 (lines 502-567")
    assert "fused_relu_add_cuda" in cand.source
