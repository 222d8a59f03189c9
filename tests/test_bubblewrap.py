"""The bubblewrap sandbox (sandbox.isolation) holds: hostile candidates of every class (reading the
grader's environment or memory, signalling it and its other children, the network, writing outside
the worker's /tmp, a fork bomb, filling /tmp) are contained, each with a failing scorecard that says
what happened, and the reference graded after them in the same run scores as it does alone. Skipped,
with the reason, where bubblewrap cannot start a sandbox."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tpu_kernel_records_tools.sandbox import isolation, tripwire
from tpu_kernel_records_tools.grading.candidates import is_builtin, resolve
from tpu_kernel_records_tools.grading.rubric import grade

HOSTILE = Path(__file__).parent / "hostile"
MARKER = "hf_fakefakefake"
ROOT = Path(__file__).parent.parent
WHY = isolation.unavailable_reason()
needs_bwrap = pytest.mark.skipif(WHY is not None, reason=f"no bubblewrap sandbox here: {WHY}")

ESCAPES = ("reads_ancestors", "signals_everyone", "writes_everywhere", "fork_bomb", "fills_tmp", "raises_limits")


class Listener:
    """A TCP listener on 127.0.0.1 and an abstract unix socket that record every byte they receive."""

    def __init__(self):
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.name = f"rubric-test-{os.getpid()}"
        self.unix.bind("\0" + self.name)
        self.unix.listen()
        self.received, self.stop = [], False
        for s in (self.tcp, self.unix):
            s.settimeout(0.2)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s):
        while not self.stop:
            try:
                conn, _ = s.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.received.append(conn.recv(1 << 16))
                except OSError:
                    self.received.append(b"<connected>")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One ``tpu-kernel-rubric`` run (default isolation) of every escape, the network candidate, then
    ``reference``, with a fake HF_TOKEN in its environment, a listener open and a bystander child."""
    if WHY is not None:
        pytest.skip(f"no bubblewrap sandbox here: {WHY}")
    folder = tmp_path_factory.mktemp("bwrap")
    listener = Listener()
    network = folder / "network.py"
    network.write_text((HOSTILE / "network_template.py").read_text()
                       .replace("PORT = 0", f"PORT = {listener.tcp.getsockname()[1]}")
                       .replace('ABSTRACT = ""', f"ABSTRACT = {listener.name!r}"))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pyc_before = tripwire.snapshot([ROOT / "tpu_kernel_records_tools", Path(json.__file__).parent])
    out = folder / "cards.json"
    specs = [f"{HOSTILE / 'escapes.py'}:{name}" for name in ESCAPES] + [f"{network}:attention", "reference"]
    argv = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet", "--timeout", "300",
            "--memory-limit", "4", "--json", str(out)] + [a for s in specs for a in ("--candidate", s)]
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, HF_TOKEN=MARKER), cwd=ROOT,
                              timeout=1200)
        elapsed = time.monotonic() - start
        time.sleep(1)
        listener.stop = True
        bystander_alive = bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    cards = dict(zip([*ESCAPES, "network", "reference"], json.loads(out.read_text())["scorecards"]))
    return {"cards": cards, "proc": proc, "listener": listener, "bystander_alive": bystander_alive,
            "pyc_before": pyc_before, "elapsed": elapsed, "out": out}


def _first(run, name) -> str:
    return run["cards"][name]["checks"][0]["detail"]


@needs_bwrap
@pytest.mark.slow
def test_every_escape_fails_and_the_reference_after_them_passes_as_alone(run):
    cards = run["cards"]
    for name in (*ESCAPES, "network"):
        assert not cards[name]["passed"] and cards[name]["isolation"] == "bubblewrap", name
    alone = grade("reference", level="quick", time_limit_s=300).to_dict()
    assert cards["reference"] == alone and alone["passed"]
    assert "(isolation: bubblewrap; features: none)" in run["proc"].stdout


@needs_bwrap
@pytest.mark.slow
def test_no_secret_reaches_a_candidate_and_the_grader_is_out_of_sight(run):
    detail = _first(run, "reads_ancestors")
    assert "secrets seen in nothing" in detail and "pids visible [1, 2" in detail, detail
    assert MARKER not in run["out"].read_text()
    limits = _first(run, "raises_limits")
    assert "secret names none; HOME /tmp;" in limits, limits


@needs_bwrap
@pytest.mark.slow
def test_signals_reach_nothing_outside(run):
    assert run["bystander_alive"]
    detail = _first(run, "signals_everyone")
    # the candidate killed its own sandbox: bwrap (PID 1 inside) reports that as exit status 137
    assert any(words in detail for words in ("killed by SIGKILL", "signalled", "status 137")), detail


@needs_bwrap
@pytest.mark.slow
def test_nothing_reaches_the_network(run):
    assert run["listener"].received == []
    detail = _first(run, "network")
    assert "tcp refused" in detail and "unix refused" in detail, detail


@needs_bwrap
@pytest.mark.slow
def test_nothing_is_written_outside_the_workers_tmp(run):
    detail = _first(run, "writes_everywhere")
    written = re.search(r"written \[(.*?)\]", detail).group(1)
    assert all(p.strip(" '").startswith(("/tmp/", "/dev/shm/")) for p in written.split(",") if p), detail
    for path in ("/tmp/escaped-by-candidate", "/var/tmp/escaped-by-candidate", "/dev/shm/escaped-by-candidate",
                 "/escaped-by-candidate", os.path.expanduser("~/escaped-by-candidate")):
        assert not os.path.exists(path), path
    after = tripwire.snapshot([ROOT / "tpu_kernel_records_tools", Path(json.__file__).parent])
    assert tripwire.changes(run["pyc_before"], after) == []
    pycache = ROOT / "tpu_kernel_records_tools" / "sandbox" / "__pycache__"
    assert not list(pycache.glob("*escaped*")) and not (ROOT / "tpu_kernel_records_tools" / "sandbox" / "escaped.txt").exists()


@needs_bwrap
@pytest.mark.slow
def test_a_fork_bomb_and_a_full_tmp_fail_the_candidate_only(run):
    bomb = _first(run, "fork_bomb")
    assert "fork refused after" in bomb, bomb
    made = int(re.search(r"after (\d+)", bomb).group(1))
    assert made < isolation.process_limit(), bomb
    fill = _first(run, "fills_tmp")
    tmp_mib, shm_mib = (int(x) for x in re.findall(r"'(\d+) MiB then OSError'", fill))
    assert tmp_mib <= isolation.TMP_LIMIT_BYTES >> 20 and shm_mib <= isolation.SHM_LIMIT_BYTES >> 20, fill
    assert [c for c in psutil.Process().children(recursive=True) if _running(c)] == []


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie is already dead, waiting to be reaped)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@needs_bwrap
@pytest.mark.slow
def test_the_worker_limits_hold_and_cannot_be_raised(run):
    detail = _first(run, "raises_limits")
    raised = re.search(r"raised (\[.*?\]|none)", detail).group(1)
    assert raised in ("none", "['RLIMIT_AS']" if "'RLIMIT_AS': (-1, -1)" in detail else "none"), detail
    assert f"uid {isolation.SANDBOX_UID}" in detail, detail
    limits = dict(re.findall(r"'(RLIMIT_\w+)': \((-?\d+), (-?\d+)\)", detail) and
                  [(n, (int(a), int(b))) for n, a, b in re.findall(r"'(RLIMIT_\w+)': \((-?\d+), (-?\d+)\)", detail)])
    # The address space is limited where no memory cgroup holds the worker (sandbox.memcg), else the cgroup is
    if run["cards"]["raises_limits"]["memory_limit"] == "address-space":
        assert limits["RLIMIT_AS"] == (4 << 30, 4 << 30)
    else:
        assert run["cards"]["raises_limits"]["memory_limit"] == "cgroup" and limits["RLIMIT_AS"] == (-1, -1)
    assert limits["RLIMIT_NPROC"] == (isolation.process_limit(),) * 2
    assert limits["RLIMIT_CORE"] == (0, 0)
    assert limits["RLIMIT_FSIZE"] == (isolation.TMP_LIMIT_BYTES,) * 2


# --------------------------------------------------------------------------------------------------
# Fast: policy and the refusal, without grading.

def test_auto_sends_strangers_to_bubblewrap_and_builtins_to_a_process(monkeypatch):
    monkeypatch.setattr(isolation, "unavailable_reason", lambda: "bwrap missing: install bubblewrap")
    assert isolation.choose("auto", is_builtin(resolve("reference"))) == "process"
    assert isolation.choose("process", is_builtin(resolve(f"{HOSTILE / 'hangs.py'}:sleeps"))) == "process"
    with pytest.raises(isolation.IsolationUnavailable, match="install bubblewrap"):
        isolation.choose("auto", is_builtin(resolve(f"{HOSTILE / 'hangs.py'}:sleeps")))
    with pytest.raises(isolation.IsolationUnavailable):
        isolation.choose("bubblewrap", is_builtin(resolve("reference")))


def test_the_cli_refuses_a_file_candidate_without_bubblewrap_in_one_line(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap on PATH
    argv = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet",
            "--candidate", f"{HOSTILE / 'hangs.py'}:sleeps"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "apt-get install bubblewrap" in proc.stderr


def test_bubblewrap_itself_gets_only_the_allow_listed_environment(tmp_path, monkeypatch):
    """bwrap is PID 1 of the sandbox, its environ readable there: it is started with the worker's."""
    monkeypatch.setattr(isolation, "bwrap_path", lambda: "/usr/bin/bwrap")
    (tmp_path / "stage").mkdir()
    launch = isolation.build(["true"], {"PATH": "/usr/bin", "LANG": "C"}, stage_dir=str(tmp_path / "stage"))
    assert launch.env == {"PATH": "/usr/bin", "LANG": "C"}
    argv = json.loads(launch.argv[-1])["argv"] if os.geteuid() == 0 else launch.argv  # root: via the stager
    text = " ".join(argv)
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--disable-userns", "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in text, flag
    assert f"--size {isolation.TMP_LIMIT_BYTES} --tmpfs /tmp" in text and "--setenv HOME /tmp" in text


def test_sources_under_tmp_are_bound_on_top_of_the_private_tmp(tmp_path, monkeypatch):
    """bwrap mounts in order: a virtualenv or clone under /tmp (as in CI) must be bound after the tmpfs,
    or the worker's interpreter and packages vanish under it."""
    monkeypatch.setattr(isolation, "bwrap_path", lambda: "/usr/bin/bwrap")
    venv = tmp_path / "venv-site"
    venv.mkdir()
    sources = isolation.interpreter_sources()
    monkeypatch.setattr(isolation, "interpreter_sources", lambda: [*sources, str(venv)])
    (tmp_path / "stage").mkdir()
    launch = isolation.build(["true"], {"PATH": "/usr/bin"}, stage_dir=str(tmp_path / "stage"))
    argv = json.loads(launch.argv[-1])["argv"] if os.geteuid() == 0 else launch.argv
    tmpfs = argv.index("/tmp", argv.index("--tmpfs"))
    target = max(i for i, a in enumerate(argv) if a == os.path.realpath(venv) and argv[i - 2] == "--ro-bind")
    assert str(venv).startswith("/tmp/") and tmpfs < target
