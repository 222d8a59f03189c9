#!/usr/bin/env python3
"""Time the correctness rubric per candidate: one scorecard, worker start and every compile included.

    python scripts/time_rubric.py                          # reference, flash-style, pallas, flash (full level)
    python scripts/time_rubric.py --candidate pallas --seed 3
    python scripts/time_rubric.py --level quick --seeds 2
    python scripts/time_rubric.py --candidate reference --features none    # the base contract alone

Each candidate is timed in a fresh Python process, so the figure includes everything a first grade
costs: the grader's float64 truth and reference baselines for the seed's problems, the candidate's
worker process start (``grading.rubric.grade`` runs every candidate in its own worker) and every XLA
compilation. With ``--seeds N`` the candidate is graded on N seeds by one worker
(``grading.rubric.grade_seeds``), each seed drawing new shapes.

Targets on a 2-core CPU: full level, ``reference`` <= 20 s on the base contract (``--features none``) and
<= 30 s with every feature (issue 50), ``pallas`` in interpret mode <= 90 s (issue 24). This is a measurement,
not a test: the wall time depends on the machine's load, which is printed with it, as are the CPU seconds the
grade took (the grader's process and the candidate's worker together), which depend on it less (interpret mode
says nothing about kernel speed on an accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from tpu_kernel_records_tools.grading import rubric
t_import = time.perf_counter() - t0
name, level, first, seeds, features = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
features = None if features == "all" else [f for f in features.split(",") if f and f != "none"]
t = time.perf_counter()
cards = rubric.grade_seeds(name, list(range(first, first + seeds)), level=level, features=features)
total = time.perf_counter() - t
print(json.dumps({"candidate": name, "import_s": t_import, "total_s": total, "seeds": seeds,
                  "passed": [c.passed for c in cards], "failed": [c.failed for c in cards],
                  "error": [c.error for c in cards]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidate", action="append", default=[],
                   help="candidate to time (repeat); default: reference, flash-style, pallas, flash")
    p.add_argument("--level", choices=("full", "quick"), default="full")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--seeds", type=int, default=1, help="seeds graded by one worker (default 1)")
    p.add_argument("--features", default="all", metavar="LIST",
                   help="features graded: 'all' each candidate declares (default), 'none', or a comma-separated list")
    args = p.parse_args(argv)
    names = args.candidate or ["reference", "flash-style", "pallas", "flash"]
    print(f"level={args.level} features={args.features} seeds={args.seed}..{args.seed + args.seeds - 1} "
          f"cpus={os.cpu_count()} "
          f"load_average={os.getloadavg()}")
    for name in names:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run([sys.executable, "-c", CHILD, name, args.level, str(args.seed), str(args.seeds),
                               args.features],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: child failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            continue
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        status = "passed" if all(r["passed"]) else f"FAILED {r['failed']} {[e for e in r['error'] if e]}"
        print(f"{name:16s} {r['total_s']:7.1f} s for {r['seeds']} scorecard(s) (worker start and compiles "
              f"included; grader import {r['import_s']:.1f} s more), {cpu:.1f} CPU-s in all, {status}", flush=True)
    print(f"load_average={os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
