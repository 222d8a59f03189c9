"""``tpu-kernel-records calibrate``: the tolerance calibration (``sweeps.calibration``), in pieces.

A run grades what the trials file lacks (``--resume``) until ``--max-minutes`` have passed, then writes the
report from every trial the file holds; ``--report-only`` writes it without grading. For a long run in the
background on a shared machine::

    nohup nice -n 19 tpu-kernel-records calibrate --resume --max-minutes 150 --quiet > calibration.log 2>&1 &

On N cores, ``--workers N`` grades one slot group per Dask task on a ``LocalCluster`` (``--scheduler ADDRESS``: on an
existing cluster), appending every trial to the one trials file; without Dask, N runs at once, each on its share of
the seed groups (``--shard K/N``) with its own trials file, joined into the committed one with ``--merge`` (which
grades nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli.rubric import EXIT_FAILED, EXIT_OK, EXIT_USAGE, isolation_allowed, write_atomic
from ..grading.candidates import CandidateSpecError, resolve
from ..sandbox.isolation import CHOICES
from ..grading.runner import DEFAULT_TIME_LIMIT_S


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``calibrate`` to ``tpu-kernel-records``."""
    from ..sweeps.calibration import (HELD_OUT_FIRST_SEED, KERNEL_SEEDS, KERNELS, REPORT_PATH, SLOT_GROUP,
                                       TRIALS_PATH)

    p = subparsers.add_parser(
        "calibrate", help="calibrate the tolerance: needed k of correct candidates over many seeds",
        description=f"Measure the needed k of the correct built-ins (or the --candidate ones) at the full level on "
                    f"N calibration seeds (0..N-1) and N held-out seeds ({HELD_OUT_FIRST_SEED}..): each trial runs "
                    f"the checks that judge against the float64 truth, on full-level problems (seeds in groups "
                    f"of {SLOT_GROUP} share the shapes and flags of the group's first seed, each drawing its own "
                    f"values, so compiled programs recur), a built-in in this process and a file or module "
                    f"candidate in its sandbox, on its seed's own slots. "
                    f"Trials are appended to --trials as they finish; the table of grading/tolerance.py is written "
                    f"to --markdown from every trial the file holds. Measured on CPU: numerics, not speed. Exit: 0 "
                    f"no false reject and held-out needs within the policy; 1 otherwise, or trials left to grade; "
                    f"2 usage.",
        epilog="Example, in pieces in the background: nohup nice -n 19 tpu-kernel-records calibrate --resume "
               "--max-minutes 150 --quiet > calibration.log 2>&1 &")
    p.add_argument("--seeds", type=int, default=200, metavar="N", help="seeds per set (default 200)")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME_OR_PATH",
                   help="a correct candidate (repeat); default every built-in of kind reference or correct-variant")
    p.add_argument("--kernels", action="store_true",
                   help=f"also the kernels {', '.join(KERNELS)} (interpret mode on CPU), on their first "
                        f"--kernel-seeds seeds of each set")
    p.add_argument("--kernel-seeds", type=int, default=KERNEL_SEEDS, metavar="M",
                   help=f"seeds per set for the kernels (default {KERNEL_SEEDS})")
    p.add_argument("--quick", action="store_true", help="the quick level (toy shapes, for trying it out)")
    p.add_argument("--trials", type=Path, default=TRIALS_PATH, metavar="JSONL",
                   help=f"the trials file, one JSON line per trial (default {TRIALS_PATH})")
    p.add_argument("--resume", action="store_true", help="go on with the trials file: grade only what it lacks")
    p.add_argument("--max-minutes", type=float, metavar="MINUTES",
                   help="start no trial after this many minutes; the report covers what the file holds")
    p.add_argument("--report-only", action="store_true", help="grade nothing: write the report from the trials file")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                   help=f"grade only the seed groups g = (s mod 1000) // {SLOT_GROUP} with g mod N == K (both "
                        f"sets): N runs at once, one per core, each with its own --trials file, joined afterwards "
                        f"with --merge (default 0/1: all)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSONL",
                   help="grade nothing: add to --trials the trials of these files (other shards) that it lacks, "
                        "then write the report")
    p.add_argument("--markdown", type=Path, default=REPORT_PATH, metavar="PATH",
                   help=f"the report (default {REPORT_PATH})")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the summary (sweeps.calibration_report.summary)")
    p.add_argument("--timeout", dest="time_limit", type=float, default=DEFAULT_TIME_LIMIT_S, metavar="SECONDS",
                   help=f"wall-clock limit of a sandboxed candidate's worker per trial (default {DEFAULT_TIME_LIMIT_S:g})")
    p.add_argument("--isolation", choices=CHOICES, default="auto",
                   help="where a file or module candidate's worker runs (as for grade); built-ins run in-process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="grade on a Dask LocalCluster of N worker processes, one task per slot group (default 0: "
                        "serially in this process)")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="grade on an existing Dask cluster (tcp://host:8786), one task per slot group")
    p.set_defaults(func=_calibrate)


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N, got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return k, n


def _calibrate(args: argparse.Namespace) -> int:
    from ..sweeps import calibration as cal
    from ..sweeps import calibration_report

    level = "quick" if args.quick else "full"
    if args.seeds < 1 or args.kernel_seeds < 0 or (args.max_minutes is not None and args.max_minutes <= 0):
        print("tpu-kernel-records calibrate: --seeds must be >= 1, --kernel-seeds >= 0, --max-minutes > 0",
              file=sys.stderr)
        return EXIT_USAGE
    if args.workers < 0 or ((args.workers or args.scheduler) and args.max_minutes is not None):
        print("tpu-kernel-records calibrate: --workers must be >= 0, and --max-minutes runs serially (on Dask, stop "
              "the run at any time and go on with --resume)", file=sys.stderr)
        return EXIT_USAGE
    said: list[str] = []  # what this command met (a source's cut-off line, a budget run out): stderr only
    if args.report_only or args.merge:
        try:
            if args.merge:
                added, said = cal.merge(args.trials, args.merge)
                print(f"tpu-kernel-records calibrate: {added} trials added to {args.trials}", file=sys.stderr)
            trials, notes = cal.read_trials(args.trials, level)
        except (OSError, ValueError) as e:
            print(f"tpu-kernel-records calibrate: {e}", file=sys.stderr)
            return EXIT_USAGE
        remaining = 0
    else:
        try:
            cands = [resolve(c) for c in (args.candidate or cal.correct_candidates())]
            cands += [resolve(k) for k in cal.KERNELS if args.kernels and k not in {c.name for c in cands}]
        except CandidateSpecError as e:
            print(f"tpu-kernel-records calibrate: {e}", file=sys.stderr)
            return EXIT_USAGE
        if not isolation_allowed(args.isolation, [c for c in cands if cal.BUILTIN.get(c.name) is not c]):
            return EXIT_USAGE
        cal.compute_on_cpu()
        tasks = cal.calibration_tasks(args.seeds, [c.name for c in cands], args.kernel_seeds, shard=args.shard)
        try:
            done = cal.run(tasks, level=level, out=args.trials, resume=args.resume, progress=not args.quiet,
                           budget_s=None if args.max_minutes is None else 60 * args.max_minutes,
                           time_limit_s=args.time_limit, isolation=args.isolation, workers=args.workers,
                           scheduler=args.scheduler)
        except (FileExistsError, ValueError) as e:
            print(f"tpu-kernel-records calibrate: {e}", file=sys.stderr)
            return EXIT_USAGE
        said, remaining = done.notes, done.remaining
        if remaining:
            said = [*said, f"{remaining} of {len(tasks)} trials not graded yet (the --max-minutes budget ran "
                             f"out, or a slot group failed twice); `tpu-kernel-records calibrate --resume` goes on"]
        # The report is the file's, as --report-only reads it: its trials in its order, with its own notes.
        trials, notes = cal.read_trials(args.trials, level)
    for note in [*said, *notes]:
        print(f"tpu-kernel-records calibrate: {note}", file=sys.stderr)
    table = calibration_report.report(trials, level=level, notes=notes)
    print(table, end="")
    if args.markdown:
        write_atomic(args.markdown, table)
    result = calibration_report.summary(trials)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    pol, held = result["policy"], result["held_out_largest"]
    rejects = sum(e["rejects"] for which in result["sets"].values() for e in which.values())
    ok = not remaining and rejects == 0 and held["forward"] <= pol["forward"] and held["gradient"] <= pol["gradient"]
    return EXIT_OK if ok else EXIT_FAILED
