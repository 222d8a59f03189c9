#!/usr/bin/env python3
"""Time the full correctness rubric per candidate: first grade (compiles) and warm grades (later seeds).

    python scripts/time_rubric.py                       # reference, rounded-probs, online-softmax, pallas, flash
    python scripts/time_rubric.py --candidate pallas --warm 3

Each candidate is timed in a fresh Python process, so the first figure includes every XLA compilation
the rubric triggers for it (its own executables and the reference baseline's). Targets (2-core CPU):
<= 10 s for a pure-JAX candidate, <= 30 s for an interpret-mode Pallas one. This is a measurement, not
a test; the figures depend on the machine's load, which is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from grading import rubric
t_import = time.perf_counter() - t0
name, warm = sys.argv[1], int(sys.argv[2])
t = time.perf_counter(); card = rubric.grade(name, seed=0); first = time.perf_counter() - t
warm_s = []
for seed in range(1, warm + 1):
    t = time.perf_counter(); rubric.grade(name, seed=seed); warm_s.append(time.perf_counter() - t)
print(json.dumps({"candidate": name, "import_s": t_import, "first_s": first, "warm_s": warm_s,
                  "passed": card.passed, "failed": card.failed, "error": card.error}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidate", action="append", default=[],
                   help="candidate to time (repeat); default: the correct built-ins")
    p.add_argument("--warm", type=int, default=2, help="warm grades (seeds 1..N) after the first (default 2)")
    args = p.parse_args(argv)
    names = args.candidate or ["reference", "rounded-probs", "online-softmax", "pallas", "flash"]
    print(f"cpus={os.cpu_count()} load_average={os.getloadavg()}")
    for name in names:
        proc = subprocess.run([sys.executable, "-c", CHILD, name, str(args.warm)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: child failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        warm = ", ".join(f"{w:.2f}" for w in r["warm_s"]) or "-"
        status = "passed" if r["passed"] else f"FAILED {r['failed']} {r['error'] or ''}"
        print(f"{name:16s} first grade {r['first_s']:6.1f} s (import {r['import_s']:.1f} s), "
              f"warm grades [{warm}] s, {status}")
    print(f"load_average={os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
