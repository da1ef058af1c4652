"""Stage — judge: `kernelfuse eval`, a verdict on any ModelNew candidate that a candidate cannot fool or crash.

Reply parsing, static checks, one child process per candidate with a wall-clock limit, exploit defences, and the
Verdict (table and JSON with KernelBench's record fields). The optimizer uses the same `evaluate`.
"""

from kernelfuse.judge.evaluate import evaluate
from kernelfuse.judge.options import EvalOptions
from kernelfuse.judge.reply import Candidate, CodeBlock, NoCodeError, extract_candidate
from kernelfuse.judge.static import StaticReport, static_check
from kernelfuse.judge.verdict import (
    EXIT_INCORRECT,
    EXIT_NO_DEVICE,
    EXIT_NOT_BUILT,
    EXIT_OK,
    EXIT_USAGE,
    Verdict,
)

__all__ = [
    "EXIT_INCORRECT", "EXIT_NOT_BUILT", "EXIT_NO_DEVICE", "EXIT_OK", "EXIT_USAGE", "Candidate", "CodeBlock",
    "EvalOptions", "NoCodeError", "StaticReport", "Verdict", "evaluate", "extract_candidate", "static_check",
]
