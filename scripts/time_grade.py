#!/usr/bin/env python3
"""Time the documented grades of the example kernel as a new user runs them, each a whole process.

    python scripts/time_grade.py                                 # the quick and the full grade, once each
    python scripts/time_grade.py --record scripts/time_grade.json   # the figures README and SUBMITTING state

Each grade is ``tpu-kernel-records grade --candidate examples/simple_attention.py:attention [--quick]`` (what
``tpu-kernel-rubric`` runs) in a fresh process without a persistent JAX compilation cache, in its own temporary
folder, so the figure includes the imports, the float64 truth, the sandboxed worker and every compile. It prints
wall seconds and CPU seconds (user + system of every process it started); on a shared machine the wall time grows
with the load, the CPU seconds much less. This is a measurement, not a test (``tests/test_doc_facts.py`` holds
the documents to what it recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from time_measure import REPO, time_command

EXAMPLE = "examples/simple_attention.py:attention"
LEVELS = {"quick": ["--quick"], "full": []}


def _grade(folder: Path, level: str) -> list[str]:
    shutil.copytree(REPO / "examples", folder / "examples")
    return ["grade", "--candidate", EXAMPLE, "--quiet", *LEVELS[level]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="quick,full", help="comma-separated levels to time (default quick,full)")
    p.add_argument("--record", type=Path, metavar="JSON", help="also write the figures to this file")
    args = p.parse_args(argv)
    levels = args.levels.split(",")
    if set(levels) - set(LEVELS):
        p.error(f"--levels: choose from {', '.join(LEVELS)}")
    from tpu_kernel_records_tools.sweeps.calibration import machine

    record: dict = {"command": ["tpu-kernel-rubric", "--candidate", EXAMPLE], "machine": machine(),
                    "load_average_before": [round(x, 1) for x in os.getloadavg()], "levels": {}}
    for level in levels:
        wall, cpu, code = time_command(lambda folder, level=level: _grade(folder, level), label=f"grade {level}")
        print(f"{level}: {wall:.1f} s wall, {cpu:.1f} CPU-s (user + system, every process), exit {code}", flush=True)
        record["levels"][level] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit_code": code}
    record["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    if args.record is not None:
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if any(v["exit_code"] for v in record["levels"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
