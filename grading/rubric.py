"""Correctness rubric: grade any candidate that follows the contract and return a scorecard.

``grade("pallas")`` runs every check in ``grading.checks.CHECKS`` (then ``finite``) on fresh inputs drawn
from ``seed`` and returns a :class:`Scorecard`. Nothing a candidate does escapes as a traceback: a load
error, an exception, a hang past ``time_limit_s`` (the whole candidate's budget, in seconds), a wrong
shape or dtype, NaN or Inf all become failed checks whose ``detail`` says what was observed. The
tolerance policy is documented in ``grading.tolerance``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from grading import checks as C
from grading.candidates import Candidate, CandidateLoadError, resolve


@dataclass
class CheckResult:
    """One check: pass/fail, points earned of ``max_points``, and what was observed."""

    name: str
    passed: bool
    points: float
    max_points: float
    detail: str
    error: float | None = None
    tolerance: float | None = None
    baseline_error: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Scorecard:
    """A candidate's checks; ``passed`` only when every check passed. ``error``: why it could not be graded."""

    candidate: str
    kind: str
    checks: list[CheckResult]
    error: str | None = None
    seed: int = 0
    verdicts: dict = field(default_factory=dict, repr=False)  # check name -> tolerance verdicts (for power)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def score(self) -> float:
        return float(sum(c.points for c in self.checks))

    @property
    def max_score(self) -> float:
        return float(sum(c.max_points for c in self.checks))

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        """The ``$defs/scorecard`` object of ``measure/schemas/correctness.schema.json``."""
        return {"candidate": self.candidate, "kind": self.kind, "passed": self.passed, "score": self.score,
                "max_score": self.max_score, "error": self.error, "checks": [c.to_dict() for c in self.checks]}


def _all_failed(reason: str) -> list[CheckResult]:
    return [CheckResult(spec.name, False, 0.0, float(spec.points), reason) for spec in (*C.CHECKS, C.FINITE)]


def grade(candidate: str | Candidate, *, seed: int = 0, time_limit_s: float = 120.0) -> Scorecard:
    """Run the full rubric on ``candidate`` (a built-in name, ``file.py:fn``, ``module:fn`` or a Candidate).

    ``time_limit_s`` bounds the time spent inside the candidate's calls, all together; once it runs
    out, the remaining checks fail as "not run". Raises ``CandidateSpecError`` only for a malformed spec.
    """
    cand = resolve(candidate)
    try:
        fn = cand.load()
    except CandidateLoadError as e:
        return Scorecard(cand.name, cand.kind, _all_failed(f"not run: {e}"), error=str(e), seed=seed)

    runner = C.Runner(fn, time_limit_s)
    ctx = C.Context(runner, seed)
    results, verdicts = [], {}
    for spec in C.CHECKS:
        runner.check = spec.name
        try:
            outcome = spec.run(ctx)
        except C.CandidateFailure as e:
            outcome = C.Outcome(False, str(e))
        except Exception as e:  # e.g. an output the check cannot even compare; never a traceback
            outcome = C.Outcome(False, f"could not evaluate the candidate's results: {type(e).__name__}: {e}")
        verdicts[spec.name] = outcome.verdicts
        results.append(CheckResult(spec.name, outcome.passed, float(spec.points) if outcome.passed else 0.0,
                                   float(spec.points), outcome.detail, outcome.error, outcome.tolerance,
                                   outcome.baseline_error))
    results.append(_finite(runner))
    return Scorecard(cand.name, cand.kind, results, seed=seed, verdicts=verdicts)


def _finite(runner: C.Runner) -> CheckResult:
    points = float(C.FINITE.points)
    if runner.nonfinite:
        more = f" (and {len(runner.nonfinite) - 1} more arrays)" if len(runner.nonfinite) > 1 else ""
        return CheckResult("finite", False, 0.0, points, f"non-finite value: {runner.nonfinite[0]}{more}")
    if runner.timed_out or runner.returned == 0:
        why = "the candidate ran out of time" if runner.timed_out else "no call returned an array"
        return CheckResult("finite", False, 0.0, points, f"not established: {why}")
    return CheckResult("finite", True, points, points,
                       f"all {runner.returned} arrays returned (outputs and gradients) were finite")


def grade_all(candidates: Sequence[str | Candidate], *, seed: int = 0, progress: bool = True,
              time_limit_s: float = 120.0) -> list[Scorecard]:
    """``grade`` each candidate in turn (tqdm progress bar when ``progress``)."""
    bar = tqdm(list(candidates), desc="rubric", unit="candidate", disable=not progress)
    cards = []
    for cand in bar:
        name = cand.name if isinstance(cand, Candidate) else str(cand)
        bar.set_postfix_str(name)
        cards.append(grade(cand, seed=seed, time_limit_s=time_limit_s))
    return cards
