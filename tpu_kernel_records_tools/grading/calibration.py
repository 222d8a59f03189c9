"""Calibrate the tolerance policy: how large must ``k`` be for correct candidates never to be rejected?

``tpu-kernel-records calibrate --seeds 200`` grades the correct candidates (``reference`` and every
built-in of kind correct-variant, or those named) at the full level on ``seeds`` *calibration* seeds
(``0, 1, ...``) and as many *held-out* seeds (``HELD_OUT_FIRST_SEED, ...``), with the same checks and
tolerance as any scorecard, as a sweep (``grading.sweep``: serial, on a local Dask cluster or a remote
one; streamed to JSON Lines and resumable). :func:`report` turns the trials into the table of
``grading/tolerance.py``: per candidate the largest needed ``k`` (forward / gradient) over each set,
the false rejects in each, and what the rule "k = RULE_MARGIN x the largest needed value on the
calibration seeds, rounded up" gives against the policy. Measured on CPU (numerics are valid there; no
speed is implied).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..grading.candidates import BUILTIN
from ..grading.tolerance import POLICY

HELD_OUT_FIRST_SEED = 1000
RULE_MARGIN = 1.25


def correct_candidates() -> list[str]:
    """The built-ins a calibration grades by default: the reference and every correct variant."""
    return [n for n, c in BUILTIN.items() if c.kind in ("reference", "correct-variant")]


def calibration_tasks(seeds: int, candidates: Sequence[str]) -> list[tuple[str, int]]:
    """Every ``(candidate, seed)``: calibration and held-out seeds alternate, so a partial run holds both."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    order = [s for pair in zip(range(seeds), range(HELD_OUT_FIRST_SEED, HELD_OUT_FIRST_SEED + seeds)) for s in pair]
    return [(name, seed) for seed in order for name in candidates]


def _set(seed: int) -> str:
    return "held-out" if seed >= HELD_OUT_FIRST_SEED else "calibration"


def _needed(record: dict, prefix: str) -> float:
    values = [k for group, (_, k, _) in record["groups"].items() if group.startswith(prefix)]
    return max(values, default=0.0)


def summary(trials: Sequence[dict]) -> dict:
    """Per set and candidate: seeds, largest needed k forward / gradient, false rejects; and the rule."""
    out: dict = {"sets": {}, "policy": {"forward": POLICY.k_forward, "gradient": POLICY.k_gradient}}
    for record in trials:
        which = out["sets"].setdefault(_set(record["seed"]), {})
        entry = which.setdefault(record["candidate"], {"seeds": [], "forward": 0.0, "gradient": 0.0, "rejects": 0})
        entry["seeds"].append(record["seed"])
        entry["forward"] = max(entry["forward"], _needed(record, "forward"))
        entry["gradient"] = max(entry["gradient"], _needed(record, "gradient"))
        entry["rejects"] += not record["passed"]
    calib = out["sets"].get("calibration", {}).values()
    out["rule"] = {g: math.ceil(RULE_MARGIN * max((e[g] for e in calib), default=0.0)) for g in ("forward", "gradient")}
    held = out["sets"].get("held-out", {}).values()
    out["held_out_largest"] = {g: max((e[g] for e in held), default=0.0) for g in ("forward", "gradient")}
    out["held_out_rejects"] = sum(e["rejects"] for e in held)
    return out


def report(trials: Sequence[dict], failed: Sequence[dict] = (), level: str = "full") -> str:
    """The calibration table (Markdown) of ``trials``; tasks that failed are listed, not hidden."""
    s = summary(trials)
    names = list(dict.fromkeys(r["candidate"] for r in trials))

    def seeds_of(which: str) -> str:
        seeds = sorted({x for e in s["sets"].get(which, {}).values() for x in e["seeds"]})
        return f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]})" if seeds else "0 seeds"

    lines = [f"Level {level}, calibration: {seeds_of('calibration')}; held out: {seeds_of('held-out')}. "
             "Needed k, forward / gradient (largest over the set), and false rejects (measured on CPU).", "",
             "| Candidate | Calibration k | Held-out k | False rejects (calibration + held-out) |",
             "|---|---|---|---|"]
    for name in names:
        cells, rejects = [], []
        for which in ("calibration", "held-out"):
            e = s["sets"].get(which, {}).get(name)
            cells.append(f"{e['forward']:.2f} / {e['gradient']:.2f}" if e else "-")
            rejects.append(str(e["rejects"]) if e else "-")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {' + '.join(rejects)} |")
    pol, rule, held = s["policy"], s["rule"], s["held_out_largest"]
    within = held["forward"] <= pol["forward"] and held["gradient"] <= pol["gradient"]
    lines += ["", f"Rule: k = {RULE_MARGIN} x the largest needed value on the calibration seeds, rounded up: "
                  f"forward {rule['forward']}, gradient {rule['gradient']} (policy: {pol['forward']:g}, "
                  f"{pol['gradient']:g}). Held-out largest: forward {held['forward']:.2f}, gradient "
                  f"{held['gradient']:.2f} ({'within' if within else 'OVER'} the policy); held-out false rejects: "
                  f"{s['held_out_rejects']}."]
    if failed:
        lines += ["", f"Not graded ({len(failed)} tasks failed twice): "
                  + "; ".join(f"{f['candidate']} seed {f['seed']}: {f['error']}" for f in failed)]
    return "\n".join(lines) + "\n"
