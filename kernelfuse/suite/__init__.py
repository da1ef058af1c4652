"""Stage — suite: `kernelfuse bench`, many problems at once on every core, every GPU, or a Ray cluster.

discover (problem files) -> candidates (which file answers which problem) -> pool (builds on all cores, timing
one problem per GPU, each problem in its own process) -> records (one JSONL line per problem, resumable) ->
summary (fast_p, geometric means, failures by cause) -> report (one self-contained HTML file).
"""

from kernelfuse.suite.discover import SuiteProblem, discover
from kernelfuse.suite.records import RecordStore
from kernelfuse.suite.run import SuiteOptions, run_suite
from kernelfuse.suite.summary import Summary, summarize_records

__all__ = ["RecordStore", "SuiteOptions", "SuiteProblem", "Summary", "discover", "run_suite", "summarize_records"]
