"""A grader-power record (issue 9 §4): a power summary measured on a CPU goes into data/ through the builder,
labelled, and the card's power table is generated from it. SYNTHETIC power summaries only."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

import tpu_kernel_records as tkr

import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.builder.grader_power import power_documents, write_power_run
from tpu_kernel_records_tools.builder.publish import publish
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.records import rawio
from release_fixtures import PUBLISHED

RUN_ID = "grader-power-20260101t000000z"


def _power() -> dict:
    power = copy.deepcopy(testing.documents()["correctness"]["power"])
    power["candidates"][1]["expected"] = "pass"
    power.update(false_rejects=0, correct_trials=4, missed_bad=0, bad_trials=4, level="full")
    return power


def _environment() -> dict:
    env = testing.documents(RUN_ID)["environment"]
    return {**env, "notes": None}


@pytest.fixture
def ws(tmp_path) -> Path:
    ws = testing.workspace(tmp_path / "ws")
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


def test_power_record_builds_labelled_and_fills_the_cards_table(ws, tmp_path):
    (tmp_path / "power.json").write_text(json.dumps({"power": _power()}))
    run = write_power_run(tmp_path / "power.json", ws / "runs", _environment())
    assert build([run], ws / "data") == [RUN_ID]  # no --allow-interpret: it states no kernel speed
    data = ws / "data"
    # No benchmark rows, so no benchmark file (datasets cannot read an empty parquet file).
    assert not (data / "benchmark" / f"{RUN_ID}.parquet").exists()
    rows = pq.read_table(data / "correctness" / f"{RUN_ID}.parquet").to_pylist()
    assert {(r["row_kind"], r["source"], r["platform"], r["interpret"]) for r in rows} == {
        ("power", "grader-power", "cpu", True)}
    assert [r["candidate"] for r in rows] == ["ignores-causal", "reference"]
    assert rows[0]["power_settings"]["false_rejects"] == 0 and rows[0]["power_settings"]["other"] == [
        {"name": "level", "json": '"full"'}]
    (env,) = pq.read_table(data / "environment" / f"{RUN_ID}.parquet").to_pylist()
    assert env["notes"].startswith("Grader power:") and "not kernel speed" in env["notes"]
    card = (ws / "dataset_card.md").read_text()
    assert f"| `{RUN_ID}` | ignores-causal | attention | known-bad | reject | 4 | 4 | 100% | causal-mask: 4 | — |" in card
    assert (f"Record `{RUN_ID}` (measured on cpu: the grader's numerics, not kernel speed): 2 seeds (0..1); "
            "shapes A 1x8x8 4/2 heads d8; tolerance k forward 2.0, gradient 3.0, floor 1e-06; false rejects 0 of "
            "4 correct trials; missed 0 of 4 known-bad trials.") in card
    assert verify(data) == []
    # Every config loads, through the parquet route and through the script.
    dest = publish(ws, "me/tpu-kernel-records", stage_dir=ws / "release", out=lambda line: None)
    for config, rows in (("benchmark", 20), ("correctness", 9), ("environment", 2)):
        ds = datasets.load_dataset(str(ws / "release"), config, split="train", cache_dir=str(tmp_path / "c"))
        script = tkr.load(config, data_dir=ws / "release" / "data", cache_dir=str(tmp_path / "s"))
        assert ds.num_rows == script.num_rows == rows
        assert (RUN_ID in ds["record_id"]) == (RUN_ID in script["record_id"]) == (config != "benchmark")
    assert "README.md" in dest.files


@pytest.mark.parametrize("edit, rule, field", [
    (lambda d: d["correctness"]["power"].update(false_rejects=1), "power-derived", "power/false_rejects"),
    (lambda d: d["correctness"]["power"]["candidates"][0].update(rejected=5), "power-derived",
     "power/candidates/0/rejected"),
    (lambda d: d["correctness"].update(power=None), "schema", "power"),
    (lambda d: d["benchmark"]["cases"].append(testing.documents()["benchmark"]["cases"][0]), "schema", "cases"),
    (lambda d: d["environment"]["env_vars"].update(KAGGLE_KEY="k" * 32), "env-allow-list", "env_vars/KAGGLE_KEY"),
])
def test_damaged_power_record_is_refused(ws, edit, rule, field):
    docs = power_documents(_power(), _environment())
    run = rawio.write_run(ws / "runs" / RUN_ID, power_documents(_power(), _environment()))
    edit(docs)
    for name in rawio.DOCUMENTS:
        testing.rewrite(run, name, docs[name])
    with pytest.raises(BuildError) as err:
        build([run], ws / "data")
    assert (err.value.rule, err.value.field) == (rule, field), str(err.value)


def test_cli_wraps_a_rubric_power_json_with_this_machines_environment(ws, tmp_path, capsys):
    (tmp_path / "power.json").write_text(json.dumps({"power": _power()}))
    code = commands.main(["build", "--grader-power", str(tmp_path / "power.json"), "--data", str(ws / "data"),
                          "--quiet"])
    assert code == 0, capsys.readouterr().err
    (record,) = [p.name for p in (ws / "data" / "raw").iterdir() if p.name.startswith("grader-power-")]
    env = json.loads((ws / "data" / "raw" / record / "environment.json").read_text())
    assert (env["source"], env["platform"], env["interpret"]) == ("grader-power", "cpu", True)
    assert verify(ws / "data") == []
    (tmp_path / "nothing.json").write_text("{}")
    assert commands.main(["build", "--grader-power", str(tmp_path / "nothing.json"), "--data", str(ws / "data")]) == 1
    assert "no grader-power summary" in capsys.readouterr().err
