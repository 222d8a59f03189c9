"""Correctness rubric: grade any candidate that follows the contract and return a scorecard.

``grade("pallas")`` runs every check in ``grading.dense.checks.CHECKS``, then the check of each feature the
candidate declares (``grading.dense.feature_checks``, ``kernel_src.contract.declared_features``), then
``finite``; ``grade("paged-reference")`` (or any candidate with ``contract="paged"``) runs the paged checks
(``grading.paged.checks.PAGED_CHECKS``, then its declared paged features', then ``finite``): each
contract's checks as ``grading.contracts`` declares them, on fresh
inputs drawn from ``seed`` and returns a :class:`Scorecard`. The candidate runs in its own worker process
(``grading.runner``, ``sandbox.sandbox``): it sees only the problem inputs, never the truth, the
reference's baseline or the grader's state, and every process it starts is killed before the next
candidate is graded. Nothing a candidate does escapes as a traceback or changes another candidate's
scorecard: a load error, an exception, any exit status, a signal, a hang past ``time_limit_s``
(seconds of waiting on the worker per scorecard), memory past ``memory_limit_gb`` (the worker's
address space), a wrong shape or dtype, NaN or Inf, inputs written into: each becomes failed checks
whose ``detail`` says what was observed. The tolerance policy is documented in ``grading.tolerance``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from ..grading import contracts
from ..grading.calls import CandidateFailure
from ..grading.check_context import FINITE, CheckSpec, Outcome
from ..grading.contracts import Contract
from ..grading.dense.context import Context
from ..grading.dense.feature_checks import checks_for  # noqa: F401  (re-exported: the dense contract's)
from ..sandbox import isolation as isolations
from ..sandbox import tripwire
from ..grading.candidates import Candidate, is_builtin, resolve
from ..grading.runner import DEFAULT_TIME_LIMIT_S, Runner
from ..sandbox.sandbox import DEFAULT_MEMORY_LIMIT_GB
from kernel_src.contract import canonical_features


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
        """JSON-safe whatever the check computed: plain bool/str, and numbers as Python floats, with a
        non-finite one (or one that is not a number) as None, so ``json.dumps(..., allow_nan=False)`` holds."""
        return {"name": str(self.name), "passed": bool(self.passed), "points": _json_number(self.points) or 0.0,
                "max_points": _json_number(self.max_points) or 0.0, "detail": str(self.detail),
                "error": _json_number(self.error), "tolerance": _json_number(self.tolerance),
                "baseline_error": _json_number(self.baseline_error)}


def _json_number(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class Scorecard:
    """A candidate's checks; ``passed`` only when every check passed. ``error``: why it could not be graded."""

    candidate: str
    kind: str
    checks: list[CheckResult]
    error: str | None = None
    seed: int = 0
    level: str = "full"  # which problem set graded it: "full" or "quick" (grading.dense.problems)
    verdicts: dict = field(default_factory=dict, repr=False)  # check name -> tolerance verdicts (for power)
    tampered: bool = False  # the candidate changed files the grader runs (sandbox.tripwire): stop grading
    isolation: str = "process"  # where its worker ran: "bubblewrap" or "process" (sandbox.isolation)
    memory_limit: str | None = None  # what bounded its worker's memory: sandbox.memcg.KINDS; None: no worker ran
    syscall_filter: str | None = None  # what filtered its worker's system calls: sandbox.syscalls.KINDS
    features: tuple[str, ...] = ()  # the declared features graded on top of the base contract (contract.FEATURES)
    contract: str = contracts.DEFAULT.name  # the contract graded (grading.contracts.CONTRACTS)

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
        """The ``$defs/scorecard`` object of ``records/schemas/correctness.schema.json``."""
        return {"candidate": self.candidate, "kind": self.kind, "passed": self.passed, "score": self.score,
                "max_score": self.max_score, "error": self.error, "level": self.level,
                "isolation": self.isolation, **({"memory_limit": self.memory_limit} if self.memory_limit else {}),
                **({"syscall_filter": self.syscall_filter} if self.syscall_filter else {}),
                "features": list(self.features),
                **({"contract": self.contract} if self.contract != contracts.DEFAULT.name else {}),
                "checks": [c.to_dict() for c in self.checks]}


def _all_failed(reason: str, contract: Contract) -> list[CheckResult]:
    return [CheckResult(spec.name, False, 0.0, float(spec.points), reason) for spec in (*contract.checks, FINITE)]


def grade(candidate: str | Candidate, *, seed: int = 0, level: str = "full",
          time_limit_s: float = DEFAULT_TIME_LIMIT_S, memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB,
          isolation: str = "auto", features: Sequence[str] | None = None, contract: str | None = None,
          slots_from: int | None = None) -> Scorecard:
    """Run the full rubric on ``candidate`` (a built-in name, ``file.py:fn``, ``module:fn`` or a Candidate)
    in a worker process of its own, killed (with everything it started) before this returns.

    ``level``: "full" (the problem distribution of ``grading.dense.problems``) or "quick" (small fixed shapes,
    for fast tests). ``time_limit_s``: seconds of waiting on the candidate per scorecard, all calls together (loading
    included, the worker's interpreter and JAX start not); once it runs out, the worker is killed and
    the remaining checks fail as "not run". ``memory_limit_gb``: the worker's memory limit in GiB (its
    memory cgroup's, else its address space's: ``sandbox.memcg``; 0: none). ``isolation``: "auto"
    (bubblewrap for anything but a built-in), "bubblewrap" or "process" (``sandbox.isolation``). ``features``:
    which of the candidate's declared features to grade (None: all it declares; ``()``: the base contract
    only; naming one it does not declare makes the scorecard's error). ``contract``: the contract to grade it
    against (``grading.contracts``: "paged" for the paged checks; None: the default, "attention"); a built-in
    of another contract is always graded on its own. ``slots_from``: the seed the problems'
    shapes and flags are drawn from, their values still from ``seed`` (``grading.dense.context.Context``; None:
    ``seed``): a regrade of stored programs on new values at the shapes they were exported for. Raises
    ``CandidateSpecError`` for a malformed spec and ``IsolationUnavailable`` when bubblewrap is needed and
    cannot run here.
    """
    return grade_seeds(candidate, [seed], level=level, time_limit_s=time_limit_s, memory_limit_gb=memory_limit_gb,
                       isolation=isolation, features=features, contract=contract, slots_from=slots_from)[0]


def grade_seeds(candidate: str | Candidate, seeds: Sequence[int], *, level: str = "full",
                time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB, isolation: str = "auto",
                features: Sequence[str] | None = None, contract: str | None = None,
                slots_from: int | None = None) -> list[Scorecard]:
    """``grade`` on each of ``seeds`` with one worker (JAX starts, and compiles, once for them all).

    A worker that died or ran out of time is replaced by a fresh one for the next seed, so each
    scorecard is what that seed alone gives. Every process the candidate started is killed before
    this returns.
    """
    cand = resolve(candidate)
    graded_on = contracts.of(cand, contract)
    features = None if features is None else canonical_features(features)  # ValueError: not a feature
    if features is not None and set(features) - set(graded_on.features):
        raise ValueError(f"feature(s) {', '.join(sorted(set(features) - set(graded_on.features)))} do not apply "
                         f"to {graded_on.function} (its features: {', '.join(graded_on.features)})")
    where = isolations.choose(isolation, is_builtin(cand))
    before = tripwire.snapshot()
    runner = Runner(cand, time_limit_s=time_limit_s, memory_limit_gb=memory_limit_gb, isolation=where, level=level)
    cards = []
    try:
        for seed in seeds:
            runner.new_scorecard()
            if graded_on.plan_checks and slots_from is None:  # the seed's problems are built while the worker starts
                graded_on.plan_checks(seed, level, ())
            error = None if runner.alive else runner.start()
            if error is None:
                declared = [f for f in runner.features if f in graded_on.features]
                graded, error = _graded_features(declared, features)
            if error is not None:
                cards.append(Scorecard(cand.name, cand.kind, _all_failed(f"not run: {error}", graded_on),
                                       error=error, seed=seed, level=level, isolation=where, contract=graded_on.name))
            else:
                cards.append(_run_checks(runner, cand, seed, level, graded, graded_on, slots_from))
                cards[-1].isolation = where
            cards[-1].memory_limit = runner.memory_limit
            cards[-1].syscall_filter = runner.syscall_filter
    finally:
        runner.close()
    found = tripwire.changes(before, tripwire.snapshot())
    if found:  # after close(): every process of the candidate is dead, so nothing changes after this look
        why = (f"the candidate changed files the grader and its workers run ({tripwire.describe(found)}); "
               f"no later grade from this installation can be trusted until they are restored")
        for card in cards:
            card.error, card.tampered = why, True
    return cards


def _not_graded(candidate: str | Candidate, why: str, seed: int, level: str, contract: str | None = None) -> Scorecard:
    cand = resolve(candidate)
    graded_on = contracts.of(cand, contract)
    return Scorecard(cand.name, cand.kind, _all_failed(f"not run: {why}", graded_on), error=why, seed=seed,
                     level=level, contract=graded_on.name)


def _graded_features(declared: Sequence[str], asked: Sequence[str] | None) -> tuple[tuple[str, ...], str | None]:
    """The features to grade: all ``declared`` when ``asked`` is None, else ``asked`` (canonical order), or
    the reason they cannot be (a feature asked for that the candidate does not declare)."""
    if asked is None:
        return tuple(declared), None
    asked = canonical_features(asked)
    missing = [f for f in asked if f not in declared]
    if missing:
        return (), (f"asked to grade feature(s) {', '.join(missing)}, which the candidate does not declare "
                    f"(it declares: {', '.join(declared) or 'none'})")
    return asked, None


def _run_checks(runner: Runner, cand: Candidate, seed: int, level: str, features: tuple[str, ...],
                contract: Contract, slots_from: int | None = None) -> Scorecard:
    ctx = Context(runner, seed, level=level, slots_from=slots_from)
    results, verdicts = [], {}
    if features and contract.plan_checks and slots_from is None:  # built while the base checks run
        contract.plan_checks(seed, level, features)
    for spec in contract.checks_for(features):
        result, verdicts[spec.name] = run_check(spec, ctx)
        results.append(result)
    results.append(_finite(runner))
    return Scorecard(cand.name, cand.kind, results, seed=seed, level=level, verdicts=verdicts, features=features,
                     contract=contract.name)


def run_check(spec: CheckSpec, ctx: Context) -> tuple[CheckResult, list]:
    """One check on ``ctx``'s runner: its result (full points or none) and its verdicts. A candidate's
    failure, or an output the check cannot even compare, fails the check; never a traceback."""
    ctx.runner.check = spec.name
    try:
        outcome = spec.run(ctx)
    except CandidateFailure as e:
        outcome = Outcome(False, str(e))
    except Exception as e:  # noqa: BLE001
        outcome = Outcome(False, f"could not evaluate the candidate's results: {type(e).__name__}: {e}")
    result = CheckResult(spec.name, outcome.passed, float(spec.points) if outcome.passed else 0.0,
                         float(spec.points), outcome.detail, outcome.error, outcome.tolerance, outcome.baseline_error)
    return result, outcome.verdicts


def _finite(runner: Runner) -> CheckResult:
    points = float(FINITE.points)
    if runner.nonfinite:
        more = f" (and {len(runner.nonfinite) - 1} more arrays)" if len(runner.nonfinite) > 1 else ""
        return CheckResult("finite", False, 0.0, points, f"non-finite value: {runner.nonfinite[0]}{more}")
    if runner.timed_out or runner.returned == 0:
        why = "the candidate ran out of time" if runner.timed_out else "no call returned an array"
        return CheckResult("finite", False, 0.0, points, f"not established: {why}")
    return CheckResult("finite", True, points, points,
                       f"all {runner.returned} arrays returned (outputs and gradients) were finite")


def grade_all(candidates: Sequence[str | Candidate], *, seed: int = 0, level: str = "full", progress: bool = True,
              time_limit_s: float = DEFAULT_TIME_LIMIT_S, memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB,
              isolation: str = "auto", features: Sequence[str] | None = None,
              contract: str | None = None) -> list[Scorecard]:
    """``grade`` each candidate in turn, each in its own worker (tqdm progress bar when ``progress``);
    ``features`` and ``contract`` as in ``grade``.

    When this returns, no process any candidate started is alive. A candidate that changed files the
    grader runs (``sandbox.tripwire``) fails, and every candidate after it gets a "not graded" scorecard."""
    bar = tqdm(list(candidates), desc="rubric", unit="candidate", disable=not progress)
    cards, tampered_by = [], None
    for cand in bar:
        name = cand.name if isinstance(cand, Candidate) else str(cand)
        bar.set_postfix_str(name)
        if tampered_by is not None:
            cards.append(_not_graded(cand, f"not graded: {tampered_by}", seed, level, contract))
            continue
        cards.append(grade(cand, seed=seed, level=level, time_limit_s=time_limit_s, memory_limit_gb=memory_limit_gb,
                           isolation=isolation, features=features, contract=contract))
        if cards[-1].tampered:
            tampered_by = f"an earlier candidate ({cards[-1].candidate}) changed files the grader runs"
    return cards
