"""Every timed kernel answers for its own rows: which scorecard grades a benchmark case, and its verdict.

A case of a ``measured`` or ``submitted`` run timed implementation ``impl`` (``<impl>@<devices>`` in the
sharded scope: the kernel it shards). The rubric grades it as :func:`graded_candidate` says: a submitted
kernel's cases (``submitted``) under the submission's name, a registered implementation
(``kernel_src.registry``) under its ``grading_name``, anything else under its own name. A kernel
(registry kind ``kernel``, a submitted or an unregistered implementation) must have a scorecard in the
run, and every scorecard of a timed candidate must have passed, whichever position the kernel has in
the run, and a row that uses a contract feature (window, soft-cap, segments, sinks: :func:`features_used`)
needs its candidate's scorecards to have been graded on that feature (``features``), whichever
candidate it is: otherwise the run is refused (rule ``correctness``). The XLA references and the vendor kernels
(cuDNN, JAX's ``paged_attention``) are timed for comparison and need no scorecard.

A row's ``graded_verdict`` is ``"passed"`` where the scorecards of the candidate it timed passed
(``"failed"`` otherwise, which only a run the rules refuse can have), and null where none grades it:
a published summary (its one scorecard is the card's claim, transcribed), and a reference or vendor
kernel the run did not grade.
"""

from __future__ import annotations

from typing import Any, Sequence

from kernel_src.registry import IMPLEMENTATIONS

from ..records.rawio import RunError, scorecard_features

from .submitted import SUBMITTED

PASSED = "passed"
NOT_GRADED_SOURCES = ("published-summary",)  # its one scorecard is the card's claim, transcribed, not a grade


def graded_candidate(implementation: str, correctness: dict[str, Any]) -> tuple[str, bool]:
    """``(candidate name, whether a scorecard is required)`` for a case's ``implementation``."""
    base = implementation.split("@")[0]
    if base == SUBMITTED:
        return correctness["measured_candidate"], True
    impl = IMPLEMENTATIONS.get(base)
    if impl is None:
        return base, True
    return impl.grading_name or impl.name, impl.kind == "kernel"


def features_used(cases: Sequence[dict[str, Any]]) -> list[str]:
    """The contract features (window, soft-cap, segments, sinks, quantized_kv) that any of the benchmark ``cases`` uses,
    in the contract's order."""
    return [f for f in scorecard_features() if any(case.get(f) not in (None, False) for case in cases)]


def features_by_candidate(cases: Sequence[dict[str, Any]], correctness: dict[str, Any]) -> dict[str, list[str]]:
    """``{candidate: the features its rows among cases use}`` for every candidate (``graded_candidate``) that
    ``cases`` time."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        rows.setdefault(graded_candidate(case["implementation"], correctness)[0], []).append(case)
    return {name: features_used(timed) for name, timed in rows.items()}


def _refuse_failed(i: int, card: dict[str, Any], implementation: str) -> None:
    """Raise the one-line ``correctness`` refusal for scorecard ``i`` unless it passed every check."""
    name = card["candidate"]
    who = repr(name) if name == implementation else f"{name!r} (timed as {implementation!r})"
    if card.get("error"):
        raise RunError("correctness", "correctness.json", f"scorecards/{i}/error",
                       f"{who} could not be graded: {card['error']}")
    if not card["checks"]:
        raise RunError("correctness", "correctness.json", f"scorecards/{i}/checks", f"{who} has no checks")
    for j, check in enumerate(card["checks"]):
        if not check["passed"]:
            raise RunError("correctness", "correctness.json", f"scorecards/{i}/checks/{j}/passed",
                           f"{who} failed check {check['name']!r}: {check['detail']}")
    if not card["passed"]:
        raise RunError("correctness", "correctness.json", f"scorecards/{i}/passed", f"{who} is marked as not passed")


def check_candidate(correctness: dict[str, Any], name: str, implementation: str, required: bool = True) -> None:
    """Refuse unless every scorecard of ``name`` passed, and (``required``) there is one."""
    cards = [i for i, card in enumerate(correctness["scorecards"]) if card["candidate"] == name]
    if required and not cards:
        timed = "" if name == implementation else f", which the run timed as {implementation!r}"
        raise RunError("correctness", "correctness.json", "scorecards",
                       f"no scorecard for {name!r}{timed}: every timed kernel is graded in its run")
    for i in cards:
        _refuse_failed(i, correctness["scorecards"][i], implementation)


def check_features(correctness: dict[str, Any], name: str, used: Sequence[str]) -> None:
    """Refuse unless the scorecards of ``name`` (if any) were graded on every feature in ``used`` (those its
    timed rows use): a passing verdict must not stand for a feature nobody graded."""
    cards = [i for i, card in enumerate(correctness["scorecards"]) if card["candidate"] == name]
    graded = {f for i in cards for f in correctness["scorecards"][i].get("features") or ()}
    missing = [f for f in used if f not in graded]
    if cards and missing:
        raise RunError("correctness", "correctness.json", f"scorecards/{cards[0]}/features",
                       f"{name!r} is timed on rows with feature(s) {', '.join(missing)} but was not graded on "
                       f"them (features: {[f for f in scorecard_features() if f in graded]!r})")


def check_timed(run: dict[str, Any]) -> None:
    """Refuse a run in which a kernel it timed has a failed, errored or missing scorecard, or one not graded
    on a feature its rows use."""
    if run["benchmark"]["source"] in NOT_GRADED_SOURCES:
        return
    correctness, cases = run["correctness"], run["benchmark"]["cases"]
    for implementation in dict.fromkeys(case["implementation"] for case in cases):
        name, required = graded_candidate(implementation, correctness)
        check_candidate(correctness, name, implementation, required)
    for name, used in features_by_candidate(cases, correctness).items():
        check_features(correctness, name, used)


def graded_verdict(run: dict[str, Any], implementation: str) -> str | None:
    """The ``graded_verdict`` of a row of ``run`` that timed ``implementation`` (see the module docstring)."""
    if run["benchmark"]["source"] in NOT_GRADED_SOURCES:
        return None
    name, _ = graded_candidate(implementation, run["correctness"])
    cards = [card for card in run["correctness"]["scorecards"] if card["candidate"] == name]
    if not cards:
        return None
    return PASSED if all(card["passed"] for card in cards) else "failed"
