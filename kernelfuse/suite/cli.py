"""`kernelfuse bench PROBLEMS...`: the suite's command line (wired into kernelfuse.cli as a subcommand)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kernelfuse.judge.options import BASELINES_HELP, DEFAULT_BASELINES, parse_baselines
from kernelfuse.suite.discover import SuiteError
from kernelfuse.suite.run import SuiteOptions, run_suite
from kernelfuse.verify import POLICIES

EPILOG = """Each problem runs in its own processes (a crash or hang becomes its record); builds run ahead on all
cores while each GPU times one problem at a time. One JSONL record per problem is written as it lands; --resume
skips recorded problems. Exit code 0 when every problem has a record (whatever the verdicts), 2 on usage errors."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench subcommand's arguments to `parser`."""
    parser.description = "Optimize (or, with --candidates, judge) every problem of a suite and summarize it."
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("problems", type=Path, nargs="+", metavar="PROBLEMS",
                        help="problem files, folders of them, or a KernelBench checkout (levelN subfolders)")
    parser.add_argument("--candidates", type=Path, metavar="DIR",
                        help="judge the candidates in DIR (level_L_problem_N_sample_S_kernel.py or <problem>.py/.txt)"
                             " instead of optimizing")
    parser.add_argument("--jsonl", type=Path, default=Path("kernelfuse_bench.jsonl"), metavar="OUT.jsonl",
                        help="one record per problem (default kernelfuse_bench.jsonl)")
    parser.add_argument("--report", type=Path, metavar="OUT.html", help="write a self-contained HTML report")
    parser.add_argument("--out-dir", type=Path, metavar="DIR",
                        help="where optimized files go (default <jsonl stem>_modelnew/ beside the JSONL)")
    parser.add_argument("--gpus", default="1", metavar="N|all", help="GPUs to time on, one process each (default 1)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="run as Ray tasks, one GPU each; ADDRESS of a running cluster (default: a local one)")
    parser.add_argument("--resume", action="store_true", help="continue OUT.jsonl, skipping recorded problems")
    parser.add_argument("--precision", choices=list(POLICIES), default="strict", help="tolerance policy")
    parser.add_argument("--baselines", default=",".join(DEFAULT_BASELINES), help=BASELINES_HELP)
    parser.add_argument("--require-custom-kernel", action="store_true",
                        help="a candidate (or shipped file) that runs no kernel of its own is not correct: 'no "
                             "custom kernel ran'")
    parser.add_argument("--levels", default="", metavar="1,2,3", help="only these KernelBench levels")
    parser.add_argument("--cpu-only", action="store_true",
                        help="no GPU: optimize without GPU verification, judge candidates on the CPU")
    parser.add_argument("--limit", type=int, metavar="N", help="only the first N problems of the suite")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S", help="limit per problem (default 900 s)")


def options_from_args(args: argparse.Namespace) -> SuiteOptions:
    """SuiteOptions from parsed arguments; SuiteError (exit code 2) for values that cannot work."""
    try:
        baselines = parse_baselines(args.baselines)
    except ValueError as err:
        raise SuiteError(str(err)) from None
    try:
        levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
    except ValueError:
        raise SuiteError(f"--levels {args.levels}: give level numbers such as 1,2") from None
    if args.limit is not None and args.limit < 1:
        raise SuiteError("--limit must be at least 1")
    if args.timeout <= 0:
        raise SuiteError("--timeout must be positive")
    return SuiteOptions(jsonl=args.jsonl, candidates=args.candidates, report=args.report, out_dir=args.out_dir,
                        gpus=args.gpus, ray=args.ray is not None, ray_address=args.ray or None, resume=args.resume,
                        precision=args.precision, baselines=baselines, levels=levels, cpu_only=args.cpu_only,
                        limit=args.limit, timeout_s=args.timeout, require_custom_kernel=args.require_custom_kernel)


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite and print its summary; 0 when every problem has a record."""
    options = options_from_args(args)
    records, summary = run_suite(list(args.problems), options, log=lambda s: print(s, flush=True))
    print(summary.format_table())
    print(f"{len(records)} record(s) in {options.jsonl}")
    return 0
