"""``tpu-kernel-records``: one CLI above everything it calls.

``measure`` (the measurement job, ``measure.run``), ``grade`` and ``power`` (the correctness rubric,
``cli.rubric``; ``tpu-kernel-rubric`` is their alias), ``calibrate`` (the tolerance calibration,
``cli.calibrate``), ``build``, ``verify`` and ``publish`` (the release, ``cli.release``), ``submit`` and
``review`` (a run proposed as a Hub pull request, and its review: ``cli.contribute``) and ``plan``.
``python -m tpu_kernel_records_tools`` is the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ..cli import calibrate, contribute, plan, release, rubric
from ..cli.exits import exit_with
from ..grading import contracts
from ..bench.cases import PROFILES, SCOPES
from ..sandbox import candidate_files
from ..measure import supervise
from ..records.schema import VERSION

EXIT_STATUS = ("exit status: 0 ok; 1 refused or failed (a refused build, a verify problem, a refused publish, "
               "a failed grade); 2 usage (bad arguments, an --out folder that exists); publish's Hub failures: "
               f"{release.PUBLISH_STATUS}.")


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def add_measure_parser(subparsers: "argparse._SubParsersAction") -> None:
    """Add the ``measure`` subcommand."""
    p = subparsers.add_parser(
        "measure", help="measure the kernels on this machine and write one run folder",
        description="Benchmark (every synchronized sample kept), grade (rubric scorecards) and record "
                    "the environment of this machine into DIR: environment.json, correctness.json, "
                    "benchmark.json, gzipped StableHLO per case and manifest.json (sha256 of every "
                    "file), validated against the shipped JSON Schemas and written atomically. On a "
                    "CPU, Pallas runs in interpret mode: those timings say nothing about kernel speed. A CPU "
                    "run (profiles cpu and tiny) is a demonstration and an interpret-mode record: it grades the "
                    "measured kernels at the quick level, on the base contract and the features their timed rows use, "
                    "which shows that their path runs (what it costs, "
                    "measured: docs/RUNBOOK.md); the tpu-v5e and gpu profiles grade them at the full level.")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="run folder to create (must not exist); default runs/<run_id>/")
    p.add_argument("--profile", choices=sorted(PROFILES),
                   help="shapes and defaults: cpu (default on CPU), tpu-v5e (on TPU), gpu (on GPU), tiny")
    p.add_argument("--warmups", type=_count(0), metavar="N", help="untimed calls per case (profile default 5; cpu 2)")
    p.add_argument("--samples", type=_count(1), metavar="N", help="timed samples per case (profile default 20; cpu 10)")
    p.add_argument("--scopes", nargs="+", choices=SCOPES, metavar="SCOPE",
                   help=f"any of {', '.join(SCOPES)}; default the profile's: "
                        + "; ".join(f"{name} {' '.join(p.scopes) if p.scopes != SCOPES else f'all {len(SCOPES)}'}"
                                    for name, p in PROFILES.items()))
    p.add_argument("--seed", type=int, default=0, help="inputs, bootstrap CIs and the rubric (default 0)")
    p.add_argument("--power-seeds", type=_count(0), default=0, metavar="N",
                   help="seeds for the rubric's grader-power summary (default 0: none)")
    p.add_argument("--known-bad", action=argparse.BooleanOptionalAction, default=None,
                   help="also grade every known-bad built-in at the quick level, about 20 s each on a "
                        "2-core CPU (default: yes on the tpu-v5e and gpu profiles, no on cpu and tiny)")
    p.add_argument("--candidate", metavar="SPEC",
                   help="measure a submitted kernel instead (path/to/file.py:function or module:function): "
                        "exported in a sandbox per call signature, its programs graded and timed beside XLA "
                        "and the flash kernel at the profile's flash and model shapes (needs --name)")
    p.add_argument("--candidate-dir", type=Path, metavar="DIR",
                   help="with --candidate: the folder of a kernel that spans several files, bound read-only into "
                        "the exporter's sandbox (only the candidate file itself otherwise)")
    candidate_files.add_arguments(p)
    p.add_argument("--case-timeout", type=float, default=supervise.DEFAULT_CASE_BUDGET_S, metavar="SECONDS",
                   help=f"with --candidate: seconds the submitted program may take at one timed case (compile, "
                        f"warm-ups and samples); past it the measuring process is killed, the case refused in one "
                        f"line and no run written (default {supervise.DEFAULT_CASE_BUDGET_S:g})")
    contracts.add_flags(p, lambda c: f"with --candidate: the kernel follows the {c.name} contract ({c.function}); "
                                     f"graded by the {c.name} rubric and timed at the profile's cases of that contract "
                                     f"beside its implementations")
    p.add_argument("--name", help="the submitted kernel's name in the records (a-z, 0-9, '.', '_', '-')")
    p.add_argument("--level", choices=("full", "quick"), default="full",
                   help="the rubric level a submitted kernel is graded at (default full)")
    p.add_argument("--isolation", choices=("auto", "bubblewrap", "process"), default="auto",
                   help="where a submitted kernel's exporter runs (default auto: bubblewrap)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or summary table")
    p.set_defaults(func=_measure)


def _measure(args: argparse.Namespace) -> int:
    from ..measure.run import RUNS_DIR, run_measure, run_submitted

    contract = contracts.get(contracts.flagged(args))
    if args.candidate is not None or args.name is not None or contract.flag:
        if not (args.candidate and args.name):
            raise ValueError("--candidate and --name go together" +
                             (f" (and {contract.flag} with them)" if contract.flag else ""))
        from ..sandbox import memcg, syscalls
        from ..grading.export import ProgramRefused
        candidate_files.apply_arguments(args)
        if os.environ.get(supervise.STATUS_FD) is None:  # the measuring runs in a child this process watches
            try:
                return supervise.supervised(["measure", *args.raw_argv],
                                            leftovers=[Path(args.out).parent if args.out else RUNS_DIR])
            except supervise.Refused as error:
                print(f"tpu-kernel-records measure: refused: {error}", file=sys.stderr)
                return 1
        for warning in (memcg.warning("tpu-kernel-records measure"), syscalls.warning("tpu-kernel-records measure")):
            if warning:
                print(warning, file=sys.stderr)
        try:
            out = run_submitted(args.candidate, args.name, args.out, profile=args.profile, warmups=args.warmups,
                                samples=args.samples, seed=args.seed, level=args.level, isolation=args.isolation,
                                progress=not args.quiet, candidate_dir=args.candidate_dir,
                                case_budget_s=args.case_timeout,
                                contract=contract.name)
        except ProgramRefused as error:
            print(f"tpu-kernel-records measure: refused: {error}", file=sys.stderr)
            return 1
        print(out)
        return 0

    out = run_measure(args.out, profile=args.profile, warmups=args.warmups, samples=args.samples,
                      scopes=args.scopes, seed=args.seed, power_seeds=args.power_seeds,
                      known_bad=args.known_bad, progress=not args.quiet)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpu-kernel-records",
        description="Attention kernels measured on real hardware: measure a run, then build, verify "
                    "and publish the dataset release.", epilog=EXIT_STATUS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_measure_parser(subparsers)
    rubric.register(subparsers)
    calibrate.register(subparsers)
    release.register(subparsers)
    contribute.register(subparsers)
    plan.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (``EXIT_STATUS``)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.raw_argv = raw[raw.index(args.command) + 1:] if args.command in raw else raw
    try:
        return int(args.func(args) or 0)
    except (FileExistsError, ValueError) as error:
        print(f"tpu-kernel-records {args.command}: error: {error}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``tpu-kernel-records`` console script: :func:`main`, then ``cli.exits.exit_with`` its status."""
    exit_with(main, None, "tpu-kernel-records")


if __name__ == "__main__":
    entry()
