"""A candidate that rewrites files the grader runs fails, and nothing is graded after it in that run."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import jax
import pytest

import kernel_src
import tpu_kernel_records_tools
from tpu_kernel_records_tools import sandbox
from tpu_kernel_records_tools.grading import rubric
from tpu_kernel_records_tools.sandbox import tripwire


def test_snapshot_sees_a_file_changed_added_and_removed(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    (tmp_path / "__pycache__").mkdir()
    before = tripwire.snapshot([tmp_path])
    assert tripwire.changes(before, tripwire.snapshot([tmp_path])) == []
    (tmp_path / "a.py").write_text("x = 2\n")  # same size: the modification time tells
    os.utime(tmp_path / "a.py", ns=(1, before[str(tmp_path / "a.py")][1] + 1))
    (tmp_path / "b.py").unlink()
    (tmp_path / "c.py").write_text("")
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"\0")  # Python's own cache is not watched
    assert tripwire.changes(before, tripwire.snapshot([tmp_path])) == [
        f"added {tmp_path / 'c.py'}", f"changed {tmp_path / 'a.py'}", f"removed {tmp_path / 'b.py'}"]


def test_the_watched_roots_are_the_graders_packages_and_the_libraries_its_workers_import():
    roots = tripwire.watched_roots()
    assert Path(tpu_kernel_records_tools.__file__).resolve().parent in roots
    assert Path(kernel_src.__file__).resolve().parent in roots
    assert Path(jax.__file__).resolve().parent in roots
    files = tripwire.snapshot()
    assert str(Path(sandbox.__file__).resolve().parent / "worker.py") in files


@pytest.fixture
def watched(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "module.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(tripwire, "watched_roots", lambda: [pkg])
    return pkg


def test_a_candidate_that_rewrites_a_watched_file_fails_and_stops_the_run(tmp_path, watched):
    target = watched / "module.py"
    hostile = tmp_path / "edits_grader.py"
    hostile.write_text(textwrap.dedent(f"""
        from kernel_src.reference import reference_attention

        def attention(q, k, v, **kw):
            with open({str(target)!r}, "a") as f:
                f.write("VALUE = 2  # written by a candidate\\n")
            return reference_attention(q, k, v, **kw)
    """))
    cards = rubric.grade_all([f"{hostile}:attention", "reference"], level="quick", progress=False,
                             time_limit_s=300, isolation="process", features=())  # bubblewrap would keep it from writing
    bad, after = cards
    assert not bad.passed and bad.tampered
    assert f"changed {target}" in bad.error and "changed files the grader" in bad.error
    assert not after.passed and after.error.startswith("not graded: an earlier candidate")
    assert all(not c.passed for c in after.checks)


@pytest.mark.slow
def test_a_candidate_that_leaves_the_files_alone_is_graded_as_usual(watched):
    (card,) = rubric.grade_all(["reference"], level="quick", progress=False, time_limit_s=300)
    assert card.passed and not card.tampered and card.error is None
