"""sweeps.sweep: trials on Dask or in-process, streamed to JSON Lines, resumed, retried once, reported.

The default run checks the bookkeeping with cheap fake trials (``tests/sweep_tasks.py``) on a real
2-worker ``LocalCluster``; the slow run grades a real sweep (2 seeds, a correct and a known-bad built-in,
quick level) serially, on a ``LocalCluster`` and on a scheduler with two ``dask worker`` processes that the
test starts on 127.0.0.1, and through the CLI killed mid-sweep and resumed: the same summary and report.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sweep_tasks
from tpu_kernel_records_tools.sweeps import power, sweep
from tpu_kernel_records_tools.grading.candidates import resolve


@pytest.fixture
def attempts(tmp_path, monkeypatch):
    folder = tmp_path / "attempts"
    folder.mkdir()
    monkeypatch.setenv("SWEEP_TEST_DIR", str(folder))
    return lambda name, seed: len(list(folder.glob(f"{name}-{seed}-*")))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_task_that_keeps_failing_is_tried_twice_then_reported_never_dropped(tmp_path, attempts):
    out = tmp_path / "trials.jsonl"
    tasks = [("ok", 0), ("broken", 0), ("ok", 1)]
    result = sweep.run(tasks, level="quick", out=out, workers=2, progress=False, task=sweep_tasks.fake_trial)
    assert [(r["candidate"], r["seed"]) for r in result.trials] == [("ok", 0), ("ok", 1)]
    assert [(f["candidate"], f["seed"]) for f in result.failed] == [("broken", 0)]
    assert "RuntimeError: broken on attempt 2" == result.failed[0]["error"]
    assert (attempts("broken", 0), attempts("ok", 0), attempts("ok", 1)) == (2, 1, 1)
    lines = _lines(out)
    assert lines[0] == {"sweep": {"format": sweep.FORMAT, "kind": "power", "level": "quick", "tasks": 3}}
    assert [line.get("failed", {}).get("candidate") for line in lines[1:]].count("broken") == 1
    assert sum("trial" in line for line in lines) == 2


def test_a_task_whose_worker_dies_is_tried_again(tmp_path, attempts):
    result = sweep.run([("dies-once", 0), ("ok", 1)], level="quick", workers=2, progress=False,
                       task=sweep_tasks.fake_trial)
    assert not result.failed and [r["candidate"] for r in result.trials] == ["dies-once", "ok"]
    assert attempts("dies-once", 0) == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_grades_only_the_missing_trials_and_keeps_the_rest(tmp_path, attempts, workers):
    out = tmp_path / "trials.jsonl"
    tasks = [("ok", 0), ("ok", 1), ("ok", 2)]
    header = {"sweep": {"format": sweep.FORMAT, "kind": "power", "level": "quick", "tasks": 3}}
    earlier = dict(sweep_tasks.record("ok", 1), seconds=123.0)  # marked: it must come back as it was
    out.write_text(json.dumps(header) + "\n" + json.dumps({"trial": earlier}) + "\n")
    result = sweep.run(tasks, level="quick", out=out, resume=True, workers=workers, progress=False,
                       task=sweep_tasks.fake_trial)
    assert [r["seed"] for r in result.trials] == [0, 1, 2] and result.trials[1] == earlier
    assert (attempts("ok", 0), attempts("ok", 1), attempts("ok", 2)) == (1, 0, 1)
    assert len(_lines(out)) == 4


def test_a_file_of_another_sweep_or_one_that_exists_is_refused(tmp_path, attempts):
    out = tmp_path / "trials.jsonl"
    out.write_text(json.dumps({"sweep": {"format": sweep.FORMAT, "kind": "calibration", "level": "full",
                                         "tasks": 1}}) + "\n")
    with pytest.raises(ValueError, match="holds another sweep"):
        sweep.run([("ok", 0)], level="quick", out=out, resume=True, workers=0, task=sweep_tasks.fake_trial)
    with pytest.raises(FileExistsError, match="--resume"):
        sweep.run([("ok", 0)], level="quick", out=out, workers=0, task=sweep_tasks.fake_trial)
    assert attempts("ok", 0) == 0


# --------------------------------------------------------------------------------------------------
# A real sweep, wherever it runs (slow: about two minutes of grading on 2 cores).

TASKS = [("reference", 0), ("zeros", 0), ("reference", 1), ("zeros", 1)]


def _summary(trials: list[dict]) -> tuple[dict, str]:
    summary = power.summarize([resolve("reference"), resolve("zeros")], trials, 2, 0, "quick")
    for entry in summary["candidates"]:
        entry.pop("seconds_per_trial")
    return summary, power.power_markdown(summary)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def remote_cluster(tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes on 127.0.0.1, stopped afterwards."""
    bin_dir = Path(sys.executable).parent
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([str(bin_dir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--dashboard-address", ":0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    procs += [subprocess.Popen([str(bin_dir / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1",
                                "--host", "127.0.0.1", "--no-dashboard"], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        from dask.distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


@pytest.mark.slow
def test_serial_local_and_remote_sweeps_give_the_same_summary(remote_cluster):
    runs = {"serial": sweep.run(TASKS, level="quick", workers=0, progress=False),
            "local": sweep.run(TASKS, level="quick", workers=2, progress=False),
            "remote": sweep.run(TASKS, level="quick", scheduler=remote_cluster, progress=False)}
    assert all(not r.failed and len(r.trials) == 4 for r in runs.values())
    serial = _summary(runs["serial"].trials)
    assert serial[0]["false_rejects"] == 0 and serial[0]["missed_bad"] == 0
    assert _summary(runs["local"].trials) == serial and _summary(runs["remote"].trials) == serial


@pytest.mark.slow
def test_a_sweep_killed_midway_resumes_to_the_same_result(tmp_path):
    trials = tmp_path / "trials.jsonl"
    argv = [sys.executable, "-m", "tpu_kernel_records_tools", "power", "--seeds", "2", "--candidate", "reference",
            "--candidate", "zeros", "--quick", "--workers", "1", "--trials", str(trials), "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not trials.exists() or len(_lines(trials)) < 2):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = [line["trial"] for line in _lines(trials)[1:] if "trial" in line]
    assert 1 <= len(kept) < 4
    js = tmp_path / "power.json"
    done = subprocess.run(argv + ["--resume", "--json", str(js)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [line["trial"] for line in _lines(trials)[1:]]
    assert len(records) == 4 and all(r in records for r in kept)
    assert _summary(records) == _summary(sweep.run(TASKS, level="quick", workers=0, progress=False).trials)
