"""The grading sandbox holds: hostile candidates (tests/hostile/) each get a failing scorecard that
names what they did, and a correct candidate graded in the same run after them gets exactly the
scorecard it gets alone. This file tests process isolation (the opt-out, and what built-ins
get by default); tests/test_bubblewrap.py the bubblewrap sandbox. Graded at the quick level to keep the cost down (each worker starts JAX)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tpu_kernel_records_tools.sandbox import sandbox
from tpu_kernel_records_tools.grading.rubric import grade, grade_all

HOSTILE = Path(__file__).parent / "hostile"
MARKER = "hf_fakefakefake"  # a fake Hub token put in the grader's environment


def _spec(name: str) -> str:
    return f"{HOSTILE / name}"


def _card(card) -> dict:
    """A scorecard as JSON, minus the candidate's own name and kind (nothing in it is timing)."""
    doc = card.to_dict()
    json.dumps(doc, allow_nan=False)  # never invalid JSON
    return {k: v for k, v in doc.items() if k not in ("candidate", "kind")}


def _details(card) -> str:
    return " | ".join(c.detail for c in card.checks)


def _no_workers_left():
    """No process the grader started (a worker or anything a candidate spawned) is alive."""
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]


# --------------------------------------------------------------------------------------------------
# The worker's environment.

def test_worker_environment_is_an_allow_list(tmp_path):
    environ = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--x",
               "OPENBLAS_NUM_THREADS": "1", "TPU_ACCELERATOR_TYPE": "v5e-8", "HOME": "/root", "TMPDIR": "/tmp",
               "HF_TOKEN": MARKER, "HF_HOME": "/root/.cache/hf", "KAGGLE_KEY": "k", "KAGGLE_USERNAME": "u",
               "AWS_ACCESS_KEY_ID": "a", "GOOGLE_APPLICATION_CREDENTIALS": "/g.json", "MY_API_KEY": "m",
               "TPU_TOKEN": "t", "DB_PASSWORD": "p", "SOME_SECRET": "s", "PYTHONPATH": "/evil",
               "LD_PRELOAD": "/evil.so", "JAX_ENABLE_X64": "1", "USER": "root"}
    env = sandbox.worker_environment(str(tmp_path), environ)
    assert {n: env[n] for n in ("PATH", "LANG", "LC_ALL", "JAX_PLATFORMS", "XLA_FLAGS", "OPENBLAS_NUM_THREADS",
                                "TPU_ACCELERATOR_TYPE")} == {n: environ[n] for n in
                                                            ("PATH", "LANG", "LC_ALL", "JAX_PLATFORMS", "XLA_FLAGS",
                                                             "OPENBLAS_NUM_THREADS", "TPU_ACCELERATOR_TYPE")}
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path)
    for name in ("HF_TOKEN", "HF_HOME", "KAGGLE_KEY", "KAGGLE_USERNAME", "AWS_ACCESS_KEY_ID", "MY_API_KEY",
                 "GOOGLE_APPLICATION_CREDENTIALS", "TPU_TOKEN", "DB_PASSWORD", "SOME_SECRET", "PYTHONPATH",
                 "LD_PRELOAD", "JAX_ENABLE_X64", "USER"):
        assert name not in env, name
    assert MARKER not in json.dumps(env)


def test_the_test_sessions_compilation_cache_never_reaches_a_worker(tmp_path):
    """tests/conftest.py shares one JAX compilation cache within a test session; a graded candidate could
    otherwise write programs that the grader then loads."""
    from tests.conftest import SESSION_CACHE

    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the processes tests start: a folder inside the session's
    assert cache.startswith(os.environ[SESSION_CACHE] + os.sep) and os.path.isdir(cache)
    env = sandbox.worker_environment(str(tmp_path))
    assert os.environ[SESSION_CACHE] not in json.dumps(env)
    assert not [n for n in env if "CACHE" in n and n != "XDG_CACHE_HOME"]


def test_scorecard_numbers_are_always_valid_json():
    """Whatever a check computed (NumPy scalars, NaN, Inf), the scorecard is valid JSON without NaN."""
    import numpy as np

    from tpu_kernel_records_tools.grading.rubric import CheckResult, Scorecard

    check = CheckResult("c", np.bool_(False), np.float32(0), 5.0, "d", np.float32(np.nan), np.float64(np.inf),
                        np.float32(1.5))
    doc = json.loads(json.dumps(Scorecard("x", "external", [check]).to_dict(), allow_nan=False))
    assert doc["checks"][0] == {"name": "c", "passed": False, "points": 0.0, "max_points": 5.0, "detail": "d",
                                "error": None, "tolerance": None, "baseline_error": 1.5}
    assert doc["passed"] is False


# --------------------------------------------------------------------------------------------------
# One CLI run: every hostile candidate, then ``zeros`` and ``reference``, each in its own worker; the
# reference's scorecard is compared with the one it gets graded alone (in this process).

HOSTILES = {
    "stack": "stack_walker.py:attention",
    "rebinds-grader": "rebinds_grader.py:attention",
    "jax-config": "jax_config.py:attention",
    "rebinds-numpy": "rebinds_numpy.py:attention",
    "exit-0": "ends_process.py:exit_zero",
    "exit-1": "ends_process.py:exit_one",
    "abort": "ends_process.py:abort",
    "system-exit": "ends_process.py:system_exit",
    "zeroes-inputs": "zeroes_inputs.py:attention",
    "secrets": "reads_secrets.py:attention",
    "numpy-hog": "allocates.py:numpy_hog",
    "rewrites-scorecard": "rewrites_scorecard.py:attention",
}


@pytest.fixture(scope="module")
def reference_alone():
    return grade("reference", level="quick", time_limit_s=600, isolation="process", features=())


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``tpu-kernel-rubric`` on every hostile candidate, then ``zeros`` and ``reference`` (the base contract
    alone: the reference's features are not what this file tests), with a fake
    HF_TOKEN in its environment. Returns (scorecards by short name, the file, the printed sha256, the
    pid the scorecard rewriter's grandchild wrote down, the completed process)."""
    out = tmp_path_factory.mktemp("cli") / "cards.json"
    specs = [_spec(s) for s in HOSTILES.values()] + ["zeros", "reference"]
    argv = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet", "--timeout", "600",
            "--memory-limit", "4", "--isolation", "process", "--features", "none", "--json", str(out)] + [
                a for spec in specs for a in ("--candidate", spec)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, HF_TOKEN=MARKER),
                          cwd=Path(__file__).parent.parent, timeout=1200)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = re.search(r"sha256 ([0-9a-f]{64})", proc.stdout).group(1)
    attacker = int(Path(f"{out}.attacker-pid").read_text())
    doc = json.loads(out.read_text())
    cards = dict(zip([*HOSTILES, "zeros", "reference"], doc["scorecards"]))
    return cards, out, printed, attacker, proc


def _strip(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("candidate", "kind")}


def test_every_hostile_candidate_fails(cli_run):
    cards = cli_run[0]
    for name in HOSTILES:
        assert not cards[name]["passed"], name
        assert cards[name]["score"] < cards[name]["max_score"], name
    assert cards["reference"]["passed"]


@pytest.mark.slow  # it waits 10 s
def test_the_scorecard_file_is_unchanged_10_s_after_the_rubric_exits(cli_run):
    _, out, printed, attacker, _ = cli_run
    assert hashlib.sha256(out.read_bytes()).hexdigest() == printed
    time.sleep(10)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == printed, "the scorecard file changed after exit"
    assert not psutil.pid_exists(attacker) or psutil.Process(attacker).status() == psutil.STATUS_ZOMBIE


def test_the_reference_after_hostile_candidates_scores_as_it_does_alone(cli_run, reference_alone):
    assert reference_alone.passed, [(c.name, c.detail) for c in reference_alone.checks if not c.passed]
    assert _strip(cli_run[0]["reference"]) == _card(reference_alone)


def test_rebinding_the_grader_or_jax_config_changes_nothing(cli_run):
    """Both return zeros after their attack: their scorecards are exactly the plain ``zeros`` one."""
    cards = cli_run[0]
    assert _strip(cards["rebinds-grader"]) == _strip(cards["zeros"])
    assert _strip(cards["jax-config"]) == _strip(cards["zeros"])


def _first(cards, name) -> str:
    return cards[name]["checks"][0]["detail"]


def test_the_truth_is_not_in_the_worker(cli_run):
    assert "raised RuntimeError: no truth or baseline" in _first(cli_run[0], "stack")


def test_rebound_numpy_gives_failing_checks_not_a_crash(cli_run):
    checks = {c["name"]: c for c in cli_run[0]["rebinds-numpy"]["checks"]}
    assert not checks["finite"]["passed"] and "nan" in checks["finite"]["detail"].lower()
    assert not checks["forward-accuracy"]["passed"]


@pytest.mark.parametrize("name, words", [("exit-0", "exited with status 0"), ("exit-1", "exited with status 1"),
                                         ("abort", "killed by SIGABRT"), ("system-exit", "raised SystemExit")])
def test_ending_the_process_is_named(cli_run, name, words):
    card = cli_run[0][name]
    assert words in _first(cli_run[0], name)
    assert card["error"] is None and card["score"] == 0
    later = card["checks"][1]["detail"]
    assert (words in later and "not run" in later) if name != "system-exit" else "SystemExit" in later


def test_writing_into_the_inputs_is_caught(cli_run):
    first = _first(cli_run[0], "zeroes-inputs")
    assert "inputs modified" in first and "q, k, v" in first


def test_the_worker_sees_no_secret_and_an_empty_home(cli_run):
    cards, out, _, _, proc = cli_run
    assert MARKER not in out.read_text() and MARKER not in proc.stdout
    detail = _first(cards, "secrets")
    assert "secret names none" in detail and "marker in own environ False" in detail, detail
    assert "HOME==cwd True" in detail and "cwd entries []" in detail and "stdin read ''" in detail, detail
    if os.geteuid() != 0:  # a non-dumpable grader's /proc environ is closed to same-user processes (not to root)
        assert "in grader's environ unreadable" in detail, detail


def test_a_memory_hog_fails_at_the_limit(cli_run):
    detail = _first(cli_run[0], "numpy-hog")
    assert "MemoryError" in detail or "killed by" in detail, detail


# --------------------------------------------------------------------------------------------------
# In this process: a hang is killed at the limit; a candidate that cannot load is a failing scorecard.

def test_a_hang_is_killed_at_the_time_limit():
    start = time.monotonic()
    card = grade(_spec("hangs.py:sleeps"), level="quick", time_limit_s=2, isolation="process")
    assert time.monotonic() - start < 60
    assert not card.passed and card.score == 0
    assert "time limit (2 s)" in card.checks[0].detail and "killed" in card.checks[0].detail
    assert all("time limit" in c.detail or "out of time" in c.detail for c in card.checks)
    _no_workers_left()


def test_an_unloadable_candidate_is_a_failing_scorecard(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import os\nos._exit(3)\n")
    card = grade(f"{bad}:attention", level="quick", time_limit_s=60, isolation="process")
    assert card.error and "exited with status 3" in card.error and not card.passed
    missing = grade(f"{tmp_path / 'absent.py'}:attention", level="quick", isolation="process")
    assert missing.error and "does not exist" in missing.error
    _no_workers_left()


def _raises_here(q, k, v, **kwargs):
    raise RuntimeError("programmatic candidate ran in the worker")


def test_a_programmatic_candidate_runs_in_a_worker_by_reference():
    """A Candidate object whose function is importable is pickled by reference and runs in a worker;
    one that cannot be (a lambda) is a failing scorecard that says how to give it."""
    from tpu_kernel_records_tools.grading.candidates import Candidate

    card = grade(Candidate("prog", "external", "test", lambda: _raises_here), level="quick", time_limit_s=120,
                 isolation="process")
    assert "raised RuntimeError: programmatic candidate ran in the worker" in card.checks[0].detail
    lam = grade(Candidate("lam", "external", "test", lambda: (lambda q, k, v, **kw: q)), level="quick",
                isolation="process")
    assert lam.error and "file.py:function" in lam.error and not lam.passed
    _no_workers_left()
