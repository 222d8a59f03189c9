"""sweeps.calibration on Dask: one task per slot group, every trial appended by the client as its group
arrives, ``--resume`` grading nothing twice, a killed worker's group graded again, the same trials as a serial
run.

The default run checks the bookkeeping with a cheap fake group (``tests/sweep_tasks.py``) on a real 2-worker
``LocalCluster``; the slow run calibrates a correct built-in without features (online-softmax, the cheapest)
at the quick level on one seed of each set through the command, serially, with ``--workers 2`` and against a scheduler with two ``dask worker`` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sweep_tasks
from test_sweep import remote_cluster  # noqa: F401  (a fixture)
from tpu_kernel_records_tools.cli.main import main
from tpu_kernel_records_tools.sweeps import calibration as cal
from tpu_kernel_records_tools.sweeps import trials_file


@pytest.fixture
def attempts(tmp_path, monkeypatch):
    folder = tmp_path / "attempts"
    folder.mkdir()
    monkeypatch.setenv("SWEEP_TEST_DIR", str(folder))
    monkeypatch.setattr(cal, "distribution_digest", lambda level="full": "today")
    return lambda name, seed: len(list(folder.glob(f"{name}-{seed}-*")))


def _held(path: Path) -> list[tuple[str, int]]:
    return [(line["trial"]["candidate"], line["trial"]["seed"]) for line in trials_file.read(path).lines]


def test_each_slot_group_is_one_task_and_every_trial_reaches_the_file(tmp_path, attempts):
    tasks = cal.calibration_tasks(6, ["a", "b"])  # groups 0-4, 1000-1004, 5, 1005
    out = tmp_path / "trials.jsonl"
    result = cal.run(tasks, level="quick", out=out, workers=2, progress=False, task=sweep_tasks.fake_group)
    assert sorted(_held(out)) == sorted(tasks) and len(_held(out)) == len(tasks) == 24
    assert result.graded == 24 and result.remaining == 0 and not result.notes
    assert [r["candidate"] for r in result.trials] == [c for c, _ in tasks]
    assert all(attempts(c, s) == 1 for c, s in tasks)
    calls = sorted(f.name.rsplit("-", 1)[0] for f in Path(os.environ["SWEEP_TEST_DIR"]).glob("group-*"))
    assert calls == ["group-0-1-2-3-4", "group-1000-1001-1002-1003-1004", "group-1005", "group-5"]


def test_resume_on_dask_grades_nothing_twice(tmp_path, attempts):
    tasks = cal.calibration_tasks(2, ["a", "b"])
    out = tmp_path / "trials.jsonl"
    earlier = dict(sweep_tasks.record("a", 1000), cpu_s=9.0, shared_cpu_s=0.0)  # marked: it must come back as it was
    out.write_text(json.dumps(cal.header("quick", "today")) + "\n" + json.dumps({"trial": earlier}) + "\n")
    result = cal.run(tasks, level="quick", out=out, resume=True, workers=2, progress=False,
                     task=sweep_tasks.fake_group)
    assert result.graded == len(tasks) - 1 and result.trials[tasks.index(("a", 1000))] == earlier
    assert attempts("a", 1000) == 0 and all(attempts(c, s) == 1 for c, s in tasks if (c, s) != ("a", 1000))
    again = cal.run(tasks, level="quick", out=out, resume=True, workers=2, progress=False, task=sweep_tasks.fake_group)
    assert again.graded == 0 and sorted(_held(out)) == sorted(tasks)


def test_a_killed_workers_group_is_graded_again_and_loses_no_trial(tmp_path, attempts):
    tasks = [("dies-once", 0), ("a", 0), ("a", 1000)]
    out = tmp_path / "trials.jsonl"
    result = cal.run(tasks, level="quick", out=out, workers=2, progress=False, task=sweep_tasks.fake_group)
    assert attempts("dies-once", 0) == 2 and attempts("a", 1000) == 1
    assert sorted(_held(out)) == sorted(tasks) and result.remaining == 0 and not result.notes


def test_a_group_that_keeps_failing_is_named_and_left_to_resume(tmp_path, attempts):
    tasks = [("broken", 0), ("a", 0), ("a", 1000)]
    result = cal.run(tasks, level="quick", workers=2, progress=False, task=sweep_tasks.fake_group)
    assert attempts("broken", 0) == 2 and result.remaining == 2 and [r["seed"] for r in result.trials] == [1000]
    assert result.notes == ["slot group of seeds 0-0 (2 trials) failed twice (RuntimeError: broken on attempt 2); "
                            "`--resume` grades it again"]


def test_max_minutes_with_dask_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "trials.jsonl"
    assert main(["calibrate", "--seeds", "1", "--workers", "2", "--max-minutes", "5", "--trials", str(out)]) == 2
    assert main(["calibrate", "--seeds", "1", "--workers", "-1", "--trials", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "--max-minutes runs serially" in err and not out.exists()


# --------------------------------------------------------------------------------------------------
# The real thing, through the command (slow: a quick-level trial per seed and set, three times).

def _calibrate(tmp_path: Path, name: str, *more: str) -> tuple[list[dict], list[str]]:
    trials, report = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.md"
    done = subprocess.run([sys.executable, "-m", "tpu_kernel_records_tools", "calibrate", "--quick", "--seeds", "1",
                           "--candidate", "online-softmax", "--trials", str(trials), "--markdown", str(report), "--quiet",
                           *more], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    records = sorted((line["trial"] for line in trials_file.read(trials).lines), key=lambda r: r["seed"])
    verdicts = [{k: r[k] for k in ("candidate", "seed", "passed", "failed", "error", "groups", "worst_k",
                                   "slots_from")} for r in records]
    # the table, the rule and the floor; not the CPU seconds, which differ from run to run
    table = [line for line in report.read_text().splitlines() if line.startswith(("|", "Rule:", "Floor:"))]
    return verdicts, table


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_serial_local_and_remote_calibrations_write_the_same_trials(tmp_path, remote_cluster):  # noqa: F811
    serial = _calibrate(tmp_path, "serial")
    assert [r["seed"] for r in serial[0]] == [0, 1000] and all(r["passed"] for r in serial[0])
    assert _calibrate(tmp_path, "local", "--workers", "2") == serial
    assert _calibrate(tmp_path, "remote", "--scheduler", remote_cluster) == serial
