"""The card's leaderboard of submitted kernels: per device and shape, every row graded and timed as one program.

One row per timed case of a ``submitted`` record (``builder.submitted`` accepted it): the kernel's
name, its rubric verdict, the median time with a distribution-free 95% confidence interval of the
median (order statistics of the samples), the ratios to XLA and to the project's flash kernel at the
same shape (bootstrap 95% CIs, from the run's pairs) and the record id. Rows measured in interpret
mode or on a CPU are listed in their own table, labelled: they say nothing about kernel speed.

Each row also names the contract it was graded on (``Graded on``): the base contract, plus the
features the kernel declared (the ``features`` column of its scorecard; null, in a run graded before
features existed, is the base contract). Kernels graded on different feature sets are different
contests: each feature set gets its own table (base first, then by the contract's feature order), so
no kernel is ranked against one graded on more or less. A kernel graded on the paged contract (the
``contract`` column: ``paged``, scope ``paged-decode``) is a contest apart from every dense one: its
tables come after them, with ratios to the paged XLA reference and to the project's paged kernel; a ragged
one (``ragged``, scope ``ragged``: one serving step) likewise, against the ragged XLA reference and kernel,
its shape naming the page size and the cache's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa

from ..records.rawio import scorecard_features
from .markdown import Markdown, code, text

SUBMITTED = "submitted"
# a contract with scopes of its own: (its baselines, its shape's extra fields, its function), by contract name
OWN_SCOPES = {"paged": (("paged-xla", "paged-pallas"), ("page_size",), "paged_attention"),
              "ragged": (("ragged-xla", "ragged-pallas"), ("page_size", "kv_dtype"), "ragged_paged_attention")}
SHAPE_WORDS = {"page_size": "page size", "kv_dtype": "cache"}
NONE_YET = "No submitted kernel is recorded yet (`tpu-kernel-records measure --candidate FILE.py:fn --name NAME`).\n"


def median_ci(samples: list[float], level: float = 0.95) -> tuple[float | None, float | None]:
    """The order-statistic interval ``(x_(j), x_(k))`` holding the median with at least ``level``
    probability (binomial(n, 1/2) ranks); ``(None, None)`` where ``n`` is too small for that."""
    x, n = sorted(samples), len(samples)
    cdf = [sum(math.comb(n, i) for i in range(r + 1)) / 2 ** n for r in range(n + 1)]
    for j in range((n - 1) // 2, -1, -1):  # widen symmetrically until the coverage is reached
        k = n - 1 - j
        if cdf[k] - cdf[j] >= level if j < k else False:
            return x[j], x[k]
    return None, None


def _ratio(pairs: list[dict[str, Any]], baseline: str) -> str:
    for p in pairs or []:
        if p["baseline_case_id"] and f"-{baseline}-" in p["baseline_case_id"] and p["ratio"] is not None:
            ci = "" if p["ci_low"] is None else f" [{p['ci_low']:.2f}, {p['ci_high']:.2f}]"
            return f"{p['ratio']:.2f}x{ci}"
    return "-"


def graded_on(features: tuple[str, ...], contract: str = "attention") -> str:
    """The contract a feature set names: ``base``, ``base + window + softcap``; ``paged: base + window`` on
    the paged contract."""
    named = " + ".join(("base", *features))
    return named if contract == "attention" else f"{contract}: {named}"


Contest = tuple[str, tuple[str, ...]]  # (contract, features)


def _contest(contest: Contest) -> tuple[bool, str, int, tuple[int, ...]]:
    """Contests in table order: the dense contract, then the paged one, then the ragged one; within each the base
    contract first, then fewer features first, in the contract's order."""
    contract, features = contest
    order = scorecard_features()
    return (contract != "attention", contract, len(features),
            tuple(order.index(f) if f in order else len(order) for f in features))


def leaderboard(benchmark: pa.Table, correctness: pa.Table) -> str:
    """The generated ``leaderboard`` section (markdown)."""
    measured = [r for r in correctness.to_pylist()
                if r["source"] == SUBMITTED and r["measured"] and r["row_kind"] == "check"]
    verdicts = {(r["record_id"], r["candidate"]): r["candidate_passed"] for r in measured}
    # features null: graded before features existed, so on the base contract; contract null: attention
    contests: dict[str, Contest] = {r["record_id"]: (r.get("contract") or "attention", tuple(r.get("features") or ()))
                                    for r in measured}
    names = {record: name for record, name in verdicts}
    rows = [r for r in benchmark.to_pylist() if r["source"] == SUBMITTED and r["implementation"] == SUBMITTED]
    if not rows:
        return NONE_YET
    rows.sort(key=lambda r: (r["interpret"], r["device_kind"], r["scope"], r["seq_len"], r["num_q_heads"],
                             r["median_ms"] if r["median_ms"] is not None else math.inf))
    out = []
    for interpret in (False, True):
        mine = [r for r in rows if r["interpret"] == interpret]
        for contest in sorted({contests.get(r["record_id"], ("attention", ())) for r in mine}, key=_contest):
            contract, features = contest
            baselines, extra, function = OWN_SCOPES.get(contract, (("xla", "flash"), (), None))
            header = ["Device", "Scope", "Shape (batch, seq, q/kv heads, head_dim, dtype"
                      + "".join(f", {SHAPE_WORDS[f]}" for f in extra) + ")", "Kernel", "Graded on", "Verdict",
                      "Median ms [95% CI]",
                      *(f"vs {b} [95% CI]" for b in baselines), "Record"]
            table = []
            for r in (r for r in mine if contests.get(r["record_id"], ("attention", ())) == contest):
                name = names.get(r["record_id"], "?")
                low, high = median_ci(r["samples_ms"] or [])
                ci = "" if low is None else f" [{low:.4g}, {high:.4g}]"
                table.append([r["device_kind"], r["scope"],
                              f"{r['batch']}, {r['seq_len']}, {r['num_q_heads']}/{r['num_kv_heads']}, "
                              f"{r['head_dim']}, {r['dtype']}" + "".join(f", {r.get(f)}" for f in extra),
                              code(name), graded_on(features, contract),
                              "passed" if verdicts.get((r["record_id"], name)) else "failed",
                              f"{r['median_ms']:.4g}{ci}", *(_ratio(r["pairs"], b) for b in baselines),
                              code(r["record_id"])])
            where = ("**Interpret mode or CPU: not kernel speed**, only that the programs run" if interpret
                     else "**On the device**")
            what = ("the base contract only" if not features else
                    f"the base contract plus {', '.join(map(text, features))} (a contest of its own)")
            if function:
                what = f"the {contract} contract (`{function}`, a contest of its own): {what}"
            out.append(f"{where}; graded on {what}.\n\n")
            out.append("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
                       + "".join("| " + " | ".join(c if isinstance(c, Markdown) else text(c) for c in row) + " |\n"
                                 for row in table) + "\n")
    return "".join(out)
