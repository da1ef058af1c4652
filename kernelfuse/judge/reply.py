"""Find the candidate's code: a Python file as is, or the last fenced python block of a text reply.

Language-model replies end with a ```python block that defines ModelNew, sometimes after other blocks (seed 004 has
two) and sometimes followed by stray fence lines (seed 003 ends with dozens of "``` some sentence" lines). Fences
follow CommonMark: a block opens with three or more backticks or tildes and an info string, and closes with a fence
of the same character, at least as long, with nothing after it; an unclosed block runs to the end of the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kernelfuse.load.parsing import parse_source

PYTHON_TAGS = ("python", "py", "python3", "py3")
_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n]*?)\s*$")


@dataclass(frozen=True)
class CodeBlock:
    """A fenced block: its 1-based index among all blocks, its language tag and its lines in the reply (1-based)."""

    index: int
    language: str
    first_line: int
    last_line: int
    code: str


@dataclass(frozen=True)
class Candidate:
    """The code to judge and where it came from (`block` is None for a plain Python file)."""

    path: Path
    source: str
    origin: str
    block: CodeBlock | None
    n_blocks: int
    n_python_blocks: int
    python_index: int = 0

    @property
    def line_offset(self) -> int:
        """Add to a line number of `source` to get the line of the original file."""
        return self.block.first_line - 1 if self.block else 0

    def describe(self) -> str:
        """`python file` or `reply: python block 2 of 2 (lines 502-567; 3 fenced blocks in all)`."""
        if self.block is None:
            return "python file"
        return (f"reply: python block {self.python_index} of {self.n_python_blocks} (lines {self.block.first_line}"
                f"-{self.block.last_line}; {self.n_blocks} fenced block{'s' if self.n_blocks != 1 else ''} in all)")


class NoCodeError(ValueError):
    """The reply holds no fenced python block (and is not Python itself)."""


def fenced_blocks(text: str) -> list[CodeBlock]:
    """All fenced code blocks of `text`, in order."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info")
        body_start = i + 1
        j = body_start
        while j < len(lines) and not _closes(lines[j], fence):
            j += 1
        code = "\n".join(lines[body_start:j])
        language = info.split()[0].lower() if info else ""
        blocks.append(CodeBlock(len(blocks) + 1, language, body_start + 1, max(body_start, j), code + "\n"))
        i = j + 1
    return blocks


def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    indent = len(line) - len(line.lstrip(" "))
    return indent <= 3 and len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _is_python(language: str) -> bool:
    return language in PYTHON_TAGS


def choose_block(blocks: list[CodeBlock]) -> CodeBlock | None:
    """The last python-tagged block that defines ModelNew; else the last python block; else the last untagged
    block that defines ModelNew."""
    python = [b for b in blocks if _is_python(b.language)]
    defines = [b for b in python if _defines_model_new(b.code)]
    if defines:
        return defines[-1]
    if python:
        return python[-1]
    untagged = [b for b in blocks if not b.language and _defines_model_new(b.code)]
    return untagged[-1] if untagged else None


def _defines_model_new(code: str) -> bool:
    return re.search(r"^\s*class\s+ModelNew\b|^\s*ModelNew\s*=", code, re.MULTILINE) is not None


def _parses(text: str) -> bool:
    try:
        parse_source(text)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_candidate(path: str | Path) -> Candidate:
    """Read a candidate file: Python source is used whole; a reply gives its last python block (see choose_block).

    A `.py` file is taken as Python unless it fails to parse and holds fenced blocks. Raises NoCodeError when a
    reply has no usable block, OSError when the file cannot be read.
    """
    path = Path(path)
    text = path.read_text(errors="replace")
    blocks = fenced_blocks(text)
    n_python = sum(_is_python(b.language) for b in blocks)
    as_python = path.suffix == ".py" and (_parses(text) or not blocks)
    if as_python or (not blocks and _parses(text)):
        return Candidate(path, text, "python file", None, len(blocks), n_python)
    block = choose_block(blocks)
    if block is None:
        raise NoCodeError(f"{path}: no fenced python block found ({len(blocks)} fenced block(s), none python)")
    python_index = sum(_is_python(b.language) for b in blocks[: block.index])
    return Candidate(path, block.code, "reply", block, len(blocks), n_python, python_index)
