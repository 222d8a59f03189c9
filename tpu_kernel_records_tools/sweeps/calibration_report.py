"""The calibration's table: what the trials of ``sweeps.calibration`` say.

:func:`summary` gives, per set (calibration / held-out seeds) and candidate, the largest needed ``k``, the false
rejects, the rule's ``k`` and the cost of one machine's trials (others priced apart); :func:`report` writes
it as Markdown (``calibration/REPORT.md``).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..sweeps.calibration import HELD_OUT_FIRST_SEED, KERNELS, RULE_MARGIN
from ..grading.tolerance import POLICY


def _set(seed: int) -> str:
    return "held-out" if seed >= HELD_OUT_FIRST_SEED else "calibration"



def _needed_floor(record: dict) -> float:
    """The largest floor multiple (float32 ulps x max(1, |logit|), ``tolerance.needed_floor``) any group of
    ``record`` needed at the policy's ``k``."""
    return max((floor for _, _, floor in record["groups"].values()), default=0.0)


def _needed(record: dict, prefix: str) -> float:
    values = [k for group, (_, k, _) in record["groups"].items() if group.startswith(prefix)]
    return max(values, default=0.0)


def summary(trials: Sequence[dict]) -> dict:
    """Per set and candidate: seeds, largest needed k forward / gradient, false rejects (with the trials
    that were rejected); the rule's k; the held-out seeds' largest needs; seeds and slot draws; and, over the
    trials of the machine that graded the most (``cost_machine``; CPU seconds of different machines are not
    summed), CPU-s per trial (of the candidates that are not ``KERNELS``), the same on a slot group's first
    seed (which compiles) and on the other seeds (``first_seed_`` and ``other_seeds_cpu_s_per_trial``; None
    where there is none), and each candidate's own; the interpret-mode kernels' own, over the trials of the
    machine that graded the most of them (``kernel_cost_machine``, ``kernel_own_cpu_s_per_trial``);
    ``pure_trials``: the pure-JAX candidates' trials, how many candidates, and their CPU-hours at that per-trial
    rate; ``other_machines``: each other machine's trials and CPU-s per trial, priced apart; ``floor_needed``, per set,
    the largest floor multiple a trial needed at the policy's k (``tolerance.needed_floor``)."""
    out: dict = {"sets": {}, "policy": {"forward": POLICY.k_forward, "gradient": POLICY.k_gradient,
                                        "floor": POLICY.floor_eps}}
    for record in trials:
        which = out["sets"].setdefault(_set(record["seed"]), {})
        entry = which.setdefault(record["candidate"], {"seeds": [], "forward": 0.0, "gradient": 0.0, "rejects": 0,
                                                       "rejected": []})
        entry["seeds"].append(record["seed"])
        entry["forward"] = max(entry["forward"], _needed(record, "forward"))
        entry["gradient"] = max(entry["gradient"], _needed(record, "gradient"))
        entry["floor"] = max(entry.get("floor", 0.0), _needed_floor(record))
        if not record["passed"]:
            entry["rejects"] += 1
            entry["rejected"].append({"seed": record["seed"], "failed": record.get("failed", []),
                                      "error": record.get("error")})
    calib = out["sets"].get("calibration", {}).values()
    out["rule"] = {g: math.ceil(RULE_MARGIN * max((e[g] for e in calib), default=0.0)) for g in ("forward", "gradient")}
    held = out["sets"].get("held-out", {}).values()
    out["held_out_largest"] = {g: max((e[g] for e in held), default=0.0) for g in ("forward", "gradient")}
    out["held_out_rejects"] = sum(e["rejects"] for e in held)
    out["floor_needed"] = {which: max((e["floor"] for e in out["sets"].get(which, {}).values()), default=0.0)
                           for which in ("calibration", "held-out")}
    out["seeds"] = {which: len({s for e in out["sets"].get(which, {}).values() for s in e["seeds"]})
                    for which in ("calibration", "held-out")}
    out["slot_draws"] = {which: len({r.get("slots_from", r["seed"]) for r in trials if _set(r["seed"]) == which})
                         for which in ("calibration", "held-out")}
    machines = [r.get("machine") for r in trials if "cpu_s" in r]
    out["cost_machine"] = _most_common(machines)
    timed = [r for r in trials if "cpu_s" in r and r.get("machine") == out["cost_machine"]]
    out["cost_trials"] = len(timed)
    out["cpu_s_per_trial"], out["shared_cpu_s_per_trial"] = _per_trial(timed)
    compiles = [r.get("slots_from", r["seed"]) == r["seed"] for r in timed]
    out["first_seed_cpu_s_per_trial"] = _per_trial([r for r, first in zip(timed, compiles) if first])[0]
    out["other_seeds_cpu_s_per_trial"] = _per_trial([r for r, first in zip(timed, compiles) if not first])[0]
    out["other_machines"] = {m: {"trials": machines.count(m), "cpu_s_per_trial": _per_trial(
        [r for r in trials if "cpu_s" in r and r.get("machine") == m])[0]}
        for m in dict.fromkeys(machines) if m != out["cost_machine"]}
    out["own_cpu_s_per_trial"] = _own([r for r in timed if r["candidate"] not in KERNELS])
    pure = [r for r in trials if r["candidate"] not in KERNELS]
    out["pure_trials"] = {"trials": len(pure), "candidates": len({r["candidate"] for r in pure}),
                          "cpu_hours": None if out["cpu_s_per_trial"] is None
                          else len(pure) * out["cpu_s_per_trial"] / 3600}
    kernel_machines = [r.get("machine") for r in trials if "cpu_s" in r and r["candidate"] in KERNELS]
    out["kernel_cost_machine"] = _most_common(kernel_machines)
    out["kernel_own_cpu_s_per_trial"] = _own([r for r in trials if "cpu_s" in r and r["candidate"] in KERNELS
                                              and r.get("machine") == out["kernel_cost_machine"]])
    return out


def _most_common(machines: Sequence[str | None]) -> str | None:
    """The machine named most often (the first of a tie); None for none."""
    return max(dict.fromkeys(machines), key=machines.count) if machines else None


def _own(timed: Sequence[dict]) -> dict[str, float]:
    """Each candidate's own CPU-s per trial over ``timed`` (its seed's shared part left out)."""
    by_name: dict[str, list[float]] = {}
    for r in timed:
        by_name.setdefault(r["candidate"], []).append(r["cpu_s"])
    return {name: sum(v) / len(v) for name, v in by_name.items()}


def _per_trial(timed: Sequence[dict]) -> tuple[float | None, float | None]:
    """CPU-s per trial of the pure-JAX candidates among ``timed`` (the interpret-mode kernels are priced apart),
    the seed's shared part included, and that shared part alone; None where there is none."""
    pure = [r for r in timed if r["candidate"] not in KERNELS]
    if not pure:
        return None, None
    return (sum(r["cpu_s"] + r.get("shared_cpu_s", 0.0) for r in pure) / len(pure),
            sum(r.get("shared_cpu_s", 0.0) for r in pure) / len(pure))


def report(trials: Sequence[dict], failed: Sequence[dict] = (), level: str = "full",
           notes: Sequence[str] = ()) -> str:
    """The calibration table (Markdown) of ``trials``; rejected trials, tasks that failed and ``notes`` (a
    cut-off line, trials still to grade) are listed, not hidden."""
    s = summary(trials)
    names = list(dict.fromkeys(r["candidate"] for r in trials))

    def seeds_of(which: str) -> str:
        seeds = sorted({x for e in s["sets"].get(which, {}).values() for x in e["seeds"]})
        draws = s["slot_draws"][which]
        return f"{len(seeds)} {which} seeds" + (f" ({seeds[0]}-{seeds[-1]}; {draws} slot draw{'s' * (draws != 1)})"
                                                 if seeds else "")

    cost = "" if s["cpu_s_per_trial"] is None else (f" {s['cpu_s_per_trial']:.1f} CPU-s per trial (candidate and "
                                                    f"seed) of the pure-JAX candidates, the seed's shared truth and "
                                                    f"baselines included.")
    lines = [f"Level {level}: {seeds_of('calibration')} and {seeds_of('held-out')}, {len(trials)} trials. "
             "Needed k, forward / gradient (largest over the set), and false rejects (measured on CPU)." + cost, "",
             "| Candidate | Calibration seeds | Calibration k | Held-out seeds | Held-out k | "
             "False rejects (calibration + held-out) |",
             "|---|---|---|---|---|---|"]
    for name in names:
        cells = []
        for which in ("calibration", "held-out"):
            e = s["sets"].get(which, {}).get(name)
            cells.append((str(len(e["seeds"])) if e else "0", f"{e['forward']:.2f} / {e['gradient']:.2f}" if e else "-",
                          str(e["rejects"]) if e else "-"))
        lines.append(f"| {name} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} | "
                     f"{cells[0][2]} + {cells[1][2]} |")
    pol, rule, held = s["policy"], s["rule"], s["held_out_largest"]
    within = held["forward"] <= pol["forward"] and held["gradient"] <= pol["gradient"]
    lines += ["", f"Rule: k = {RULE_MARGIN} x the largest needed value on the calibration seeds, rounded up: "
                  f"forward {rule['forward']}, gradient {rule['gradient']} (policy: {pol['forward']:g}, "
                  f"{pol['gradient']:g}). "
                  + (f"Held-out largest: forward {held['forward']:.2f}, gradient {held['gradient']:.2f} "
                     f"({'within' if within else 'OVER'} the policy); held-out false rejects: {s['held_out_rejects']}."
                     if s["seeds"]["held-out"] else "No held-out seed graded yet.")]
    floor = s["floor_needed"]
    lines += ["", f"Floor: the largest multiple of float32 eps x max(1, |logit|) a trial needed at the policy's "
                  f"k (0 where k alone sufficed): calibration {floor['calibration']:.2f}, held-out "
                  f"{floor['held-out']:.2f} (policy: FLOOR_EPS {pol['floor']:g}; not set by the rule above)."]
    if s["cpu_s_per_trial"] is not None:
        own = ", ".join(f"{name} {cpu:.1f}" for name, cpu in s["own_cpu_s_per_trial"].items())
        kernels = ", ".join(f"{name} {cpu:.1f}" for name, cpu in s["kernel_own_cpu_s_per_trial"].items())
        if kernels and s["kernel_cost_machine"] != s["cost_machine"]:
            kernels += f" (graded on {s['kernel_cost_machine']})"
        others = sum(o["trials"] for o in s["other_machines"].values())
        elsewhere = "; ".join(f"{m}: {o['cpu_s_per_trial']:.1f} per trial of a pure-JAX candidate ({o['trials']} trials)"
                              for m, o in s["other_machines"].items() if o["cpu_s_per_trial"] is not None)
        lines += ["", f"Cost, measured on {s['cost_machine']} ({s['cost_trials']} trials; CPU seconds of the grading "
                      f"process, summed from the trials' `cpu_s` and `shared_cpu_s`"
                      + (f"; the {others} trials graded on other machines are priced apart" if others else "")
                      + f"): {s['cpu_s_per_trial']:.1f} per trial of a pure-JAX candidate"
                      + (f" ({s['first_seed_cpu_s_per_trial']:.1f} on a slot group's first seed, which compiles; "
                         f"{s['other_seeds_cpu_s_per_trial']:.1f} on the other seeds)"
                         if None not in (s["first_seed_cpu_s_per_trial"], s["other_seeds_cpu_s_per_trial"]) else "")
                      + f", of which {s['shared_cpu_s_per_trial']:.1f} is its share of the seed's problems, truth and "
                      f"baselines; the candidate's own, per candidate: {own}."
                      + (f" The kernels' own, in interpret mode: {kernels}." if kernels else "")
                      + (f" At that rate this report's {s['pure_trials']['trials']} trials of the "
                         f"{s['pure_trials']['candidates']} pure-JAX candidates cost "
                         f"{s['pure_trials']['cpu_hours']:.1f} CPU-hours.")
                      + (f" On other machines: {elsewhere}." if elsewhere else "")]
    rejected = [(name, which, r) for which, entries in s["sets"].items() for name, e in entries.items()
                for r in e["rejected"]]
    if rejected:
        lines += ["", f"False rejects ({len(rejected)}): " + "; ".join(
            f"{name} seed {r['seed']} ({which}): {r['error'] or ', '.join(r['failed']) or 'rejected'}"
            for name, which, r in rejected)]
    if failed:
        lines += ["", f"Not graded ({len(failed)} tasks failed twice): "
                  + "; ".join(f"{f['candidate']} seed {f['seed']}: {f['error']}" for f in failed)]
    if notes:
        lines += ["", *(f"Note: {n}" for n in notes)]
    return "\n".join(lines) + "\n"
