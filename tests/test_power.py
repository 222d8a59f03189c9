"""sweeps.power: false rejects, power on known-bad candidates, the JSON format and its Markdown.

Grades run in-process (tests/grading_inprocess.py) at the quick level; every count is asserted exactly,
so a wrong rate (a correct candidate rejected, a known-bad one missed, a miscounted total) fails."""

import json

import pytest

from tpu_kernel_records_tools.cli.rubric import main
from tpu_kernel_records_tools.sweeps import power as P
from tpu_kernel_records_tools.grading.rubric import CheckResult, Scorecard
from tpu_kernel_records_tools.records import rawio
from tests import grading_inprocess


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setattr(P, "grade_seeds", grading_inprocess.grade_seeds)


@pytest.mark.slow  # a power sweep of every built-in (about 30 CPU-s)
def test_power_counts_rejections_and_validates():
    power = P.measure_power(seeds=2, candidates=["reference", "zeros", "missing-mask"], progress=False,
                            first_seed=7, level="quick")
    entries = {e["candidate"]: e for e in power["candidates"]}
    assert power["seeds"] == 2 and power["first_seed"] == 7 and power["level"] == "quick"
    assert entries["reference"] == {**entries["reference"], "trials": 2, "rejected": 0, "rejected_by": {},
                                    "expected": "pass"}
    assert entries["zeros"]["trials"] == 2 and entries["zeros"]["rejected"] == 2
    assert entries["zeros"]["rejected_by"]["forward-accuracy"] == 2
    assert entries["missing-mask"]["rejected"] == 2 and entries["missing-mask"]["rejected_by"]["padding-leak"] == 2
    assert entries["missing-mask"]["rejected_by_intended"] == 2
    assert (power["false_rejects"], power["correct_trials"]) == (0, 2)
    assert (power["missed_bad"], power["bad_trials"]) == (0, 4)
    assert power["policy"]["k"]["forward"] > 1
    calibration = entries["reference"]["calibration"]
    assert calibration["forward/float32"]["needed_k"] <= 1.0 + 1e-6  # the reference is its own baseline
    assert entries["zeros"]["min_k_to_pass_tolerances"] is None or entries["zeros"]["min_k_to_pass_tolerances"] > 1e3
    doc = {"format_version": 1, "run_id": "power-test", "source": "measured", "seed": 7,
           "measured_candidate": "reference",
           "scorecards": [{"candidate": "reference", "kind": "reference", "passed": True, "score": 1,
                           "max_score": 1, "checks": []}],
           "power": json.loads(json.dumps(power, allow_nan=False))}
    rawio.validate("correctness", doc)
    text = P.power_markdown(power)
    assert "| zeros | attention | known-bad | 2 | 2 |" in text
    assert "| reference | attention | reference | 2 | 0 |" in text
    assert "False rejects of correct candidates: 0 of 2" in text and "not rejected: 0 of 4" in text


def _card(name, kind, passed, failed=()):
    checks = [CheckResult(c, c not in failed, 0.0 if c in failed else 1.0, 1.0, "x") for c in ("a", "b")]
    card = Scorecard(name, kind, checks)
    assert card.passed == passed
    return card


def test_rates_count_what_happened(monkeypatch):
    """A correct candidate rejected once and a known-bad one missed once are counted as such."""
    from tpu_kernel_records_tools.grading.candidates import Candidate

    good = Candidate("good", "correct-variant", "ok", lambda: None)
    bad = Candidate("bad", "known-bad", "bug", lambda: None, catches=("a",))
    outcomes = {"good": [True, False, True], "bad": [False, True, False]}

    def fake(cand, seeds, **kw):
        return [_card(cand.name, cand.kind, outcomes[cand.name][s], () if outcomes[cand.name][s] else ("a",))
                for s in seeds]

    monkeypatch.setattr(P, "grade_seeds", fake)
    power = P.measure_power(seeds=3, candidates=[good, bad], progress=False, level="quick")
    entries = {e["candidate"]: e for e in power["candidates"]}
    assert (entries["good"]["trials"], entries["good"]["rejected"]) == (3, 1)
    assert (entries["bad"]["trials"], entries["bad"]["rejected"], entries["bad"]["rejected_by_intended"]) == (3, 2, 2)
    assert (power["false_rejects"], power["correct_trials"]) == (1, 3)
    assert (power["missed_bad"], power["bad_trials"]) == (1, 3)
    assert "False rejects of correct candidates: 1 of 3" in P.power_markdown(power)


def test_kernel_seeds_limit_kernels_only(monkeypatch):
    from tpu_kernel_records_tools.grading.candidates import Candidate

    seen = {}

    def fake(cand, seeds, **kw):
        seen.setdefault(cand.name, []).extend(seeds)
        return [_card(cand.name, cand.kind, True) for _ in seeds]

    monkeypatch.setattr(P, "grade_seeds", fake)
    cands = [Candidate("k", "kernel", "k", lambda: None), Candidate("v", "correct-variant", "v", lambda: None)]
    power = P.measure_power(seeds=6, candidates=cands, progress=False, first_seed=10, kernel_seeds=2,
                            level="quick")
    assert seen == {"k": [10, 11], "v": list(range(10, 16))}
    assert [e["trials"] for e in power["candidates"]] == [2, 6]


def test_full_level_lists_every_seeds_shapes():
    shapes = P._shapes(2, 5, "full")
    assert {s["name"].split("@")[1] for s in shapes} == {"5", "6"}
    assert any(s["kv_len"] > 2048 for s in shapes)


@pytest.mark.slow  # two quick scorecards through the CLI: about 45 s
def test_power_cli_writes_json_and_markdown(tmp_path, capsys):
    js, md = tmp_path / "power.json", tmp_path / "power.md"
    assert main(["--power", "--seeds", "1", "--candidate", "reference", "--candidate", "wrong-gqa",
                 "--quick", "--json", str(js), "--markdown", str(md), "--quiet", "--workers", "0"]) == 0
    power = json.loads(js.read_text())["power"]
    assert [e["candidate"] for e in power["candidates"]] == ["reference", "wrong-gqa"]
    assert [e["rejected"] for e in power["candidates"]] == [0, 1]
    assert md.read_text() in capsys.readouterr().out
