"""`kernelfuse eval PROBLEM CANDIDATE`: the judge's command line (wired into kernelfuse.cli as a subcommand).

Exit codes: 0 built and correct; 1 built but incorrect, crashed, hung, rejected by a defence or implausibly fast;
2 usage error or unusable problem file; 3 not built (no code, syntax/import error, extension build failure,
constructor failure); 4 no CUDA device (parsed, imported and checked only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernelfuse.errors import KernelfuseError
from kernelfuse.judge.evaluate import evaluate
from kernelfuse.judge.options import BASELINES_HELP, DEFAULT_BASELINES, EvalOptions, parse_baselines
from kernelfuse.judge.verdict import EXIT_USAGE
from kernelfuse.verify import POLICIES

EPILOG = __doc__.split("\n\n", 1)[1]


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the eval subcommand's arguments to `parser`."""
    parser.description = "Judge a ModelNew candidate: does it build, is it correct, how fast against eager and " \
                         "torch.compile. CANDIDATE is a .py file defining ModelNew, or a text reply whose last " \
                         "fenced python block is used."
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("problem", type=Path, help="problem file (Model, get_inputs, get_init_inputs)")
    parser.add_argument("candidate", type=Path, help="candidate: Python file or model reply with a ```python block")
    parser.add_argument("--trials", type=int, default=5, help="correctness trials with fresh inputs (default 5)")
    parser.add_argument("--precision", choices=list(POLICIES), default="strict",
                        help="tolerance policy: strict 1e-4 (default), tf32 / bf16 1e-2")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="also write the verdict as JSON")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S",
                        help="wall-clock limit for building, checking and timing (default 900 s)")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per version (default 20; median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls per version (default 3)")
    parser.add_argument("--baselines", default=",".join(DEFAULT_BASELINES), help=BASELINES_HELP)
    parser.add_argument("--require-custom-kernel", action="store_true",
                        help="fail (exit 1, 'no custom kernel ran') a candidate whose forward runs no kernel of its "
                             "own: the profiler's kernel accounting on a GPU, the static bypass signals without one")
    parser.add_argument("--seed", type=int, default=42, help="seed for weights and inputs (default 42)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default) or cpu (pure-torch candidates; for testing the judge)")
    parser.add_argument("--float64", choices=["always", "auto", "never"], default="always",
                        help="compare with a float64 reference: always (default), auto, never")
    parser.add_argument("--mode", choices=["train", "eval", "both"], default="train",
                        help="train: models as constructed, each submodule's train/eval flag as built (default, "
                             "the benchmark's way; no .train() call); eval: .eval() on both; both: correctness "
                             "judged in each")
    parser.add_argument("--robust", action="store_true",
                        help="extra trials on standard-normal, x100 and all-negative inputs, reported in the verdict's "
                             "`robust` field (the main verdict is unchanged)")
    parser.add_argument("--input-sets", type=int, default=4, metavar="N",
                        help="distinct input sets the timing loop rotates over (default 4; fewer if memory is short)")
    parser.add_argument("--implausible-margin", type=float, default=0.5, metavar="F",
                        help="verdict 'implausible' when the median runtime is below F x the floor estimate "
                             "(default 0.5; 0 turns it off; below 0.8 x is always a warning)")
    parser.add_argument("--no-call-checks", dest="call_checks", action="store_false",
                        help="switch off the per-call checks against timing games (timed-call comparison, input "
                             "rotation, determinism, output type, device state): for measuring the judge's "
                             "overhead only, never for verdicts")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the child's work folder (log, outcome)")


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    """EvalOptions from parsed arguments; ValueError for inconsistent values."""
    baselines = parse_baselines(args.baselines)
    return EvalOptions(trials=args.trials, precision=args.precision, timeout_s=args.timeout, baselines=baselines,
                       seed=args.seed, timing_reps=args.reps, warmup=args.warmup, device=args.device,
                       float64=args.float64, keep_workdir=args.keep_workdir, mode=args.mode, robust=args.robust,
                       input_sets=args.input_sets, implausible_margin=args.implausible_margin,
                       call_checks=args.call_checks, require_custom_kernel=args.require_custom_kernel)


def run_eval(args: argparse.Namespace) -> int:
    """Run the judge, print the table (and write JSON); return the exit code documented above."""
    try:
        opts = options_from_args(args)
        verdict = evaluate(args.problem, args.candidate, opts)
    except ValueError as err:
        print(f"kernelfuse eval: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KernelfuseError as err:
        print(f"kernelfuse eval: {err}", file=sys.stderr)
        return err.exit_code
    print(verdict.format_table())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(verdict.to_json(), indent=2) + "\n")
        print(f"\nverdict written to {args.json}")
    return verdict.exit_code


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m kernelfuse.judge.cli`), equivalent to `kernelfuse eval`."""
    parser = argparse.ArgumentParser(prog="kernelfuse eval")
    add_eval_arguments(parser)
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
