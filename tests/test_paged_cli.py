"""``tpu-kernel-rubric --paged``: paged candidates graded through the sandboxed worker, the scorecard
schema-valid with ``contract: paged``, usage errors one line each."""

import json

import jsonschema
import pytest

from tpu_kernel_records_tools.cli import rubric as cli
from tpu_kernel_records_tools.grading.candidates import PAGED_BUILTIN
from tpu_kernel_records_tools.grading.paged.checks import PAGED_CHECKS
from tpu_kernel_records_tools.records.rawio import load_schema


def _valid_scorecard(card: dict) -> None:
    schema = load_schema("correctness")
    jsonschema.Draft202012Validator({**schema["$defs"]["scorecard"], "$defs": schema["$defs"]}).validate(card)


def test_list_shows_the_paged_builtins(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PAGED_BUILTIN)


def test_a_feature_that_does_not_apply_is_a_usage_error(capsys):
    assert cli.main(["--paged", "--candidate", "paged-reference", "--features", "segments"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "paged_attention's features are window, softcap, sinks" in err and "\n" not in err


def test_a_paged_file_that_cannot_load_gets_a_schema_valid_paged_scorecard(tmp_path, capsys):
    """Through the worker (no compile: the file raises on import); every paged check fails as 'not run'."""
    bad = tmp_path / "broken.py"
    bad.write_text("raise ImportError('no kernel here')\n")
    out = tmp_path / "card.json"
    status = cli.main(["--paged", "--candidate", f"{bad}:paged_attention", "--isolation", "process", "--quiet",
                       "--json", str(out)])
    assert status == cli.EXIT_FAILED
    card = json.loads(out.read_text())["scorecards"][0]
    _valid_scorecard(card)
    assert card["contract"] == "paged" and "no kernel here" in card["error"]
    assert [c["name"] for c in card["checks"]] == [c.name for c in PAGED_CHECKS] + ["finite"]


@pytest.mark.slow
def test_paged_reference_passes_the_quick_level_through_the_cli(tmp_path, capsys):
    out = tmp_path / "card.json"
    assert cli.main(["--paged", "--candidate", "paged-reference", "--quick", "--quiet", "--json", str(out)]) == 0
    card = json.loads(out.read_text())["scorecards"][0]
    _valid_scorecard(card)
    assert card["passed"] and card["contract"] == "paged" and card["features"] == ["window", "softcap", "sinks"]
    assert {c["name"] for c in card["checks"]} >= {"paged-accuracy", "paged-garbage", "paged-long", "paged-window"}


@pytest.mark.slow
def test_a_known_bad_fails_its_check_through_the_worker(tmp_path, capsys):
    out = tmp_path / "card.json"
    assert cli.main(["--candidate", "paged-int16-page-indices", "--quick", "--quiet", "--json", str(out)]) == 1
    card = json.loads(out.read_text())["scorecards"][0]
    _valid_scorecard(card)
    failed = {c["name"] for c in card["checks"] if not c["passed"]}
    assert "paged-long" in failed and "paged-accuracy" not in failed
