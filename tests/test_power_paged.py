"""The paged rubric's power in the grader-power sweep (issue 49): the paged built-ins are swept beside the
dense ones, each entry names its contract, the totals are kept per contract, and the card's table shows
both. The default run stubs the grades (the counting, the record and the card); the slow test grades
paged built-ins for real at the quick level."""

from __future__ import annotations

import json

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder import card, rules, tables
from tpu_kernel_records_tools.builder.grader_power import power_documents
from tpu_kernel_records_tools.sweeps import power as P
from tpu_kernel_records_tools.grading import contracts
from tpu_kernel_records_tools.grading.candidates import BUILTIN, PAGED_BUILTIN, resolve
from tpu_kernel_records_tools.grading.rubric import CheckResult, Scorecard
from tpu_kernel_records_tools.records import rawio

SWEPT = ["reference", "zeros", "paged-reference", "paged-kv-swapped"]


def _stub(cand, seeds, **kw):
    """Cards as the rubric writes them: a known-bad one fails the checks built for it, a correct one none."""
    names = cand.catches or ("paged-accuracy" if cand.contract == "paged" else "forward-accuracy",)
    failed = set(cand.catches) if cand.kind == "known-bad" else set()
    return [Scorecard(cand.name, cand.kind, [CheckResult(n, n not in failed, float(n not in failed), 1.0, "stub")
                                             for n in names], contract=cand.contract) for _ in seeds]


@pytest.fixture
def swept(monkeypatch) -> dict:
    monkeypatch.setattr(P, "grade_seeds", _stub)
    return P.measure_power(seeds=2, candidates=SWEPT, progress=False, level="quick")


def test_the_default_sweep_holds_every_builtin_of_every_contract():
    names = P.default_candidates()
    by_contract = {c.name: [n for n in names if n in c.builtins] for c in contracts.CONTRACTS.values()}
    assert names == [n for c in contracts.CONTRACTS.values() for n in by_contract[c.name]]  # dense, paged, ragged
    for c in contracts.CONTRACTS.values():
        assert by_contract[c.name] and {n for n, b in c.builtins.items() if b.kind != "kernel"} <= set(by_contract[c.name])
    assert set(by_contract["paged"]) <= set(PAGED_BUILTIN) and set(by_contract["attention"]) <= set(BUILTIN)


def test_paged_entries_carry_their_contract_and_their_own_totals(swept):
    entries = {e["candidate"]: e for e in swept["candidates"]}
    assert {n: e["contract"] for n, e in entries.items()} == {
        "reference": "attention", "zeros": "attention", "paged-reference": "paged", "paged-kv-swapped": "paged"}
    assert entries["paged-kv-swapped"]["rejected"] == 2
    assert entries["paged-kv-swapped"]["rejected_by"] == {c: 2 for c in resolve("paged-kv-swapped").catches}
    assert swept["by_contract"] == {
        "attention": {"false_rejects": 0, "correct_trials": 2, "missed_bad": 0, "bad_trials": 2},
        "paged": {"false_rejects": 0, "correct_trials": 2, "missed_bad": 0, "bad_trials": 2}}
    assert (swept["correct_trials"], swept["bad_trials"]) == (4, 4)
    assert swept["paged_shapes"] and {"page_size", "num_pages"} <= set(swept["paged_shapes"][0])
    assert "paged-permutation" in swept["paged_checks"]
    text = P.power_markdown(swept)
    assert "| paged-kv-swapped | paged | known-bad | 2 | 2 |" in text and "| zeros | attention | known-bad |" in text
    assert "paged: false rejects 0 of 2, known-bad not rejected 0 of 2" in text


def test_a_dense_sweep_says_nothing_of_the_paged_rubric(monkeypatch):
    monkeypatch.setattr(P, "grade_seeds", _stub)
    power = P.measure_power(seeds=1, candidates=["reference", "zeros"], progress=False, level="quick")
    assert "paged_shapes" not in power and list(power["by_contract"]) == ["attention"]
    assert "Paged contract" not in P.power_markdown(power)


def _table(power: dict) -> str:
    docs = power_documents(json.loads(json.dumps(power)), {**testing.documents()["environment"],
                                                          "run_id": "grader-power-20260101t000000z"})
    for name in rawio.DOCUMENTS:  # the record's schema holds the contracts too
        rawio.validate(name, docs[name])
    files = {f"{name}.json": "0" * 64 for name in rawio.DOCUMENTS}
    run = {"manifest": {"format_version": 1, "run_id": docs["environment"]["run_id"], "files": files}, **docs}
    return card.power(tables.record_tables(rules.accept(run))["correctness"])


def test_the_cards_table_shows_both_contracts(swept):
    text = _table(swept)
    assert "| paged-kv-swapped | paged | known-bad | reject | 2 | 2 | 100% |" in text
    assert "| reference | attention | reference | pass | 2 | 0 | 0% |" in text
    assert "Contracts swept: attention, paged.\n" in text and "paged shapes " in text
    damaged = json.loads(json.dumps(swept))
    damaged["candidates"][3]["rejected"] = 1  # the totals no longer follow
    with pytest.raises(rawio.RunError, match="power-derived"):
        _table(damaged)


def test_a_record_without_the_paged_builtins_says_so(monkeypatch):
    monkeypatch.setattr(P, "grade_seeds", _stub)
    power = P.measure_power(seeds=1, candidates=["reference", "zeros"], progress=False, level="quick")
    assert "Contracts swept: attention (the paged built-ins are not in this record).\n" in _table(power)


@pytest.mark.slow  # three paged built-ins graded at the quick level in their workers: about a minute of CPU
def test_the_paged_rubric_rejects_a_known_bad_paged_builtin_in_the_sweep():
    power = P.measure_power(seeds=1, candidates=["paged-reference", "paged-kv-swapped", "paged-pool-order"],
                            progress=False, level="quick")
    entries = {e["candidate"]: e for e in power["candidates"]}
    assert (entries["paged-reference"]["rejected"], entries["paged-reference"]["load_error"]) == (0, None)
    assert entries["paged-kv-swapped"]["rejected"] == 1 and entries["paged-kv-swapped"]["rejected_by_intended"] == 1
    assert entries["paged-pool-order"]["rejected_by"] == {"paged-permutation": 1}
    assert power["by_contract"]["paged"] == {"false_rejects": 0, "correct_trials": 1, "missed_bad": 0,
                                             "bad_trials": 2}


def test_the_latest_sweep_of_each_contract_is_shown_unfolded(monkeypatch):
    """A newer paged-only record does not fold away the latest dense one; older records of a contract do fold."""
    monkeypatch.setattr(P, "grade_seeds", _stub)
    dense = P.measure_power(seeds=1, candidates=["reference", "zeros"], progress=False, level="quick")
    paged = P.measure_power(seeds=1, candidates=["paged-reference", "paged-kv-swapped"], progress=False, level="quick")
    sweeps = [("grader-power-20260101t000000z", dense), ("grader-power-20260102t000000z", dense),
              ("grader-power-20260103t000000z", paged)]
    tables_of = []
    for rid, power in sweeps:
        docs = power_documents(json.loads(json.dumps(power)), {**testing.documents()["environment"], "run_id": rid})
        files = {f"{name}.json": "0" * 64 for name in rawio.DOCUMENTS}
        run = {"manifest": {"format_version": 1, "run_id": rid, "files": files}, **docs}
        tables_of.append(tables.record_tables(rules.accept(run))["correctness"])
    import pyarrow as pa

    text = card.power(pa.concat_tables(tables_of))
    shown, folded = text.split("<details>")
    assert shown.index("grader-power-20260103t000000z") < shown.index("grader-power-20260102t000000z")
    assert "grader-power-20260101t000000z" not in shown and "grader-power-20260101t000000z" in folded
