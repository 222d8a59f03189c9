#!/usr/bin/env python3
"""Time the default test run: ``pytest`` in this checkout as a whole process, as README.md tells a new user to.

    python scripts/time_tests.py                                    # once
    python scripts/time_tests.py --record scripts/time_tests.json   # the figures README.md and DEVELOPING state

Run it in a fresh clone (its venv installed as README.md says) on an otherwise idle machine. It prints, per run,
the wall seconds and the CPU seconds (user + system of pytest, its xdist workers and every process they start),
then the medians. This is a measurement, not a test; the target (docs/DEVELOPING.md) is 5 minutes of wall time
on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_measure import time_runs  # noqa: E402  (the sibling script's timing, for pytest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="runs to time (default 1)")
    p.add_argument("--record", type=Path, metavar="JSON",
                   help="also write the figures (machine, load, each run, medians) to this file")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return time_runs(["pytest"], args.runs, args.record, lambda folder: [], module="pytest", in_checkout=True)


if __name__ == "__main__":
    sys.exit(main())
