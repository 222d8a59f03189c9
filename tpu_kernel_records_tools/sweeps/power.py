"""How well the rubric tells right from wrong: false rejects of correct candidates, power on bad ones.

``measure_power(seeds=200)`` grades every candidate on seeds ``first_seed .. first_seed + seeds - 1``
(fresh shapes and inputs per seed at ``level``, see ``grading.dense.problems``) with the same checks and
the same tolerance as a scorecard: each power trial *is* a full scorecard. Correct candidates (kind
reference, kernel, correct-variant) should never be rejected; each known-bad one should be rejected on
every seed, ideally by the check built for its bug. The paged built-ins (``grading.paged.known_bad``) are
graded on the paged rubric (``grading.paged.checks``) beside the dense ones; each entry names its
``contract``, and the totals are also kept per contract (``by_contract``).

It also reports the evidence for the tolerance constants: for each candidate and each
(forward | gradient, dtype) the largest error/tolerance ratio seen, the smallest ``k`` that would have
passed every comparison with the policy's floor (``needed_k``), and the smallest floor in float32 ulps
that would have with the policy's ``k`` (``needed_floor_eps``). For correct candidates these must stay
below the policy; for a known-bad one a ``needed_k`` far above it means only a much looser grader would
let it through.

The result is the ``power`` field of ``correctness.json`` (see ``records/schemas/correctness.schema.json``),
measured on CPU (numerics are valid there; no kernel speed is implied). Cost at the full level: the
float64 truth of a seed takes about 5 CPU-seconds (once per seed, shared by all candidates)
and every seed draws new shapes, so each candidate compiles again per seed; interpret-mode Pallas
kernels take minutes per seed, so they may run on fewer seeds (``kernel_seeds``); each entry's
``trials`` says how many seeds it got.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..grading.dense import checks as C
from ..grading.candidates import Candidate, CandidateLoadError, builtins, resolve
from ..grading.dense.feature_checks import FEATURE_CHECKS
from ..grading.paged.checks import PAGED_CHECKS, PAGED_FEATURE_CHECKS
from ..grading.paged.slots import draw_paged_slots
from ..grading.dense.problems import QUICK, draw_shapes
from ..grading.rubric import grade_seeds
from ..grading.tolerance import POLICY, needed_floor, needed_k

CORRECT_KINDS = ("reference", "kernel", "correct-variant")


def default_candidates() -> list[str]:
    """Every built-in of every contract (dense, paged, ragged, in that order): the correct ones (kernels only
    where they import) and every known-bad one."""
    names = []
    for name, cand in builtins().items():
        if cand.kind == "kernel":
            try:
                cand.load()
            except CandidateLoadError:
                continue
        names.append(name)
    return names


def _group(v) -> str:
    return f"{'gradient' if v.gradient else 'forward'}/{v.dtype}"


def power_tasks(candidates: Sequence[Candidate], seeds: int, first_seed: int = 0,
                kernel_seeds: int | None = None) -> list[tuple[str, int]]:
    """``(candidate name, seed)`` of every trial of a sweep, seed-major: kind "kernel" candidates get only
    the first ``kernel_seeds`` seeds (default: all)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    kernel_seeds = seeds if kernel_seeds is None else min(seeds, kernel_seeds)
    return [(c.name, seed) for seed in range(first_seed, first_seed + seeds) for c in candidates
            if c.kind != "kernel" or seed < first_seed + kernel_seeds]


def measure_power(*, seeds: int, candidates: Sequence[str | Candidate] | None = None, progress: bool = True,
                  first_seed: int = 0, kernel_seeds: int | None = None, time_limit_s: float | None = None,
                  level: str = "full") -> dict:
    """Grade each candidate on ``seeds`` seeds (``kernel_seeds`` for kind "kernel", default the same) at
    ``level``, in this process (``grade_trials``; ``sweeps.sweep`` runs the same trials on Dask).

    Returns the JSON-able power summary (format in ``records/schemas/correctness.schema.json``, ``power``).
    """
    cands = [resolve(c) for c in (candidates if candidates is not None else default_candidates())]
    trials = grade_trials(power_tasks(cands, seeds, first_seed, kernel_seeds), level=level,
                          time_limit_s=time_limit_s, progress=progress, candidates=cands)
    return summarize(cands, trials, seeds, first_seed, level)


def grade_trials(tasks: Sequence[tuple[str, int]], *, level: str, time_limit_s: float | None = None,
                 progress: bool = True, on_trial: Callable[[dict], None] | None = None,
                 candidates: Sequence[Candidate] = (), isolation: str = "auto") -> list[dict]:
    """The ``trial_record`` of each ``(candidate, seed)`` in ``tasks``, graded in this process, in task
    order. Seeds go in blocks of ``grading.dense.checks.CACHE_SEEDS``: within a block each candidate is graded
    by one worker (``grade_seeds``) on its seeds of the block, and the problems (inputs, truth, baseline)
    of the block's seeds are computed once for all candidates. ``on_trial`` receives each record as soon
    as it is known. Candidates are named in ``tasks`` and resolved by name unless given in ``candidates``."""
    given = {c.name: c for c in candidates}
    cands = {name: given.get(name) or resolve(name) for name, _ in tasks}
    limit = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    records: dict[tuple[str, int], dict] = {}
    bar = tqdm(total=len(tasks), desc="power", unit="grade", disable=not progress)
    all_seeds = list(dict.fromkeys(seed for _, seed in tasks))
    for at in range(0, len(all_seeds), C.CACHE_SEEDS):
        block = set(all_seeds[at:at + C.CACHE_SEEDS])
        for name, cand in cands.items():
            mine = [seed for n, seed in tasks if n == name and seed in block]
            if not mine:
                continue
            bar.set_postfix_str(f"seeds {mine[0]}-{mine[-1]} {name}")
            start = time.perf_counter()
            cards = grade_seeds(cand, mine, level=level, isolation=isolation, **limit)
            seconds = (time.perf_counter() - start) / len(cards)
            for seed, card in zip(mine, cards):
                records[(name, seed)] = record = trial_record(cand, seed, card, seconds)
                if on_trial is not None:
                    on_trial(record)
            bar.update(len(mine))
    bar.close()
    return [records[t] for t in tasks]


def trial_record(cand: Candidate, seed: int, card, seconds: float) -> dict:
    """One trial (one candidate's scorecard on one seed) as a JSON-able record: its outcome and, per
    (forward | gradient, dtype), the largest error/tolerance ratio, needed ``k`` and needed floor."""
    groups: dict[str, list[float]] = {}
    worst_k = 0.0
    for verdicts in card.verdicts.values():
        for v in verdicts:
            g = groups.setdefault(_group(v), [0.0, 0.0, 0.0])
            k = needed_k(v)
            g[0], g[1], g[2] = max(g[0], v.ratio), max(g[1], k), max(g[2], needed_floor(v))
            worst_k = max(worst_k, k)
    return {"candidate": cand.name, "kind": cand.kind, "seed": seed, "passed": bool(card.passed),
            "failed": list(card.failed), "error": card.error, "isolation": card.isolation,
            "seconds": round(seconds, 3),
            "groups": dict(sorted(groups.items())), "worst_k": worst_k}


def summarize(cands: Sequence[Candidate], trials: Sequence[dict], seeds: int, first_seed: int,
              level: str = "full") -> dict:
    """The power summary of ``trials`` (``trial_record``s, in any order): the same however and wherever
    they were graded, but for ``seconds_per_trial``."""
    stats = {c.name: {"trials": 0, "rejected": 0, "rejected_by": Counter(), "by_intended": 0,
                      "seconds": 0.0, "errors": Counter(), "ratio": defaultdict(float), "k": defaultdict(float),
                      "floor": defaultdict(float), "k_to_pass": []} for c in cands}
    by_name = {c.name: c for c in cands}
    for record in sorted(trials, key=lambda r: (r["seed"], r["candidate"])):
        _tally(stats[record["candidate"]], by_name[record["candidate"]], record)
    return _summary(list(cands), stats, seeds, first_seed, level)


def _tally(s: dict, cand: Candidate, record: dict) -> None:
    s["trials"] += 1
    s["seconds"] += record["seconds"]
    if record["error"]:
        s["errors"][record["error"]] += 1
    if not record["passed"]:
        s["rejected"] += 1
        s["rejected_by"].update(record["failed"])
        if set(record["failed"]) & set(cand.catches):
            s["by_intended"] += 1
    for g, (ratio, k, floor) in record["groups"].items():
        s["ratio"][g] = max(s["ratio"][g], ratio)
        s["k"][g], s["floor"][g] = max(s["k"][g], k), max(s["floor"][g], floor)
    s["k_to_pass"].append(record["worst_k"])


def _num(x: float) -> float | None:
    return float(f"{x:.4g}") if np.isfinite(x) else None


def _shapes(seeds: int, first_seed: int, level: str) -> list[dict]:
    """Every shape graded: ``slot`` (quick level: the same on every seed) or ``slot@seed`` (full level)."""
    if level == "quick":
        return [{"name": n, **d._asdict()} for n, d in QUICK.items()]
    return [{"name": f"{slot}@{seed}", **d._asdict()} for seed in range(first_seed, first_seed + seeds)
            for slot, d in draw_shapes(seed, level).items()]


def _summary(cands: list[Candidate], stats: dict, seeds: int, first_seed: int, level: str = "full") -> dict:
    entries = []
    for cand in cands:
        s = stats[cand.name]
        expected_pass = cand.kind in CORRECT_KINDS
        entry = {
            "candidate": cand.name, "kind": cand.kind, "contract": cand.contract, "trials": s["trials"],
            "rejected": s["rejected"],
            "rejected_by": dict(sorted(s["rejected_by"].items())),
            "expected": "pass" if expected_pass else "reject" if cand.kind == "known-bad" else "unknown",
            "intended_checks": list(cand.catches),
            "rejected_by_intended": s["by_intended"] if cand.catches else None,
            "seconds_per_trial": _num(s["seconds"] / max(1, s["trials"])),
            "load_error": next(iter(s["errors"]), None),
            "calibration": {g: {"max_ratio": _num(s["ratio"][g]), "needed_k": _num(s["k"][g]),
                                "needed_floor_eps": _num(s["floor"][g])} for g in sorted(s["ratio"])},
            # Smallest k (policy floor) that would have let every tolerance comparison of some seed pass.
            "min_k_to_pass_tolerances": _num(min(s["k_to_pass"])) if s["k_to_pass"] else None,
        }
        entries.append(entry)
    summary = {
        "seeds": seeds,
        "first_seed": first_seed,
        "level": level,
        "shapes": _shapes(seeds, first_seed, level),
        "dtypes": ["float32", "bfloat16"],
        "checks": [spec.name for spec in (*C.CHECKS, *FEATURE_CHECKS.values(), C.FINITE)],
        "policy": POLICY.to_dict(),
        "candidates": entries,
        **_totals(entries),
        "by_contract": {contract: _totals([e for e in entries if e["contract"] == contract])
                        for contract in dict.fromkeys(e["contract"] for e in entries)},
    }
    if "paged" in summary["by_contract"]:
        summary["paged_shapes"] = _paged_shapes(seeds, first_seed, level)
        summary["paged_checks"] = [spec.name for spec in (*PAGED_CHECKS, *PAGED_FEATURE_CHECKS.values(), C.FINITE)]
    return summary


def _totals(entries: list[dict]) -> dict[str, int]:
    """False rejects of the correct entries and misses of the known-bad ones, with their trials."""
    correct = [e for e in entries if e["expected"] == "pass"]
    bad = [e for e in entries if e["expected"] == "reject"]
    return {"false_rejects": sum(e["rejected"] for e in correct), "correct_trials": sum(e["trials"] for e in correct),
            "missed_bad": sum(e["trials"] - e["rejected"] for e in bad), "bad_trials": sum(e["trials"] for e in bad)}


def _paged_shapes(seeds: int, first_seed: int, level: str) -> list[dict]:
    """Every paged slot graded (``grading.paged.slots``), named as ``_shapes`` names the dense ones."""
    def row(name: str, slot) -> dict:
        return {"name": name, **{f: getattr(slot, f) for f in ("batch", "q_len", "num_q_heads", "num_kv_heads",
                                                               "head_dim", "page_size", "pages_per_sequence",
                                                               "num_pages", "dtype")}}
    if level == "quick":
        return [row(n, slot) for n, slot in draw_paged_slots(first_seed, level).items()]
    return [row(f"{n}@{seed}", slot) for seed in range(first_seed, first_seed + seeds)
            for n, slot in draw_paged_slots(seed, level).items()]


def power_markdown(power: dict) -> str:
    """A Markdown report of a ``measure_power`` result (for the card)."""
    pol = power["policy"]
    level = power.get("level", "quick")
    if level == "quick":
        shapes = "shapes " + ", ".join(f"{s['name']}=(b{s['batch']}, q{s['q_len']}, kv{s['kv_len']}, h{s['num_q_heads']}/"
                                       f"{s['num_kv_heads']}, d{s['head_dim']})" for s in power["shapes"])
    else:
        dims = sorted({s["head_dim"] for s in power["shapes"]})
        longest = max(s["kv_len"] for s in power["shapes"])
        shapes = (f"{len(power['shapes'])} shapes drawn by seed (grading.dense.problems: head_dim {dims}, groups 1-8, "
                  f"kv_len up to {longest})")
    lines = [
        f"Grader power over {power['seeds']} seeds (seeds {power['first_seed']}..{power['first_seed'] + power['seeds'] - 1}), "
        f"level {level}, measured on CPU; fresh inputs on every trial, {shapes}, float32 and bfloat16.",
        "",
        f"Tolerance: error <= k x reference error + floor, k = {pol['k']['forward']:g} (forward), "
        f"{pol['k']['gradient']:g} (gradients), floor = {pol['floor']['float32_eps_multiple']:g} float32 ulps "
        f"({pol['floor']['value']:.3g}); norm-wise and worst-element error against a float64 oracle.",
        "",
        f"False rejects of correct candidates: {power['false_rejects']} of {power['correct_trials']} trials. "
        f"Known-bad candidates not rejected: {power['missed_bad']} of {power['bad_trials']} trials.",
        "",
    ]
    if power.get("paged_shapes"):
        by = power["by_contract"]
        lines += [f"Paged contract (the paged rubric, {len(power['paged_shapes'])} paged shapes, page sizes "
                  f"{sorted({s['page_size'] for s in power['paged_shapes']})}): " + "; ".join(
                      f"{contract}: false rejects {t['false_rejects']} of {t['correct_trials']}, known-bad not "
                      f"rejected {t['missed_bad']} of {t['bad_trials']}" for contract, t in by.items()) + ".", ""]
    lines += [
        "| Candidate | Contract | Kind | Trials | Rejected | Rejected by (trials) | Needed k, fwd / grad | Easiest k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in power["candidates"]:
        by = ", ".join(f"{k} ({v})" for k, v in sorted(e["rejected_by"].items(), key=lambda kv: -kv[1])) or "-"
        ks = f"{_max_k(e['calibration'], 'forward')} / {_max_k(e['calibration'], 'gradient')}"
        easiest = e["min_k_to_pass_tolerances"]
        easiest = "inf" if easiest is None else f"{easiest:.3g}"
        lines.append(f"| {e['candidate']} | {e.get('contract', 'attention')} | {e['kind']} | {e['trials']} | "
                     f"{e['rejected']} | {by} | {ks} | {easiest} |")
    lines += ["", "Needed k: the smallest k (with the policy's floor) that passes every forward / gradient "
              "comparison of every trial; for correct candidates it must stay below the policy's k. Easiest k: "
              "the smallest k at which all tolerance comparisons of the candidate's easiest trial pass; for a "
              "known-bad candidate far above the policy's k it means no looser-but-sane tolerance lets it "
              "through (near 1: only exact checks catch it)."]
    return "\n".join(lines) + "\n"


def _max_k(calibration: dict, prefix: str) -> str:
    values = [c["needed_k"] for group, c in calibration.items() if group.startswith(prefix)]
    if not values:
        return "-"
    return "inf" if any(v is None for v in values) else f"{max(values):.3g}"
