"""Every timed kernel answers for its own rows (issue 49, ``builder.verdicts``): a run whose kernel in any
position (second, third, sharded, beside a submission) has a failed, errored or missing scorecard is
refused naming that kernel, and each benchmark row carries its implementation's verdict.

The runs are synthetic (``release_fixtures``), in memory, checked with ``rules.accept``; one goes through
``build`` to show that nothing reaches ``data/``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

import release_fixtures as testing
from test_stranger_rules import NAME, as_read, documents as submitted_documents
from tpu_kernel_records_tools.builder import rules, tables
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.builder.verdicts import (PASSED, check_timed, features_by_candidate,
                                                       features_used, graded_candidate, graded_verdict)
from tpu_kernel_records_tools.records import rawio

KERNELS = ("softmax", "attention", "flash")  # pallas (the headline kernel), then flash second


def _run(documents: dict[str, Any]) -> dict[str, Any]:
    files = {f"{name}.json": "0" * 64 for name in rawio.DOCUMENTS}
    manifest = {"format_version": 1, "run_id": documents["environment"]["run_id"], "files": files}
    return json.loads(json.dumps({"manifest": manifest, **documents}))


def _card(run: dict[str, Any], name: str) -> tuple[int, dict[str, Any]]:
    return next((i, c) for i, c in enumerate(run["correctness"]["scorecards"]) if c["candidate"] == name)


def _fail(card: dict[str, Any], check: int = 1) -> None:
    """Fail one check the way the rubric writes it (points, score, passed consistent)."""
    card["checks"][check].update(passed=False, points=0.0)
    card.update(passed=False, score=card["score"] - 1)


def _refusal(run: dict[str, Any]) -> rawio.RunError:
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run, allow_interpret=True)
    return err.value


def test_a_run_whose_every_timed_kernel_passed_is_accepted():
    run = _run(testing.documents(scopes=KERNELS))
    assert {c["implementation"] for c in run["benchmark"]["cases"]} == {"xla", "pallas", "flash"}
    rules.accept(run, allow_interpret=True)


@pytest.mark.parametrize("scopes, kernel", [(KERNELS, "flash"), (("softmax", "paged-decode"), "paged-pallas"),
                                            (("softmax", "sharded"), "flash")])
def test_a_failing_kernel_after_the_first_is_refused_naming_it(scopes, kernel):
    run = _run(testing.documents(scopes=scopes))
    assert run["correctness"]["measured_candidate"] == "pallas"
    i, card = _card(run, kernel)
    _fail(card)
    err = _refusal(run)
    assert (err.rule, err.file, err.field) == ("correctness", "correctness.json", f"scorecards/{i}/checks/1/passed")
    timed = "flash@1" if "sharded" in scopes else kernel
    who = repr(kernel) if timed == kernel else f"{kernel!r} (timed as {timed!r})"
    assert str(err).startswith(f"[correctness] correctness.json at scorecards/{i}/checks/1/passed: {who} failed check "
                               f"'padding-mask': ")
    assert "\n" not in str(err)


@pytest.mark.parametrize("scopes, kernel", [(KERNELS, "flash"), (("softmax", "paged-decode"), "paged-pallas")])
def test_a_timed_kernel_without_a_scorecard_is_refused(scopes, kernel):
    run = _run(testing.documents(scopes=scopes))
    i, _ = _card(run, kernel)
    del run["correctness"]["scorecards"][i]
    err = _refusal(run)
    assert (err.rule, err.field) == ("correctness", "scorecards")
    assert f"no scorecard for {kernel!r}" in str(err)


def test_a_timed_kernel_that_could_not_be_graded_is_refused():
    run = _run(testing.documents(scopes=KERNELS))
    i, card = _card(run, "flash")
    card.update(error="RuntimeError: worker died", passed=False)
    err = _refusal(run)
    assert (err.rule, err.field) == ("correctness", f"scorecards/{i}/error")
    assert "'flash' could not be graded: RuntimeError: worker died" in str(err)


def test_a_graded_reference_answers_for_its_rows_but_an_ungraded_one_needs_no_scorecard():
    run = _run(testing.documents(scopes=KERNELS))
    i, card = _card(run, "reference")
    del run["correctness"]["scorecards"][i]
    accepted = rules.accept(run, allow_interpret=True)
    assert {r["implementation"]: r["graded_verdict"] for r in tables.benchmark_rows(accepted)} == {
        "xla": None, "pallas": PASSED, "flash": PASSED}
    failed = _run(testing.documents(scopes=KERNELS))
    _fail(_card(failed, "reference")[1])
    assert "'reference' (timed as 'xla') failed check 'padding-mask'" in str(_refusal(failed))


def test_each_row_carries_the_verdict_of_the_scorecard_it_timed():
    run = _run(testing.documents(scopes=KERNELS))
    rows = tables.benchmark_rows(rules.accept(run, allow_interpret=True))
    assert {(r["implementation"], r["graded_verdict"]) for r in rows} == {
        ("xla", PASSED), ("pallas", PASSED), ("flash", PASSED)}
    _fail(_card(run, "flash")[1])  # never accepted, but the verdict still follows from the card
    assert graded_verdict(run, "flash") == "failed" and graded_verdict(run, "pallas") == PASSED
    assert graded_verdict(run, "flash@4") == "failed" and graded_verdict(run, "cudnn") is None


def test_a_published_summary_carries_no_verdict():
    run = rawio.read_run(testing.REPO / "data" / "raw" / testing.PUBLISHED)
    assert _card(run, "pallas")[1]["passed"]  # the card's transcribed claim, not a grade made here
    rows = tables.benchmark_rows(rules.accept(run))
    assert rows and all(r["graded_verdict"] is None for r in rows)


def test_the_candidate_of_each_implementation():
    correctness = {"measured_candidate": NAME}
    assert graded_candidate("submitted", correctness) == (NAME, True)
    assert graded_candidate("pallas@8", correctness) == ("pallas", True)
    assert graded_candidate("paged-triton", correctness) == ("paged-triton", True)
    assert graded_candidate("xla", correctness) == ("reference", False)
    assert graded_candidate("paged-xla", correctness) == ("paged-reference", False)
    assert graded_candidate("jax-paged", correctness) == ("jax-paged", False)
    assert graded_candidate("someone-elses", correctness) == ("someone-elses", True)


def test_a_submission_and_the_kernels_timed_beside_it_answer_for_their_rows():
    run, read_file = as_read(submitted_documents())
    rows = tables.benchmark_rows(rules.accept(run, allow_interpret=True, read_file=read_file))
    assert {(r["implementation"], r["graded_verdict"]) for r in rows} == {
        ("xla", None), ("flash", PASSED), ("submitted", PASSED)}
    i, _ = _card(run, "flash")
    del run["correctness"]["scorecards"][i]
    err = _refusal(run)
    assert (err.rule, err.field) == ("correctness", "scorecards") and "no scorecard for 'flash'" in str(err)


def test_a_failing_second_kernel_writes_nothing(tmp_path):
    ws = testing.workspace(tmp_path / "ws")
    run = testing.write(ws / "runs", "synthetic-cpu", scopes=KERNELS,
                        edit=lambda docs: _fail(next(c for c in docs["correctness"]["scorecards"]
                                                     if c["candidate"] == "flash")))
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True)
    assert err.value.rule == "correctness" and "'flash' failed check 'padding-mask'" in str(err.value)
    assert not os.path.exists(ws / "data")


def test_the_kernels_beside_a_submission_are_graded_on_the_features_their_rows_use():
    plain = {"window": None, "softcap": None, "segments": None, "sinks": None}
    assert features_used([plain, {"case_id": "before-masks"}]) == []
    assert features_used([plain, {**plain, "sinks": True}, {**plain, "window": [63, 0], "softcap": 50.0}]) == [
        "window", "softcap", "sinks"]
    assert features_used([{**plain, "segments": 4, "sinks": False}]) == ["segments"]
    cases = [{"implementation": "flash", "window": [63, 0]}, {"implementation": "xla", "sinks": True},
             {"implementation": "pallas"}, {"implementation": "submitted", "softcap": 50.0}]
    assert features_by_candidate(cases, {"measured_candidate": NAME}) == {
        "flash": ["window"], "reference": ["sinks"], "pallas": [], NAME: ["softcap"]}


def _uses_window(run: dict[str, Any], implementation: str) -> None:
    for case in run["benchmark"]["cases"]:
        if case["implementation"] == implementation:
            case["window"] = [63, 0]


def _graded_on(card: dict[str, Any], feature: str) -> None:
    """Declare ``feature`` and add its passing check, the way the rubric writes a card graded on it."""
    card["checks"].append({**card["checks"][0], "name": feature})
    card.update(features=[feature], score=card["score"] + 1, max_score=card["max_score"] + 1)


@pytest.mark.parametrize("implementation, candidate", [("flash", "flash"), ("xla", "reference")])
def test_a_row_using_a_feature_its_scorecard_was_not_graded_on_is_refused(implementation, candidate):
    run = _run(testing.documents(scopes=KERNELS))
    _uses_window(run, implementation)
    i, card = _card(run, candidate)
    with pytest.raises(rawio.RunError) as err:
        check_timed(run)
    assert (err.value.rule, err.value.field) == ("correctness", f"scorecards/{i}/features")
    assert str(err.value).endswith(f"{candidate!r} is timed on rows with feature(s) window but was not graded on "
                                   "them (features: [])")
    _graded_on(card, "window")
    check_timed(run)
    rules._check_scorecard(i, card)  # and the card stays a valid one (its feature graded by its check)


def test_an_ungraded_reference_needs_no_feature_and_a_published_summary_is_not_checked():
    run = _run(testing.documents(scopes=KERNELS))
    _uses_window(run, "xla")
    del run["correctness"]["scorecards"][_card(run, "reference")[0]]
    check_timed(run)
    published = rawio.read_run(testing.REPO / "data" / "raw" / testing.PUBLISHED)
    _uses_window(published, "pallas")
    check_timed(published)
