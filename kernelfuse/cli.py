"""Command line: `kernelfuse optimize PROBLEM.py -o OUT.py` and `kernelfuse eval PROBLEM.py CANDIDATE`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from kernelfuse import __version__
from kernelfuse.errors import KernelfuseError, UsageError
from kernelfuse.judge.options import BASELINES_HELP, DEFAULT_BASELINES, parse_baselines

EPILOG = """exit codes (optimize): 0 file written (parts a stage failed on ship as the original ops: see the
  fallbacks); 2 bad problem file; 3 forward could not be traced; 4 the shipped file failed verification on the GPU.
  See `kernelfuse eval --help` for eval's codes."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelfuse",
        description="Turn a PyTorch model into a verified, faster one built from fused CUDA kernels.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kernelfuse {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="emit a fused, verified ModelNew file for a problem file",
                         description="Capture, plan, generate CUDA, emit ModelNew; on a GPU build, verify and "
                                     "benchmark it against eager and torch.compile.", epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    opt.add_argument("problem", type=Path, help="problem file defining Model, get_inputs, get_init_inputs")
    opt.add_argument("-o", "--output", type=Path, required=True, help="where to write the ModelNew file")
    opt.add_argument("--precision", choices=("strict", "tf32", "bf16"), default="strict",
                     help="numerics policy used to verify (default strict: fp32, atol=rtol=1e-4)")
    opt.add_argument("--trials", type=int, default=5, help="verification trials with fresh inputs (default 5)")
    opt.add_argument("--no-compile-baseline", action="store_true", help="skip timing torch.compile in the report")
    opt.add_argument("--baselines", default=None, help=BASELINES_HELP)
    opt.add_argument("--require-custom-kernel", action="store_true",
                     help="the shipped file fails verification (exit 4) when its forward runs no kernel of its own")
    opt.add_argument("--cpu-only", action="store_true", help="do not use a GPU even if one is present")
    opt.add_argument("--json", type=Path, default=None, metavar="REPORT.json",
                     help="also write a machine-readable report (schema: README, 'optimize --json')")
    opt.add_argument("--no-rewrite", action="append", default=[], metavar="NAME",
                     help="switch off one rewrite rule (repeatable; the log names the rules that fired)")
    opt.add_argument("--no-rewrites", action="store_true", help="switch off every rewrite rule")
    opt.add_argument("--max-fusions", type=int, metavar="N", default=None,
                     help="fuse at most N kernels, anchors first, then generated kernels in graph order "
                          "(bisect a numerical failure to one fusion)")
    ev = sub.add_parser("eval", help="judge a ModelNew candidate (file or model reply) against its problem")
    try:
        from kernelfuse.judge.cli import add_eval_arguments
    except ImportError:  # pragma: no cover - the judge is part of the package; this guards partial installs
        add_eval_arguments = None
    if add_eval_arguments is not None:
        add_eval_arguments(ev)
    from kernelfuse.suite.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="optimize or judge a whole suite (KernelBench levels, folders)"))
    from kernelfuse.fuzz.cli import add_fuzz_arguments

    add_fuzz_arguments(sub.add_parser("fuzz", help="differential fuzzing: random models through the whole pipeline"))
    return parser


def main(argv: list[str] | None = None) -> int:
    # torch warns at import when NumPy is absent; kernelfuse does not use NumPy, so keep the output clean
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "fuzz":
            from kernelfuse.fuzz.cli import run_fuzz

            return run_fuzz(args)
        if args.command == "bench":
            from kernelfuse.suite.cli import run_bench

            return run_bench(args)
        from kernelfuse.judge.cli import run_eval

        return run_eval(args)
    except KernelfuseError as err:
        print(f"kernelfuse: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("kernelfuse: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a bug of ours: one line, the traceback on request
        if os.environ.get("KERNELFUSE_DEBUG"):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"kernelfuse: internal error: {type(err).__name__}: {first} (a kernelfuse bug: please report it; "
              "KERNELFUSE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and closed: not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at interpreter exit
        return 141


def check_paths(args: argparse.Namespace) -> None:
    """Usage errors found before any work starts: unreadable inputs, an output path that cannot be written."""
    from kernelfuse.load import check_output_path, read_source

    if getattr(args, "problem", None) is not None:
        read_source(args.problem)
    if args.command == "optimize":
        check_output_path(args.problem, args.output)
        if args.json is not None:
            check_output_path(args.problem, args.json)
    if args.command == "eval" and not args.candidate.is_file():
        what = "is a directory" if args.candidate.is_dir() else "no such file"
        raise UsageError(f"{args.candidate}: {what}; give the candidate ModelNew file or model reply to judge")


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _final_baselines(args: argparse.Namespace) -> tuple[str, ...]:
    """--baselines, else eager and torch.compile (eager alone with --no-compile-baseline)."""
    if args.baselines is None:
        return ("eager",) if args.no_compile_baseline else DEFAULT_BASELINES
    try:
        return parse_baselines(args.baselines)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _optimize(args: argparse.Namespace) -> int:
    from kernelfuse.pipeline import OptimizeOptions, describe_verdict, optimize_file

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    if args.max_fusions is not None and args.max_fusions < 0:
        raise UsageError("--max-fusions must be 0 or more")
    options = OptimizeOptions(
        precision=args.precision,
        trials=args.trials,
        use_gpu=False if args.cpu_only else None,
        no_rewrites=args.no_rewrites,
        max_fusions=args.max_fusions,
        disabled_rewrites=tuple(args.no_rewrite),
        final_baselines=_final_baselines(args),
        require_custom_kernel=args.require_custom_kernel,
    )
    result = optimize_file(args.problem, args.output, options, log=lambda s: print(s, flush=True))
    if args.json is not None:
        from kernelfuse.report import optimize_json

        args.json.write_text(json.dumps(optimize_json(result, str(args.problem), args.precision), indent=2) + "\n")
    if result.variants:
        print("\nvariants:")
        for v in result.variants:
            print(f"  {v.variant:12s} {describe_verdict(v.verdict)}")
    if result.cold_build_s is not None:
        print(f"extension build: cold {result.cold_build_s:.1f} s (all variants in parallel); "
              f"cached: see build_s in the table")
    if result.final is not None:
        print(f"\nshipped: {result.shipped}  ->  {result.output}")
        print(result.final.format_table())
        if not result.final.correct:
            print("kernelfuse: error: the shipped file failed verification", file=sys.stderr)
            return 4
    for note in result.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
