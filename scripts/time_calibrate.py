#!/usr/bin/env python3
"""Time the calibration of one slot group per set, serially and on a 2-worker Dask LocalCluster.

    python scripts/time_calibrate.py                              # reference, full level, seeds 0-4 and 1000-1004
    python scripts/time_calibrate.py --quick --candidate online-softmax --seeds 1
    python scripts/time_calibrate.py --record scripts/time_calibrate.json    # the figures docs/DEVELOPING.md states

Each run is ``tpu-kernel-records calibrate --seeds N`` as a whole process (``scripts/time_measure.py``'s
``time_command``: this checkout, a fresh temporary trials file, no persistent JAX compilation cache): first
serially, then with ``--workers 2``, where each slot group (the calibration seeds' and the held-out seeds')
is one Dask task. It prints the wall seconds and the CPU seconds (user + system of the command and its
Dask workers) of each. A measurement, not a test: on a shared machine the wall time grows with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from time_measure import time_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="seeds per set (default 5: one slot group of each)")
    p.add_argument("--candidate", action="append", default=[], help="candidate (repeat; default reference)")
    p.add_argument("--quick", action="store_true", help="the quick level")
    p.add_argument("--record", type=Path, metavar="JSON",
                   help="also write the figures (machine, load, each way's wall and CPU seconds) to this file")
    args = p.parse_args(argv)
    names = [x for name in (args.candidate or ["reference"]) for x in ("--candidate", name)]
    level = ["--quick"] if args.quick else []
    print(f"calibrate --seeds {args.seeds} {' '.join(names + level)}: cpus={os.cpu_count()} "
          f"load_average={os.getloadavg()}")
    codes, runs = [], {}
    load_before = [round(x, 1) for x in os.getloadavg()]
    for label, more in (("serially", []), ("on 2 Dask workers", ["--workers", "2"])):
        wall, cpu, code = time_command(lambda folder: ["calibrate", "--seeds", str(args.seeds), *names, *level,
                                                       "--trials", str(folder / "trials.jsonl"), "--markdown",
                                                       str(folder / "report.md"), "--quiet", *more], "calibrate")
        codes.append(code)
        runs["serial" if not more else "workers_2"] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
        print(f"{label}: {wall:.1f} s wall, {cpu:.1f} CPU-s (user + system, every process), exit {code}, "
              f"load_average={os.getloadavg()}", flush=True)
    if args.record is not None:
        from tpu_kernel_records_tools.sweeps.calibration import machine

        record = {"command": ["tpu-kernel-records", "calibrate", "--seeds", str(args.seeds), *names, *level],
                  "seeds_per_set": args.seeds, "candidates": args.candidate or ["reference"], "machine": machine(),
                  "load_average_before": load_before, "load_average_after": [round(x, 1) for x in os.getloadavg()],
                  "exit_codes": codes, **runs}
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
