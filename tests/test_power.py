"""grading.power: false rejects, power on known-bad candidates, the JSON format and its Markdown."""

import json

from records import rawio
from grading.power import measure_power, power_markdown
from cli.rubric import main


def test_power_counts_rejections_and_validates(tmp_path):
    power = measure_power(seeds=2, candidates=["reference", "zeros", "missing-mask"], progress=False,
                          first_seed=7)
    entries = {e["candidate"]: e for e in power["candidates"]}
    assert power["seeds"] == 2 and power["first_seed"] == 7
    assert entries["reference"] == {**entries["reference"], "trials": 2, "rejected": 0, "rejected_by": {},
                                    "expected": "pass"}
    assert entries["zeros"]["rejected"] == 2 and entries["zeros"]["rejected_by"]["forward-accuracy"] == 2
    assert entries["missing-mask"]["rejected_by"]["padding-leak"] == 2
    assert entries["missing-mask"]["rejected_by_intended"] == 2
    assert power["false_rejects"] == 0 and power["missed_bad"] == 0
    assert power["policy"]["k"]["forward"] > 1
    calibration = entries["reference"]["calibration"]
    assert calibration["forward/float32"]["needed_k"] <= 1.0 + 1e-6
    doc = {"format_version": 1, "run_id": "power-test", "source": "measured", "seed": 7,
           "measured_candidate": "reference",
           "scorecards": [{"candidate": "reference", "kind": "reference", "passed": True, "score": 1,
                           "max_score": 1, "checks": []}],
           "power": json.loads(json.dumps(power, allow_nan=False))}
    rawio.validate("correctness", doc)
    text = power_markdown(power)
    assert "| zeros | known-bad | 2 | 2 |" in text and "False rejects of correct candidates: 0 of 2" in text


def test_power_cli_writes_json_and_markdown(tmp_path, capsys):
    js, md = tmp_path / "power.json", tmp_path / "power.md"
    assert main(["--power", "--seeds", "1", "--candidate", "reference", "--candidate", "wrong-gqa",
                 "--json", str(js), "--markdown", str(md), "--quiet"]) == 0
    power = json.loads(js.read_text())["power"]
    assert [e["candidate"] for e in power["candidates"]] == ["reference", "wrong-gqa"]
    assert md.read_text() in capsys.readouterr().out
