#!/usr/bin/env python3
"""Calibrate the tolerance policy: how large must ``k`` be for correct candidates never to be rejected?

    python scripts/calibrate.py --seeds 200 --out calibration.jsonl        # seeds 0.. and 1000.., resumable
    python scripts/calibrate.py --report calibration.jsonl                 # the table of grading/tolerance.py

Grades the correct candidates (``reference`` and every built-in of kind correct-variant; ``--candidate``
to choose) at the full level, one seed at a time, alternating a *calibration* seed (``0, 1, ...``) and a
*held-out* seed (``1000, 1001, ...``), with the same checks and tolerance as any scorecard
(``grading.power.measure_power``). Each seed's result (rejections and, per candidate and forward /
gradient, the smallest ``k`` that passes every comparison with the policy's floor: ``needed_k``) is
appended to ``--out`` as one JSON line as soon as it is known, so the run can be stopped and resumed.

``--report`` prints, per candidate, the largest needed ``k`` over the calibration seeds and over the
held-out seeds, the false rejects in each set, and what the rule "k = 1.25 x the largest needed value
on the calibration seeds, rounded up" gives. Measured on CPU (numerics are valid there; no speed is
implied). Not a test: at the full level one seed of five candidates takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

HELD_OUT_FIRST_SEED = 1000
RULE_MARGIN = 1.25


def _correct_candidates() -> list[str]:
    from tpu_kernel_records_tools.grading.candidates import BUILTIN
    return [n for n, c in BUILTIN.items() if c.kind in ("reference", "correct-variant")]


def _done(path: str) -> set[int]:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {json.loads(line)["seed"] for line in f if line.strip()}


def run(seeds: int, out: str, candidates: list[str]) -> None:
    from tpu_kernel_records_tools.grading.power import measure_power

    order = [s for pair in zip(range(seeds), range(HELD_OUT_FIRST_SEED, HELD_OUT_FIRST_SEED + seeds)) for s in pair]
    done = _done(out)
    for seed in order:
        if seed in done:
            continue
        start = time.perf_counter()
        power = measure_power(seeds=1, first_seed=seed, candidates=candidates, progress=False)
        line = {"seed": seed, "set": "held-out" if seed >= HELD_OUT_FIRST_SEED else "calibration",
                "seconds": round(time.perf_counter() - start, 1), "load_average": os.getloadavg()[0],
                "candidates": {e["candidate"]: {"rejected": e["rejected"], "rejected_by": e["rejected_by"],
                                                "calibration": e["calibration"]} for e in power["candidates"]}}
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        worst = {n: _worst(c["calibration"]) for n, c in line["candidates"].items()}
        print(f"seed {seed}: {line['seconds']:.0f} s; needed k fwd/grad " +
              ", ".join(f"{n} {f:.2f}/{g:.2f}" for n, (f, g) in worst.items()), flush=True)


def _worst(calibration: dict) -> tuple[float, float]:
    def top(prefix):
        values = [c["needed_k"] for g, c in calibration.items() if g.startswith(prefix)]
        return math.inf if any(v is None for v in values) else max(values, default=0.0)
    return top("forward"), top("gradient")


def report(path: str) -> str:
    from tpu_kernel_records_tools.grading.tolerance import POLICY

    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    sets = {"calibration": [x for x in lines if x["set"] == "calibration"],
            "held-out": [x for x in lines if x["set"] == "held-out"]}
    names = list(dict.fromkeys(n for x in lines for n in x["candidates"]))
    def seeds_of(rows):
        s = sorted(x["seed"] for x in rows)
        return f"{len(s)} seeds ({s[0]}-{s[-1]})" if s else "0 seeds"
    out = [f"Full level, calibration: {seeds_of(sets['calibration'])}; held out: {seeds_of(sets['held-out'])}.",
           "Needed k, forward / gradient (largest over the set), and false rejects:", "",
           f"    {'candidate':18s}  {'calibration':>16s}  {'held-out':>16s}  rejects"]
    top = {"calibration": [0.0, 0.0], "held-out": [0.0, 0.0]}
    for name in names:
        cells, rejects = [], []
        for which, rows in sets.items():
            f = max((_worst(x["candidates"][name]["calibration"])[0] for x in rows if name in x["candidates"]),
                    default=0.0)
            g = max((_worst(x["candidates"][name]["calibration"])[1] for x in rows if name in x["candidates"]),
                    default=0.0)
            top[which] = [max(top[which][0], f), max(top[which][1], g)]
            cells.append(f"{f:7.2f} / {g:6.2f}")
            rejects.append(sum(x["candidates"][name]["rejected"] for x in rows if name in x["candidates"]))
        out.append(f"    {name:18s}  {cells[0]:>16s}  {cells[1]:>16s}  {rejects[0]} + {rejects[1]}")
    rule = [math.ceil(RULE_MARGIN * v) for v in top["calibration"]]
    policy = (POLICY.k_forward, POLICY.k_gradient)
    out += ["", f"Rule: k = {RULE_MARGIN} x the largest needed value on the calibration seeds, rounded up: "
                f"forward {rule[0]}, gradient {rule[1]} (policy: {policy[0]:g}, {policy[1]:g}). "
                f"Held-out largest: forward {top['held-out'][0]:.2f}, gradient {top['held-out'][1]:.2f}"
                f" ({'within' if top['held-out'][0] <= policy[0] and top['held-out'][1] <= policy[1] else 'OVER'}"
                f" the policy)."]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per set (calibration and held out)")
    parser.add_argument("--out", default="calibration.jsonl", help="JSON lines, one per seed (appended)")
    parser.add_argument("--candidate", action="append", help="a correct candidate (repeat); default all")
    parser.add_argument("--report", metavar="JSONL", help="print the table from a finished or partial run")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    run(args.seeds, args.out, args.candidate or _correct_candidates())


if __name__ == "__main__":
    main()
