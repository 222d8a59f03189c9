"""``tpu-kernel-records calibrate``: the tolerance calibration (``grading.calibration``) as a sweep."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli.rubric import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, add_sweep_options, isolation_allowed, run_sweep,
                         write_atomic)
from ..grading.candidates import CandidateSpecError, resolve
from ..grading.isolation import CHOICES
from ..grading.runner import DEFAULT_TIME_LIMIT_S


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``calibrate`` to ``tpu-kernel-records``."""
    from ..grading.calibration import HELD_OUT_FIRST_SEED

    p = subparsers.add_parser(
        "calibrate", help="calibrate the tolerance: needed k of correct candidates over many seeds",
        description=f"Grade the correct built-ins (or the --candidate ones) at the full level on N calibration "
                    f"seeds (0..N-1) and N held-out seeds ({HELD_OUT_FIRST_SEED}..), as one sweep (a Dask "
                    f"cluster by default; --workers 0 serially), and print the table of grading/tolerance.py: "
                    f"needed k per candidate and set, false rejects, and the k the rule gives. Measured on "
                    f"CPU: numerics, not speed. Exit: 0 no false reject and held-out needs within the policy; "
                    f"1 otherwise or a trial not graded; 2 usage.",
        epilog="Example: tpu-kernel-records calibrate --seeds 200 --trials calibration.jsonl --resume "
               "--markdown calibration.md")
    p.add_argument("--seeds", type=int, default=200, metavar="N", help="seeds per set (default 200)")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME_OR_PATH",
                   help="a correct candidate (repeat); default every built-in of kind reference or correct-variant")
    p.add_argument("--quick", action="store_true", help="the quick level (toy shapes, for trying it out)")
    p.add_argument("--timeout", dest="time_limit", type=float, default=DEFAULT_TIME_LIMIT_S, metavar="SECONDS",
                   help=f"wall-clock limit of each scorecard's worker (default {DEFAULT_TIME_LIMIT_S:g})")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="also write the table here")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the summary (grading.calibration.summary)")
    p.add_argument("--isolation", choices=CHOICES, default="auto",
                   help="where each worker runs (as for grade): auto is bubblewrap for a file or module candidate")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sweep_options(p)
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from ..grading.calibration import calibration_tasks, correct_candidates, report, summary

    if args.seeds < 1:
        print("tpu-kernel-records calibrate: --seeds must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        cands = [resolve(c) for c in (args.candidate or correct_candidates())]
    except CandidateSpecError as e:
        print(f"tpu-kernel-records calibrate: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not isolation_allowed(args.isolation, cands):
        return EXIT_USAGE
    names = [c.name for c in cands]
    done = run_sweep(args, calibration_tasks(args.seeds, names), "calibration")
    if done is None:
        return EXIT_USAGE
    table = report(done.trials, done.failed, "quick" if args.quick else "full")
    print(table, end="")
    if args.markdown:
        write_atomic(args.markdown, table)
    result = summary(done.trials)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    pol, held = result["policy"], result["held_out_largest"]
    rejects = sum(e["rejects"] for which in result["sets"].values() for e in which.values())
    ok = not done.failed and rejects == 0 and held["forward"] <= pol["forward"] and held["gradient"] <= pol["gradient"]
    return EXIT_OK if ok else EXIT_FAILED
