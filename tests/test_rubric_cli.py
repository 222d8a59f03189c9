"""tpu-kernel-rubric: exit codes 0/1/2, readable scorecards, schema-valid --json (with its sha256
printed), --list, --version, --timeout (alias --time-limit). Graded at the quick level."""

import hashlib
import json
import re

import pytest

from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.grading.candidates import BUILTIN
from tpu_kernel_records_tools.cli.rubric import main
from tpu_kernel_records_tools.sandbox import memcg, syscalls


def _valid(doc):
    rawio.validate("correctness", {"format_version": 1, "run_id": "rubric-cli-test", "source": "measured",
                                   "seed": 0, "measured_candidate": "reference",
                                   "scorecards": doc["scorecards"], "power": None})


@pytest.mark.slow  # a whole grade in a worker (about 15 CPU-s); test_docs grades the example through the CLI by default
def test_passing_candidate_exits_0_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sub" / "cards.json"
    assert main(["--candidate", "reference", "--json", str(out), "--quiet", "--quick", "--features", "sinks"]) == 0
    text = capsys.readouterr().out
    printed = re.search(r"wrote .*cards.json \(sha256 ([0-9a-f]{64})\)", text).group(1)
    assert printed == hashlib.sha256(out.read_bytes()).hexdigest()
    assert "reference [reference] PASSED 108/108 (isolation: process; features: sinks)" in text
    assert "PASS  causal-leak" in text and "PASS  sinks" in text and "window" not in text
    doc = json.loads(out.read_text())
    assert [c["candidate"] for c in doc["scorecards"]] == ["reference"]
    assert set(doc["scorecards"][0]) == {"candidate", "kind", "passed", "score", "max_score", "error", "level",
                                         "isolation", "memory_limit", "syscall_filter", "features", "checks"}
    assert doc["scorecards"][0]["features"] == ["sinks"]
    assert doc["scorecards"][0]["isolation"] == "process"  # a built-in, under --isolation auto
    assert doc["scorecards"][0]["memory_limit"] == ("cgroup" if memcg.unavailable_reason() is None else "address-space")
    assert doc["scorecards"][0]["level"] == "quick"
    assert doc["scorecards"][0]["syscall_filter"] == ("seccomp" if syscalls.warning("x") is None else "none")
    assert set(doc["scorecards"][0]["checks"][0]) == {"name", "passed", "points", "max_points", "detail",
                                                      "error", "tolerance", "baseline_error"}
    _valid(doc)
    assert not list(out.parent.glob(".*.tmp"))


@pytest.mark.slow  # the passing path runs in the default run
def test_failing_candidate_exits_1(tmp_path, capsys):
    out = tmp_path / "cards.json"
    assert main(["--candidate", "reference", "--candidate", "ignores-causal", "--json", str(out),
                 "--quiet", "--quick"]) == 1
    text = capsys.readouterr().out
    assert "ignores-causal [known-bad] FAILED" in text and "FAIL  causal-leak" in text
    doc = json.loads(out.read_text())
    assert [c["passed"] for c in doc["scorecards"]] == [True, False]
    _valid(doc)


@pytest.mark.parametrize("argv", [[], ["--candidate", "no-such-candidate"], ["--candidate", "x.py"],
                                  ["--power"], ["--seed", "not-a-number", "--candidate", "reference"],
                                  ["--timeout", "0", "--candidate", "reference"],
                                  ["--time-limit", "nan", "--candidate", "reference"],
                                  ["--memory-limit", "-1", "--candidate", "reference"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_load_error_is_a_failing_scorecard_exit_1(tmp_path, capsys):
    out = tmp_path / "cards.json"
    assert main(["--candidate", f"{tmp_path / 'absent.py'}:attention", "--json", str(out), "--quiet"]) == 1
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
    text = capsys.readouterr().out
    assert "--candidate" in text and "--timeout" in text and "--memory-limit" in text


def test_version_exits_0(capsys):
    from importlib.metadata import version
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tpu-kernel-rubric {version('tpu-kernel-records')}"


def test_time_limit_is_an_alias_of_timeout():
    from tpu_kernel_records_tools.cli.rubric import _parser
    assert _parser().parse_args(["--time-limit", "7"]).time_limit == _parser().parse_args(["--timeout", "7"]).time_limit == 7


@pytest.mark.parametrize("argv, error", [(["--features", "alibi"], "unknown feature 'alibi'"),
                                         (["--features", "window,bogus"], "unknown feature 'bogus'")])
def test_an_unknown_feature_is_a_usage_error(argv, error, capsys):
    assert main(["--candidate", "reference", "--quick", *argv]) == 2
    assert error in capsys.readouterr().err


def test_a_feature_the_candidate_does_not_declare_is_the_scorecards_error(capsys):
    assert main(["--candidate", "zeros", "--quick", "--quiet", "--features", "window"]) == 1
    text = capsys.readouterr().out
    assert "could not be graded: asked to grade feature(s) window, which the candidate does not declare" in text
