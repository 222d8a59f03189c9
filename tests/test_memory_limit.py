"""--memory-limit holds memory that an address-space limit misses: each worker's memory cgroup
(sandbox.memcg). Cheap tests of the cgroup and of the fallback, then (slow) hostile candidates that hold
memory in memfds and tmpfs files past the limit: each is killed by its own cgroup, the grader, the
reference graded after them, a second grading process and a bystander all finish."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpu_kernel_records_tools.sandbox import isolation, memcg, sandbox

ROOT = Path(__file__).parent.parent
HOSTILE = Path(__file__).parent / "hostile"
NO_CGROUP = memcg.unavailable_reason()
needs_cgroup = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no memory cgroup here: {NO_CGROUP}")


@needs_cgroup
def test_a_cgroup_is_limited_to_exactly_the_limit_and_removed():
    cg = memcg.create((3 << 30) + 4096)
    try:
        name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
        assert int(Path(cg.path, name).read_text()) == (3 << 30) + 4096
        assert os.path.basename(cg.path).startswith(memcg.PREFIX) and cg.oom_kills() == 0
        assert cg.command(["/bin/true"])[-1] == "/bin/true"
        assert subprocess.run(cg.command(["/bin/true"])).returncode == 0
    finally:
        assert cg.remove()
    assert not os.path.exists(cg.path)


@needs_cgroup
def test_a_process_over_its_cgroups_limit_is_killed_and_counted():
    cg = memcg.create(64 << 20)
    try:
        hog = "import os\nfds = [os.memfd_create('x') for _ in range(8)]\n" \
              "[os.write(fd, b'1' * (32 << 20)) for fd in fds]\nprint('survived')"
        done = subprocess.run(cg.command([os.path.realpath(sys.executable), "-I", "-S", "-c", hog]),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == -9 and "survived" not in done.stdout and cg.oom_kills() >= 1
    finally:
        cg.remove()


def test_without_a_cgroup_hierarchy_the_reason_and_the_warning_are_one_line(monkeypatch):
    monkeypatch.setattr(memcg, "parents", lambda: [])
    with pytest.raises(memcg.CgroupUnavailable, match="no cgroup v2 or cgroup v1 memory hierarchy"):
        memcg.create(1 << 30)
    monkeypatch.setattr(memcg, "unavailable_reason", lambda: "no cgroup here")
    line = memcg.warning("tpu-kernel-rubric")
    assert "\n" not in line and "address space only" in line and "no cgroup here" in line
    monkeypatch.setattr(memcg, "unavailable_reason", lambda: None)
    assert memcg.warning("tpu-kernel-rubric") is None


def test_a_cgroup_path_is_found_under_its_mount():
    assert memcg._under("/", "/sys/fs/cgroup", "/a/b") == "/sys/fs/cgroup/a/b"
    assert memcg._under("/a", "/mnt/cg", "/a/b") == "/mnt/cg/b"
    assert memcg._under("/a", "/mnt/cg", "/ab") is None


def test_the_worker_is_limited_by_its_address_space_where_no_cgroup_can_be_made(monkeypatch):
    def unavailable(limit):
        raise memcg.CgroupUnavailable("none here")
    monkeypatch.setattr(memcg, "create", unavailable)
    box = sandbox.Sandbox(memory_limit_gb=3, isolation="process")
    box.start()
    try:
        assert box.memory_limit == "address-space" and box.cgroup is None
        assert box.proc.args[-1] == str(3 << 30) and memcg.JOIN not in box.proc.args
    finally:
        box.close()


@needs_cgroup
def test_the_worker_runs_inside_its_cgroup_with_no_address_space_limit():
    box = sandbox.Sandbox(memory_limit_gb=3, isolation="process")
    box.start()
    try:
        box.wait_ready()
        assert box.memory_limit == "cgroup" and box.proc.args[-1] == "0" and memcg.JOIN in box.proc.args
        assert str(box.proc.pid) in Path(box.cgroup.procs).read_text().split()
        assert int(Path(box.cgroup.path, "memory.max" if box.cgroup.version == 2 else
                        "memory.limit_in_bytes").read_text()) == 3 << 30
        path = box.cgroup.path
    finally:
        box.close()
    assert not os.path.exists(path)


@needs_cgroup
@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="no bubblewrap sandbox here")
@pytest.mark.slow
def test_memory_held_outside_mappings_kills_the_candidate_alone(tmp_path):
    """Two hogs and the reference graded by one grader under --memory-limit 0.5, while a second grading
    process grades the reference and a bystander sleeps: the hogs are killed by their cgroups, all
    else finishes, the first grader exits 1 and the second 0."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    out, other_out = tmp_path / "hogs.json", tmp_path / "other.json"
    base = [sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet", "--timeout", "300"]
    try:
        other = subprocess.Popen(base + ["--candidate", "reference", "--json", str(other_out)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        hogs = subprocess.run(base + ["--memory-limit", "0.5", "--json", str(out),
                                      "--candidate", f"{HOSTILE / 'memory_outside.py'}:memfd_hog",
                                      "--candidate", f"{HOSTILE / 'memory_outside.py'}:tmpfs_hog",
                                      "--candidate", "reference"], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
        other_log = other.communicate(timeout=600)[0]
        time.sleep(0.5)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert hogs.returncode == 1 and "Traceback" not in hogs.stderr, hogs.stderr[-2000:]
    assert other.returncode == 0, other_log[-2000:]
    memfd, tmpfs, reference = json.loads(out.read_text())["scorecards"]
    for card in (memfd, tmpfs):
        detail = card["checks"][0]["detail"]
        assert card["memory_limit"] == "cgroup" and not card["passed"], detail
        assert "memory cgroup's OOM killer" in detail and "0.5 GiB" in detail and "survived" not in detail, detail
    assert reference["passed"] and reference["memory_limit"] == "cgroup"
    assert json.loads(other_out.read_text())["scorecards"][0]["passed"]


def test_cgroup_v2_takes_the_cgroup_around_this_one_when_its_own_cannot_hold_memory_children(tmp_path, monkeypatch):
    """A v2 cgroup with processes cannot enable the memory controller for its children (only the slice
    around it can): the worker's cgroup is made beside this process's, limited, swap 0, killed as a group."""
    point = tmp_path / "cgroup2"
    (point / "app" / "me").mkdir(parents=True)
    (point / "app" / "me" / "cgroup.procs").write_text("")
    monkeypatch.setattr(memcg, "_mounts", lambda: [("/", str(point), "cgroup2", "rw")])
    monkeypatch.setattr(memcg, "own_cgroups", lambda: {"": "/app/me"})
    assert memcg.parents() == [(2, str(point / "app" / "me")), (2, str(point / "app"))]
    real_mkdir = os.mkdir

    def mkdir(path, *args):  # the kernel fills a new cgroup with its files; only "app" enables memory
        real_mkdir(path, *args)
        names = ["cgroup.procs"] + (["memory.max", "memory.swap.max", "memory.oom.group"]
                                    if os.path.dirname(path) == str(point / "app") else [])
        for name in names:
            Path(path, name).write_text("max\n")
    monkeypatch.setattr(memcg.os, "mkdir", mkdir)
    real_rmdir = os.rmdir

    def rmdir(path):  # a cgroup's folder goes with the kernel's files in it
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        real_rmdir(path)
    monkeypatch.setattr(memcg.os, "rmdir", rmdir)
    real_access = os.access
    monkeypatch.setattr(memcg.os, "access", lambda path, mode: False)  # a cgroup this user may not join
    with pytest.raises(memcg.CgroupUnavailable, match="cgroup.procs is not writable"):
        memcg.create(5 << 30)
    monkeypatch.setattr(memcg.os, "access", real_access)
    cg = memcg.create(5 << 30)
    assert cg.version == 2 and os.path.dirname(cg.path) == str(point / "app")
    assert [Path(cg.path, n).read_text() for n in ("memory.max", "memory.swap.max", "memory.oom.group")] == \
        [str(5 << 30), "0", "1"]
    assert not [p for p in (point / "app" / "me").iterdir() if p.is_dir()]  # the refused child was removed
    Path(cg.path, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cg.oom_kills() == 1


def test_the_rubric_warns_in_one_line_when_a_strangers_memory_has_no_cgroup(monkeypatch, capsys):
    from tpu_kernel_records_tools.cli.rubric import isolation_allowed
    from tpu_kernel_records_tools.grading.candidates import resolve

    monkeypatch.setattr(memcg, "unavailable_reason", lambda: "no hierarchy here")
    stranger = resolve(f"{HOSTILE / 'memory_outside.py'}:memfd_hog")
    assert isolation_allowed("process", [stranger], 4)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "no memory cgroup" in lines[1] and "no hierarchy here" in lines[1]
    assert isolation_allowed("process", [resolve("reference")], 4)  # a built-in: no warning
    assert isolation_allowed("process", [stranger], 0)              # no limit asked: nothing to warn of
    assert "no memory cgroup" not in capsys.readouterr().err


def test_the_records_name_exactly_the_kinds_of_memory_limit():
    from tpu_kernel_records_tools.records import rawio

    scorecard = rawio.load_schema("correctness")["$defs"]["scorecard"]["properties"]["memory_limit"]
    assert scorecard["enum"] == list(memcg.KINDS)
