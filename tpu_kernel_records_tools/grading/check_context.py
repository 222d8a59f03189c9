"""What every contract's checks share: a check's ``Outcome``, its ``CheckSpec`` (name, points, what runs it),
``FINITE`` (every contract's last check), the summary of verdicts into an outcome and the first bitwise
difference. The dense checks' context (``Context``, its problems and judging helpers) is
``grading.dense.context``, which the paged checks use too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..grading.tolerance import Verdict


@dataclass
class Outcome:
    passed: bool
    detail: str
    error: float | None = None
    tolerance: float | None = None
    baseline_error: float | None = None
    verdicts: tuple[Verdict, ...] = ()


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _summarize(verdicts: list[Verdict], violations: list[str], what: str, *, explained: bool = False) -> Outcome:
    """Pass iff every verdict passed and no exact rule was violated; numbers from the closest verdict.

    ``explained``: each failed verdict already has its own line in ``violations`` (leak checks)."""
    failed = [] if explained else [v for v in verdicts if not v.ok]
    worst = max(verdicts, key=lambda v: v.ratio) if verdicts else None
    numbers = {}
    if worst is not None:
        _, err, tol, base = worst.binding
        numbers = {"error": _finite_or_none(err), "tolerance": tol, "baseline_error": base}
    parts = violations[:3] + [v.describe() for v in failed[:3]]
    if parts:
        more = len(violations) + len(failed) - len(parts)
        detail = "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    else:
        detail = f"{what}; closest to its bound: {worst.describe()}" if worst else what
    return Outcome(not parts, detail, verdicts=tuple(verdicts), **numbers)


def _first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, ...] | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return ()
    bits = f"u{a.dtype.itemsize}"
    diff = a.view(bits) != b.view(bits)
    return tuple(int(i) for i in np.argwhere(diff)[0]) if diff.any() else None


@dataclass(frozen=True)
class CheckSpec:
    """One check of a contract: its name on the scorecard, its points, what runs it, one line of what it asks."""

    name: str
    points: float
    run: Callable[[Any], Outcome]  # a contract's check context -> outcome
    summary: str


# Every contract's last check (the runner counts what was not finite).
FINITE = CheckSpec("finite", 4, lambda ctx: None, "no NaN or Inf in any output or gradient returned")
