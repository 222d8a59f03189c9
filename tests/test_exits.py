"""Every command ends with its documented exit status (cli.exits): no SIGABRT from threads still inside
XLA as Python finalizes, no worker left behind, 130 after Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parent.parent
CRASH = ("terminate called", "SIGABRT", "Fatal Python error", "core dumped", "Traceback")


def _ends(body: str) -> subprocess.CompletedProcess:
    code = f"from tpu_kernel_records_tools.cli.exits import exit_with\n{body}\nexit_with(main, None, 'prog')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("body, status, said", [
    ("def main(argv): return 3", 3, ""),
    ("def main(argv): raise KeyboardInterrupt", 130, "prog: interrupted"),
    ("def main(argv): raise SystemExit('one line')", 1, "one line"),
    ("def main(argv): raise SystemExit(None)", 0, ""),
    ("def main(argv): raise ValueError('unexpected')", 1, "ValueError: unexpected"),
])
def test_the_status_is_the_one_main_gave(body, status, said):
    done = _ends(body)
    assert done.returncode == status and said in done.stderr and done.stdout == "", done.stderr


def test_workers_still_open_are_killed_before_the_process_ends():
    done = _ends("def main(argv):\n"
                 "    from tpu_kernel_records_tools.sandbox.sandbox import Sandbox\n"
                 "    box = Sandbox(isolation='process', memory_limit_gb=0)\n"
                 "    box.start()\n"
                 "    print(box.proc.pid, flush=True)\n"
                 "    return 0")
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _rubric_commands() -> list[list[str]]:
    script = Path(sys.executable).with_name("tpu-kernel-rubric")
    module = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric"]
    return [module, [str(script)] if script.exists() else module]


@pytest.mark.slow
def test_twenty_grades_of_a_candidate_that_fails_at_once_all_exit_1(tmp_path):
    candidate = tmp_path / "fails.py"
    candidate.write_text("def attention(q, k, v, **kwargs):\n    raise ValueError('fails at once')\n")

    def grade(i):
        argv = _rubric_commands()[i % 2] + ["--quick", "--quiet", "--isolation", "process",
                                            "--candidate", f"{candidate}:attention"]
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(grade, range(20)))
    assert [d.returncode for d in done] == [1] * 20, [d.stderr[-500:] for d in done if d.returncode != 1][:1]
    for d in done:
        assert not any(word in d.stderr for word in CRASH), d.stderr[-2000:]
        assert "raised ValueError: fails at once" in d.stdout


@pytest.mark.slow
def test_ctrl_c_during_a_grade_exits_130_and_leaves_no_worker(tmp_path):
    hang = tmp_path / "hangs.py"
    hang.write_text("import time\ndef attention(q, k, v, **kwargs):\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet",
                             "--isolation", "process", "--candidate", f"{hang}:attention"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    grader = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("sandbox.worker" in " ".join(c.cmdline())
                                                   for c in grader.children(recursive=True)):
        time.sleep(0.2)
    time.sleep(5)  # the worker has loaded the candidate and sleeps in its first call
    workers = grader.children(recursive=True)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "tpu-kernel-rubric: interrupted" in err, err[-2000:]
    assert not any(word in err for word in CRASH), err[-2000:]
    time.sleep(0.5)
    assert [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.slow
def test_a_program_that_grades_in_process_and_returns_exits_cleanly(tmp_path):
    """Without cli.exits (a notebook, a script, pytest itself): the grader's background threads stop
    before the interpreter finalizes, so returning from a grade never aborts the process."""
    candidate = tmp_path / "fails.py"
    candidate.write_text("def attention(q, k, v, **kwargs):\n    raise ValueError('fails at once')\n")
    code = ("from tpu_kernel_records_tools.grading.rubric import grade\n"
            f"card = grade({str(candidate) + ':attention'!r}, level='quick', isolation='process')\n"
            "print('graded', card.passed)\n")

    def run(_):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(run, range(6)))
    assert [d.returncode for d in done] == [0] * 6, [d.stderr[-800:] for d in done if d.returncode][:1]
    assert all("graded False" in d.stdout and not any(w in d.stderr for w in CRASH) for d in done)
