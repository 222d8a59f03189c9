"""A grader-power record: the correctness grader's power summary, measured on a CPU, as a run the builder
accepts (``source: "grader-power"``).

The summary is what ``tpu-kernel-rubric --power --json PATH`` writes (``{"power": {...}}``, or the bare
summary): every candidate graded on many seeds, false rejects of correct candidates and rejections of
known-bad ones, by check. Wrapped with the environment of the machine that ran the sweep, it becomes a
run folder with no benchmark cases and no scorecards; ``build`` carries it into data/ (its rows say
``source = "grader-power"``, and ``interpret = true`` on a CPU) and the card's power table is generated
from it. The grader's numerics are valid on a CPU; nothing in such a record is a kernel speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..records import rawio

SOURCE = "grader-power"
LABEL = ("Grader power: the correctness grader's false rejects and power on known-bad candidates, measured on "
         "this machine's CPU (Pallas candidates in interpret mode). The grader's numerics, not kernel speed.")


def read_power(path: Path) -> dict[str, Any]:
    """The power summary in ``path`` (``{"power": {...}}`` or the bare summary); ``ValueError`` if absent."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, *rawio.JSON_ERRORS) as e:
        raise ValueError(f"{path}: not a readable JSON power summary ({e})") from None
    power = doc.get("power", doc) if isinstance(doc, dict) else None
    if not isinstance(power, dict) or "candidates" not in power:
        raise ValueError(f"{path}: no grader-power summary (write one with tpu-kernel-rubric --power --json PATH)")
    return power


def power_documents(power: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The three documents of a grader-power run; ``environment`` as ``measure.environment.capture`` gives it."""
    run_id = environment["run_id"]
    env = {**environment, "source": SOURCE, "profile": SOURCE, "devices_used": 1,
           "notes": " ".join(filter(None, [LABEL, environment.get("notes")]))}
    common = {"format_version": 1, "run_id": run_id, "source": SOURCE}
    benchmark = {**common, "profile": SOURCE, "platform": env["platform"], "interpret": env["interpret"],
                 "warmups": 0, "samples_per_case": 1, "cases": [], "pairs": []}
    correctness = {**common, "seed": power.get("first_seed"), "measured_candidate": "none", "scorecards": [],
                   "power": power}
    return {"environment": env, "benchmark": benchmark, "correctness": correctness}


def write_power_run(power_json: Path, out: Path, environment: dict[str, Any]) -> Path:
    """Write the grader-power run folder ``out/<run_id>`` (validated, atomic) and return it."""
    docs = power_documents(read_power(power_json), environment)
    return rawio.write_run(Path(out) / environment["run_id"], docs)
