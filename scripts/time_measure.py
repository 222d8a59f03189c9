#!/usr/bin/env python3
"""Time the main job: ``tpu-kernel-records measure`` as a whole process, as a new user runs it.

    python scripts/time_measure.py                       # the platform's profile (cpu here), once
    python scripts/time_measure.py --runs 3 -- --profile tiny
    python scripts/time_measure.py --record scripts/time_measure.json    # the figures docs/RUNBOOK.md states

It times the checkout this script is in (a fresh clone: ``git clone``, then run its copy). Each run is a fresh
process without a persistent JAX compilation cache, in its own temporary folder
(removed afterwards), so the figure includes the imports, the benchmark, every compile and the rubric's
workers. It prints, per run, the wall seconds and the CPU seconds (user + system of the process and every
process it started: the rubric's workers included), then the median of each. This is a measurement, not a
test: on a shared machine the wall time grows with the load (printed beside it); the CPU seconds much less.
The cpu profile's target (issue 50) is 3 minutes of wall time on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent  # the checkout timed: this script's


def time_command(args_in: Callable[[Path], list[str]], label: str = "measure",
                 module: str = "tpu_kernel_records_tools", in_checkout: bool = False) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this run's children) and the exit status of one ``python -m module`` run (by
    default ``tpu-kernel-records``) of ``args_in(folder)``, with a fresh temporary ``folder`` (removed afterwards)
    as its working directory, or the checkout (``in_checkout``)."""
    folder = Path(tempfile.mkdtemp(prefix="time-command-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}  # as a new user's
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", module, *args_in(folder)], cwd=REPO if in_checkout else folder,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0:
        print(f"{label} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def time_runs(command: list[str], runs: int, record: Path | None, args_in: Callable[[Path], list[str]],
              **command_kwargs) -> int:
    """Time ``runs`` runs of ``command`` (its arguments ``args_in(folder)``, run as ``time_command`` runs them),
    print each and the medians, write them to ``record`` (JSON) if given; 1 if a run failed, else 0."""
    load_before = [round(x, 1) for x in os.getloadavg()]
    print(f"{' '.join(command)}: cpus={os.cpu_count()} load_average={load_before}")
    walls, cpus, codes = [], [], []
    for n in range(runs):
        wall, cpu, code = time_command(args_in, " ".join(command), **command_kwargs)
        walls.append(wall)
        cpus.append(cpu)
        codes.append(code)
        print(f"run {n + 1}: {wall:.1f} s wall, {cpu:.1f} CPU-s (user + system, every process), exit {code}, "
              f"load_average={os.getloadavg()}", flush=True)
    print(f"median of {runs}: {statistics.median(walls):.1f} s wall, {statistics.median(cpus):.1f} CPU-s")
    if record is not None:
        from tpu_kernel_records_tools.sweeps.calibration import machine

        doc = {"command": command, "machine": machine(), "load_average_before": load_before,
               "load_average_after": [round(x, 1) for x in os.getloadavg()], "exit_codes": codes,
               "wall_s": [round(w, 1) for w in walls], "cpu_s": [round(c, 1) for c in cpus],
               "median_wall_s": round(statistics.median(walls), 1), "median_cpu_s": round(statistics.median(cpus), 1)}
        record.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if any(codes) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Arguments after -- go to measure (e.g. -- --profile tiny).")
    p.add_argument("--runs", type=int, default=1, help="runs to time (default 1)")
    p.add_argument("--record", type=Path, metavar="JSON",
                   help="also write the figures (machine, load, each run, medians) to this file")
    p.add_argument("extra", nargs="*", help="arguments for measure, after --")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return time_runs(["tpu-kernel-records", "measure", *args.extra], args.runs, args.record,
                     lambda folder: ["measure", "--out", str(folder / "run"), "--quiet", *args.extra])


if __name__ == "__main__":
    sys.exit(main())
