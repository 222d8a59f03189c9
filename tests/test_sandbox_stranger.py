"""A determined stranger against the sandbox: links out of what the user named, archive bombs, protocol
bombs, the kernel keyring, system calls no kernel needs and socket memory. Each is refused or contained
with one clear line, nothing secret in any output, and the candidates after it still graded.

The refusals before a worker starts (links, archive bombs), the parser's fuzzing, the filter and the
supervisor are cheap and in the default run; the grades that start workers (protocol bombs, keyrings,
socket memory) are slow."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tpu_kernel_records_tools.sandbox import candidate_files, isolation, memcg, sandbox, syscalls
from tpu_kernel_records_tools.grading.candidates import CandidateSpecError, resolve
from tpu_kernel_records_tools.sandbox.worker import ProtocolError

ROOT = Path(__file__).parent.parent
HOSTILE = Path(__file__).parent / "hostile"
TOKEN = "hf_strangerfaketoken"
RUBRIC = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric"]
BWRAP = isolation.unavailable_reason()
SECCOMP = None
try:
    syscalls.build_filter()
except syscalls.Unavailable as e:
    SECCOMP = str(e)
needs_seccomp = pytest.mark.skipif(SECCOMP is not None, reason=f"no seccomp here: {SECCOMP}")
x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="raw system-call numbers of x86-64")


def _secret_home(tmp_path: Path) -> Path:
    """A home folder with a Hub token and a ``.env``, as a user's."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(TOKEN)
    (home / ".env").write_text(f"HF_TOKEN={TOKEN}\n")
    return home


def _rubric(*args, timeout=600, **env) -> subprocess.CompletedProcess:
    return subprocess.run([*RUBRIC, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **env})


# --------------------------------------------------------------------------------------------------
# Links: refused in one line before anything is opened.

@pytest.mark.parametrize("target", [".cache/huggingface/token", ".env"])
def test_a_candidate_file_that_is_a_symbolic_link_is_refused_unread(tmp_path, target):
    home = _secret_home(tmp_path)
    link = tmp_path / "kernel.py"
    link.symlink_to(home / target)
    with pytest.raises(CandidateSpecError, match="is a symbolic link") as caught:
        resolve(f"{link}:attention")
    assert TOKEN not in str(caught.value)
    done = _rubric("--quick", "--candidate", f"{link}:attention", "--json", str(tmp_path / "out.json"))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "symbolic link" in lines[0], done.stdout + done.stderr
    assert TOKEN not in done.stdout + done.stderr and not (tmp_path / "out.json").exists()


def test_measure_refuses_a_linked_candidate_in_one_line(tmp_path):
    home = _secret_home(tmp_path)
    link = tmp_path / "kernel.py"
    link.symlink_to(home / ".env")
    done = subprocess.run([sys.executable, "-m", "tpu_kernel_records_tools.cli.main", "measure", "--profile", "tiny",
                           "--candidate", f"{link}:attention", "--name", "linked", "--out", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "symbolic link" in text and TOKEN not in text, text
    assert len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("manifest.json"))


def test_a_hard_linked_file_and_a_swapped_in_link_are_refused(tmp_path):
    home = _secret_home(tmp_path)
    hard = tmp_path / "hard.py"
    os.link(home / ".env", hard)
    with pytest.raises(CandidateSpecError, match="hard link"):
        resolve(f"{hard}:attention")
    plain = tmp_path / "plain.py"
    plain.write_text("def attention(q, k, v, **kw):\n    return q\n")
    resolve(f"{plain}:attention")  # accepted as it stands; then a link takes its place before the copy-in
    plain.unlink()
    plain.symlink_to(home / ".env")
    with pytest.raises(candidate_files.LinkRefused, match="symbolic link"):
        candidate_files.open_file(plain)


@pytest.mark.parametrize("attack", ["symlink-out", "symlink-in", "hard-link", "fifo"])
def test_a_candidate_folder_holding_a_link_is_refused(tmp_path, attack):
    home = _secret_home(tmp_path)
    folder = tmp_path / "kernel"
    (folder / "pkg").mkdir(parents=True)
    (folder / "main.py").write_text("def attention(q, k, v, **kw):\n    return q\n")
    if attack == "symlink-out":
        (folder / "pkg" / "notes.txt").symlink_to(home / ".env")
    elif attack == "symlink-in":
        (folder / "pkg" / "again.py").symlink_to(folder / "main.py")
    elif attack == "hard-link":
        os.link(home / ".cache" / "huggingface" / "token", folder / "pkg" / "data.bin")
    else:
        os.mkfifo(folder / "pkg" / "pipe")
    with pytest.raises(CandidateSpecError, match="candidate folder .* holds pkg/") as caught:
        resolve(f"{folder / 'main.py'}:attention", root=folder)
    assert TOKEN not in str(caught.value) and "\n" not in str(caught.value)


def test_an_archive_bomb_folder_is_refused_before_it_is_copied(tmp_path):
    folder = tmp_path / "bomb"
    folder.mkdir()
    (folder / "main.py").write_text("def attention(q, k, v, **kw):\n    return q\n")
    with open(folder / "zeros.bin", "wb") as f:
        f.truncate(768 << 20)  # sparse: nothing on disk, 768 MiB to a copy that writes holes out
    assert os.stat(folder / "zeros.bin").st_blocks * 512 < (1 << 20)
    with pytest.raises(CandidateSpecError, match="more than 256 MiB"):
        resolve(f"{folder / 'main.py'}:attention", root=folder)
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(Exception, match="more than 256 MiB"):
        isolation.build(["/bin/true"], {}, stage_dir=str(stage), candidate_root=str(folder))
    assert not list(stage.iterdir())  # nothing was copied
    bounds = candidate_files.FolderLimits(max_bytes=1 << 30, max_files=10_000)
    candidate_files.check_folder(folder, bounds)  # a raised bound lets it through
    for i in range(3):
        (folder / f"f{i}.py").write_text("")
    with pytest.raises(candidate_files.LinkRefused, match="more than 3 files"):
        candidate_files.check_folder(folder, candidate_files.FolderLimits(max_bytes=1 << 30, max_files=3))


def test_the_folder_bounds_are_flags_of_both_commands(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir()
    (folder / "main.py").write_text("def attention(q, k, v, **kw):\n    return q\n")
    (folder / "big.bin").write_bytes(b"\0" * (2 << 20))
    done = _rubric("--quick", "--candidate-dir", str(folder), "--candidate-max-mib", "1",
                   "--candidate", f"{folder / 'main.py'}:attention")
    assert done.returncode == 2 and "more than 1 MiB" in done.stderr and "--candidate-max-mib" in done.stderr
    for prog in (RUBRIC, [sys.executable, "-m", "tpu_kernel_records_tools.cli.main", "measure"]):
        shown = subprocess.run([*prog, "--help"], capture_output=True, text=True, cwd=ROOT).stdout
        assert "--candidate-max-mib" in shown and "--candidate-max-files" in shown


# --------------------------------------------------------------------------------------------------
# The protocol: nothing a worker writes reaches the grader as anything but a ProtocolError.

def _frame_checked(head: bytes, seq):
    try:
        sandbox.parse_reply(head, seq)
    except ProtocolError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
        return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048), st.sampled_from([None, 1, 7]))
def test_random_bytes_are_a_protocol_error_or_a_valid_reply(head, seq):
    _frame_checked(head, seq)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["ok", "error", "raised", "features", "inputs_modified", "seq", "arrays",
                                        "op", "pid", "syscall_filter", "other"]), _json, max_size=6))
@example({"arrays": [[None, [], {"\r" * 4: None, "k" * 8: None}, {"struct": {"x" * 8: None}, "y" * 8: {"z" * 8: None}}]]})
def test_adversarial_headers_are_a_protocol_error_or_a_valid_reply(header):
    head = json.dumps(header).encode()
    if _frame_checked(head, header.get("seq")):
        assert isinstance(header.get("ok", True), bool) and set(header) <= set(sandbox.REPLY_SCHEMA["properties"])


@pytest.mark.parametrize("head, why", [
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "RecursionError"),
    (b'[' * 200_000 + b']' * 200_000, "RecursionError"),
    (b'{"ok": true, "seq": NaN}', "NaN"),
    (b'{"ok": true, "seq": 1, "arrays": [{"dtype": "float32", "shape": [1.5]}]}', "bad array spec"),
    (b'{"ok": true, "seq": 1, "arrays": [{"dtype": {"a": [[[]]]}, "shape": [1]}]}', "unsupported dtype"),
    (b'{"ok": "yes", "seq": 1}', "ok is malformed"),
    (b'{"ok": true, "seq": 1, "features": 5}', "features is malformed"),
    (b'{"ok": true, "seq": 1, "inputs_modified": [{"x": 1}]}', "inputs_modified/0 is malformed"),
    (b'{"ok": true, "seq": 1, "error": "' + b"x" * 30_000 + b'"}', "error is malformed"),
    (b'{"ok": true, "seq": 2}', "never made"),
    (b'{"ok": true}', "never made"),
    (b'{"ok": true, "seq": 1, "extra": 1}', "additionalProperties"),
    (b'\xff\xfe{}', "not JSON"),
])
def test_each_malformed_frame_is_named(head, why):
    with pytest.raises(ProtocolError, match=why):
        sandbox.parse_reply(head, 1)


def test_a_well_formed_reply_passes():
    header, specs = sandbox.parse_reply(
        b'{"ok": true, "seq": 3, "inputs_modified": [], "arrays": [{"dtype": "bfloat16", "shape": [2, 3]}]}', 3)
    assert header["ok"] is True and [(str(d), s, n) for d, s, n in specs] == [("bfloat16", (2, 3), 12)]


BOMB = """
import os, struct, sys, threading, time
import jax.numpy as jnp
_out = int(sys.argv[3])  # the worker's reply pipe (its command line: -c, path, in, out, ...)
def _frame(head, body=b""):
    os.write(_out, struct.pack("<Q", len(head)) + head + body)
{setup}
def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    {call}
    return jnp.zeros(q.shape, q.dtype)
"""
BOMBS = {
    "nested-at-import": ("_frame(b'{\"a\":' * 100000 + b'1' + b'}' * 100000)", "pass"),
    "nan-at-import": ("_frame(b'{\"ok\": true, \"seq\": NaN}')", "pass"),
    "huge-at-import": ("os.write(_out, struct.pack('<Q', 1 << 60))", "pass"),
    "forged-load": ("_frame(b'{\"ok\": true, \"seq\": 1, \"features\": [\"window\"]}')", "pass"),
    "wrong-types-at-call": ("", "_frame(b'{\"ok\": true, \"seq\": 2, \"inputs_modified\": 7}')"),
    "unasked-after-call": ("", "threading.Timer(0.3, _frame, (b'{\"ok\": true, \"seq\": 9}',)).start(); time.sleep(0.6)"),
    "truncated-then-exit": ("", "os.write(_out, struct.pack('<Q', 100) + b'{\"ok\"'); os._exit(0)"),
}


@pytest.mark.slow
def test_protocol_bombs_fail_their_candidate_and_the_rubric_goes_on(tmp_path):
    specs = []
    for name, (setup, call) in BOMBS.items():
        path = tmp_path / f"{name.replace('-', '_')}.py"
        path.write_text(BOMB.format(setup=setup, call=call))
        specs += ["--candidate", f"{path}:attention"]
    out = tmp_path / "cards.json"
    done = _rubric("--quick", "--quiet", "--features", "none", "--isolation", "process", "--timeout", "300",
                   *specs, "--candidate", "reference", "--json", str(out), timeout=900)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    cards = json.loads(out.read_text())["scorecards"]
    assert [c["candidate"].rsplit("/", 1)[-1] for c in cards[:-1]] == \
        [f"{n.replace('-', '_')}.py:attention" for n in BOMBS]
    for name, card in zip(BOMBS, cards):
        said = (card["error"] or "") + " ".join(c["detail"] for c in card["checks"])
        assert not card["passed"] and card["score"] == 0, name
        assert any(w in said for w in ("malformed", "never made", "no request asked", "reply header of",
                                       "exited with status 0")), (name, said[:500])
    assert cards[-1]["candidate"] == "reference" and cards[-1]["passed"], cards[-1]


# --------------------------------------------------------------------------------------------------
# The kernel: a fresh keyring, a system-call filter, socket memory counted.

_KEYRING = r"""
import ctypes, json, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
def call(*a): return libc.syscall(*[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
assert call(250, 1, ctypes.c_char_p(b"grader-session")) > 0  # KEYCTL_JOIN_SESSION_KEYRING: a session of its own
assert call(248, ctypes.c_char_p(b"user"), ctypes.c_char_p(b"grader-token"), ctypes.c_char_p(sys.argv[1].encode()),
            len(sys.argv[1]), -3) > 0
done = subprocess.run(sys.argv[2:], capture_output=True, text=True)
buf = ctypes.create_string_buffer(4096); n = call(250, 11, -3, buf, 4096)
names = []
for i in range(0, max(n, 0), 4):
    d = ctypes.create_string_buffer(512)
    call(250, 6, int.from_bytes(buf.raw[i:i + 4], "little", signed=True), d, 512)
    names.append(d.value.decode(errors="replace"))
print(json.dumps({"rc": done.returncode, "out": done.stdout + done.stderr, "keys": names}))
"""


def _keyring_available() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    probe = subprocess.run([sys.executable, "-c", "import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                            "l.syscall.restype = ctypes.c_long; "
                            "raise SystemExit(0 if l.syscall(ctypes.c_long(250), ctypes.c_long(1), None) > 0 else 1)"])
    return probe.returncode == 0


@pytest.mark.slow
@needs_seccomp
@x86_64_only
@pytest.mark.skipif(not _keyring_available(), reason="no session keyrings here")
def test_the_grader_keyring_is_out_of_reach_and_unchanged(tmp_path):
    """In the sandbox a stranger's code gets (bubblewrap where it runs here, else a plain worker: the keyring
    and the filter are the worker's own, whichever the isolation)."""
    where = "bubblewrap" if BWRAP is None else "process"
    out = tmp_path / "cards.json"
    argv = [*RUBRIC, "--quick", "--features", "none", "--isolation", where, "--json", str(out),
            "--candidate", f"{HOSTILE / 'reaches_out.py'}:keyring_reader",
            "--candidate", f"{HOSTILE / 'reaches_out.py'}:forbidden_calls"]
    done = subprocess.run([sys.executable, "-c", _KEYRING, TOKEN, *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    seen = json.loads(done.stdout)
    printed = seen["out"] + out.read_text()
    assert seen["rc"] == 1, printed[-3000:]
    assert TOKEN not in printed and bytes(b ^ 0x5A for b in TOKEN.encode()).hex() not in printed
    assert seen["keys"] and all("planted-by-a-candidate" not in k for k in seen["keys"]), seen["keys"]
    assert any("grader-token" in k for k in seen["keys"])  # the grader's own key is still there
    reader, calls = json.loads(out.read_text())["scorecards"]
    assert reader["syscall_filter"] == calls["syscall_filter"] == "seccomp"
    assert "no key reached: keyctl said EPERM" in json.dumps(reader)
    said = next(c["detail"] for c in calls["checks"] if "calls:" in c["detail"])
    for name in ("ptrace", "bpf", "unshare", "perf_event_open", "userfaultfd", "mount"):
        assert f"{name}=EPERM" in said, said


@x86_64_only
def test_the_worker_joins_an_empty_session_keyring():
    if not _keyring_available():
        pytest.skip("no session keyrings here")
    script = ("import ctypes; from tpu_kernel_records_tools.sandbox import syscalls\n"
              "l = ctypes.CDLL(None, use_errno=True); l.syscall.restype = ctypes.c_long\n"
              "c = lambda *a: l.syscall(*[ctypes.c_long(x) if isinstance(x, int) else x for x in a])\n"
              "c(250, 1, ctypes.c_char_p(b's')); c(248, ctypes.c_char_p(b'user'), ctypes.c_char_p(b'k'), "
              "ctypes.c_char_p(b'v'), 1, -3)\n"
              "before = c(250, 11, -3, None, 0); syscalls.join_fresh_keyring(); after = c(250, 11, -3, None, 0)\n"
              "print(before, after)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.split() == ["4", "0"], done.stdout + done.stderr  # one key id (4 bytes), then none


@needs_seccomp
@x86_64_only
def test_the_filter_refuses_what_it_lists_and_allows_a_kernels_work():
    script = ("import errno, os, socket, subprocess, threading\n"
              "from tpu_kernel_records_tools.sandbox import syscalls\n"
              "assert syscalls.confine() == ('seccomp', None)\n"
              "for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):\n"
              "    try: socket.socket(family, socket.SOCK_DGRAM); print('escaped', family)\n"
              "    except OSError as e: assert e.errno == errno.EAFNOSUPPORT, e\n"
              "a, b = socket.socketpair(); a.send(b'x'); assert b.recv(1) == b'x'\n"
              "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
              "assert subprocess.run(['true']).returncode == 0 and os.fork() or os._exit(0)\n"
              "print(subprocess.run(['unshare', '-U', 'true'], capture_output=True).returncode)\n"
              "import ctypes; l = ctypes.CDLL(None, use_errno=True); l.syscall.restype = ctypes.c_long\n"
              "pid = l.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | 17), *[ctypes.c_long(0)] * 4)\n"
              "pid == 0 and os._exit(0)\n"  # clone(CLONE_NEWUSER): a child in a new namespace, were it allowed
              "print(pid, errno.errorcode[ctypes.get_errno()])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "escaped" not in done.stdout, done.stdout + done.stderr
    assert done.stdout.split() == ["thread", "1", "-1", "EPERM"], done.stdout


def test_confine_joins_a_fresh_keyring_before_the_filter(monkeypatch):
    order = []
    monkeypatch.setattr(syscalls, "join_fresh_keyring", lambda: order.append("keyring"))
    monkeypatch.setattr(syscalls, "build_filter", lambda: type("F", (), {"load": lambda self: order.append("filter")})())
    assert syscalls.confine() == ("seccomp", None) and order == ["keyring", "filter"]


def test_without_libseccomp_the_worker_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    kind, why = syscalls.confine()
    assert kind == "none" and "libseccomp cannot be loaded" in why and "\n" not in why


NEEDS_CGROUP = memcg.unavailable_reason()


@pytest.mark.slow
@pytest.mark.skipif(NEEDS_CGROUP is not None, reason=f"no memory cgroup here: {NEEDS_CGROUP}")
def test_socket_buffers_count_against_the_memory_limit(tmp_path):
    """Unix-socket buffers past --memory-limit 1: the worker is killed by its cgroup; TCP is refused by the
    filter (and bounded by the v1 TCP limit where there is none); the reference after them passes."""
    out = tmp_path / "cards.json"
    done = _rubric("--quick", "--features", "none", "--isolation", "process", "--memory-limit", "1.5",
                   "--json", str(out), "--candidate", f"{HOSTILE / 'reaches_out.py'}:unix_hog",
                   "--candidate", f"{HOSTILE / 'reaches_out.py'}:tcp_hog", "--candidate", "reference", timeout=900)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    unix, tcp, reference = json.loads(out.read_text())["scorecards"]
    assert "OOM killer" in json.dumps(unix) and unix["memory_limit"] == "cgroup"
    if SECCOMP is None:
        assert "Address family not supported" in json.dumps(tcp)
    assert not tcp["passed"] and reference["passed"]


def test_a_v1_cgroup_bounds_tcp_buffers(monkeypatch):
    if NEEDS_CGROUP is not None:
        pytest.skip(f"no memory cgroup here: {NEEDS_CGROUP}")
    cg = memcg.create(1 << 30)
    try:
        tcp = Path(cg.path, "memory.kmem.tcp.limit_in_bytes")
        if cg.version == 1 and tcp.exists():
            assert int(tcp.read_text()) == memcg.TCP_LIMIT_BYTES
    finally:
        cg.remove()


# --------------------------------------------------------------------------------------------------
# A submitted program runs bounded: a supervisor watches the measuring process.

_CHILD = """
import os, signal, sys, time
from tpu_kernel_records_tools.measure.supervise import announce
announce("model-fwd/1024", float(sys.argv[1]))
what = sys.argv[2]
os.makedirs(sys.argv[3] + "/.run-x.partial", exist_ok=True)
if what == "hang":
    time.sleep(600)
elif what == "crash":
    os.kill(os.getpid(), signal.SIGSEGV)
announce("", 0)
raise SystemExit(0 if what == "ok" else 3)
"""


@pytest.mark.parametrize("what, expect", [("hang", "ran past its budget of 1.000s"),
                                          ("crash", "was killed by SIGSEGV while timing the submitted program "
                                                    "at case model-fwd/1024"),
                                          ("ok", 0), ("fails", 3)])
def test_the_supervisor_stops_a_hung_or_crashed_measuring(tmp_path, what, expect):
    from tpu_kernel_records_tools.measure import supervise

    import time
    begin = time.monotonic()
    argv = ["1", what, str(tmp_path)]
    if isinstance(expect, int):
        assert supervise.supervised(argv, leftovers=[tmp_path], command=[sys.executable, "-c", _CHILD]) == expect
        assert (tmp_path / ".run-x.partial").exists()  # the child finished: nothing of it is removed
        return
    with pytest.raises(supervise.Refused) as caught:
        supervise.supervised(argv, leftovers=[tmp_path], command=[sys.executable, "-c", _CHILD])
    assert expect in str(caught.value) and "no run was written" in str(caught.value)
    assert not list(tmp_path.iterdir()) and time.monotonic() - begin < 60


def test_a_program_larger_than_the_device_is_refused_before_it_runs():
    import jax
    import jax.numpy as jnp

    from tpu_kernel_records_tools.grading.export import ProgramRefused
    from tpu_kernel_records_tools.measure import submission

    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((512, 512), jnp.float32)).compile()
    needed = submission.program_bytes(compiled)
    assert needed >= 2 * 512 * 512 * 4  # its argument and its output at least
    submission.fits_device(compiled, "case", available=needed)
    with pytest.raises(ProgramRefused, match="needs .* GiB .*more than the device's"):
        submission.fits_device(compiled, "case", available=needed - 1)
    assert submission.device_memory_bytes() > 0


def test_the_records_name_exactly_the_kinds_of_syscall_filter():
    from tpu_kernel_records_tools.records import rawio

    scorecard = rawio.load_schema("correctness")["$defs"]["scorecard"]["properties"]["syscall_filter"]
    assert scorecard["enum"] == list(syscalls.KINDS)
