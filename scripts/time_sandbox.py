#!/usr/bin/env python3
"""Time the grading sandbox: a worker's start (interpreter + JAX import), loading a candidate, and a
whole default grade (full level) of pure-JAX candidates, each in a fresh grader process.

    python scripts/time_sandbox.py                          # reference; 3 bare worker starts
    python scripts/time_sandbox.py --candidate zeros --level quick --starts 5

A measurement, not a test: the wall-clock figures depend on the machine's load, printed with them;
the CPU seconds (grader process, and the worker's, reaped) depend on it much less, and on an idle
machine the grade's wall time is about their sum (grader and worker take turns). Target on a 2-core
CPU: a default grade of a pure-JAX candidate <= 60 s including the worker's start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from tpu_kernel_records_tools.grading import rubric, runner

from tpu_kernel_records_tools.sandbox import sandbox
name, level, starts = sys.argv[1], sys.argv[2], int(sys.argv[3])
start_s = []
for _ in range(starts):  # a bare worker: launch until it has imported JAX and said hello
    box = sandbox.Sandbox()
    t = time.perf_counter(); box.start(); box.wait_ready(); start_s.append(time.perf_counter() - t); box.close()
load = []
original = runner.Runner.start
def timed_start(self):
    error = original(self); load.append(self.startup_s); return error
runner.Runner.start = timed_start
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
c0, w0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
t = time.perf_counter(); card = rubric.grade(name, level=level); grade_s = time.perf_counter() - t
print(json.dumps({"candidate": name, "level": level, "worker_start_s": start_s, "start_and_load_s": load,
                  "grade_s": grade_s, "grader_cpu_s": cpu(resource.RUSAGE_SELF) - c0,
                  "worker_cpu_s": cpu(resource.RUSAGE_CHILDREN) - w0,
                  "passed": card.passed, "failed": card.failed, "error": card.error}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidate", action="append", default=[], help="candidate to time (repeat); default reference")
    p.add_argument("--level", default="full", choices=("full", "quick"))
    p.add_argument("--starts", type=int, default=3, help="bare worker starts to time first (default 3)")
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    for name in args.candidate or ["reference"]:
        proc = subprocess.run([sys.executable, "-c", CHILD, name, args.level, str(args.starts)],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{name}: failed ({proc.returncode}): {proc.stderr[-1000:]}")
            continue
        r = json.loads(lines[-1])
        starts = ", ".join(f"{s:.2f}" for s in r["worker_start_s"])
        print(f"{name} ({r['level']}): worker start {starts} s; start+load in the grade "
              f"{r['start_and_load_s'][0]:.2f} s; whole grade {r['grade_s']:.1f} s wall, CPU {r['grader_cpu_s']:.1f} s "
              f"grader + {r['worker_cpu_s']:.1f} s worker; passed={r['passed']} "
              f"failed={r['failed']} error={r['error']}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
