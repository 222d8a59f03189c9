"""tpu-kernel-rubric: exit codes 0/1/2, readable scorecards, schema-valid --json, --list."""

import json

import pytest

from records import rawio
from grading.candidates import BUILTIN
from cli.rubric import main


def _valid(doc):
    rawio.validate("correctness", {"format_version": 1, "run_id": "rubric-cli-test", "source": "measured",
                                   "seed": 0, "measured_candidate": "reference",
                                   "scorecards": doc["scorecards"], "power": None})


def test_passing_candidate_exits_0_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sub" / "cards.json"
    assert main(["--candidate", "reference", "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "reference [reference] PASSED 100/100" in text and "PASS  causal-leak" in text
    doc = json.loads(out.read_text())
    assert [c["candidate"] for c in doc["scorecards"]] == ["reference"]
    assert set(doc["scorecards"][0]) == {"candidate", "kind", "passed", "score", "max_score", "error", "checks"}
    assert set(doc["scorecards"][0]["checks"][0]) == {"name", "passed", "points", "max_points", "detail",
                                                      "error", "tolerance", "baseline_error"}
    _valid(doc)
    assert not list(out.parent.glob(".*.tmp"))


def test_failing_candidate_exits_1(tmp_path, capsys):
    out = tmp_path / "cards.json"
    assert main(["--candidate", "reference", "--candidate", "ignores-causal", "--json", str(out),
                 "--quiet"]) == 1
    text = capsys.readouterr().out
    assert "ignores-causal [known-bad] FAILED" in text and "FAIL  causal-leak" in text
    doc = json.loads(out.read_text())
    assert [c["passed"] for c in doc["scorecards"]] == [True, False]
    _valid(doc)


@pytest.mark.parametrize("argv", [[], ["--candidate", "no-such-candidate"], ["--candidate", "x.py"],
                                  ["--power"], ["--seed", "not-a-number", "--candidate", "reference"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_load_error_exits_2_with_a_scorecard(tmp_path, capsys):
    out = tmp_path / "cards.json"
    assert main(["--candidate", f"{tmp_path / 'absent.py'}:attention", "--json", str(out), "--quiet"]) == 2
    assert "could not be graded" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["scorecards"][0]["error"] and doc["scorecards"][0]["kind"] == "external"
    _valid(doc)


def test_list_names_every_builtin(capsys):
    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    for name, cand in BUILTIN.items():
        assert name in text and cand.kind in text
    assert "top-left" in text


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--candidate" in capsys.readouterr().out
