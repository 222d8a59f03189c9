"""What a stranger's code can read in the bubblewrap sandbox: only what the worker imports.

Cheap tests of the binds ``sandbox.isolation.build`` asks bwrap for (no sandbox started), then one
``python -m`` grader started from a folder that holds a token, with a home folder holding a Hub token
and notes beside the candidate file: the hostile candidate reads nothing of them, and sees nothing of
the checkout but the project's package folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_kernel_records_tools.sandbox import isolation
from tpu_kernel_records_tools.grading.candidates import CandidateSpecError, resolve

ROOT = Path(__file__).parent.parent
HOSTILE = Path(__file__).parent / "hostile"
WHY = isolation.unavailable_reason()


def _argv(tmp_path, monkeypatch, **kwargs) -> list[str]:
    monkeypatch.setattr(isolation, "bwrap_path", lambda: "/usr/bin/bwrap")
    stage = tmp_path / f"stage{len(list(tmp_path.glob('stage*')))}"
    stage.mkdir()
    launch = _argv.launch = isolation.build(["true"], {"PATH": "/usr/bin"}, stage_dir=str(stage), **kwargs)
    for fd in launch.close_after:
        os.close(fd)
    return json.loads(launch.argv[-1])["argv"] if os.geteuid() == 0 else launch.argv  # root: via the stager


def _targets(argv: list[str], flag: str) -> list[str]:
    """The in-sandbox paths of every ``flag SOURCE TARGET`` (``--ro-bind``, ``--ro-bind-data``)."""
    return [argv[i + 2] for i, a in enumerate(argv[:-2]) if a == flag]


def _contains(folder: str, path: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def test_no_bind_holds_the_working_directory_home_checkout_or_the_candidates_neighbours(tmp_path, monkeypatch):
    home, work, downloads = tmp_path / "home", tmp_path / "work", tmp_path / "home" / "Downloads"
    for d in (work, downloads):
        d.mkdir(parents=True)
    kernel = downloads / "kernel.py"
    kernel.write_text("def attention(q, k, v, **kw): return q\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(sys, "path", ["", str(work), str(home), str(ROOT), *sys.path])
    argv = _argv(tmp_path, monkeypatch, candidate_file=str(kernel))
    binds = _targets(argv, "--ro-bind")
    for secret in (work, home, downloads, ROOT.resolve()):
        assert not any(_contains(b, str(secret)) for b in binds), (secret, binds)
    packages = {str((ROOT / name).resolve()) for name in ("tpu_kernel_records_tools", "kernel_src")}
    assert packages <= set(binds)
    assert not any(_contains(str(ROOT.resolve()), b) for b in binds if b not in packages and
                   not _contains(os.path.realpath(sys.prefix), b)), binds
    assert _targets(argv, "--ro-bind-data") == [f"{isolation.CANDIDATE_DIR}/kernel.py"]  # the file alone


@pytest.mark.parametrize("inside", ["working directory", "home"])
def test_a_prefix_holding_the_working_directory_or_home_is_bound_by_its_bin_and_lib_only(tmp_path, monkeypatch,
                                                                                          inside):
    prefix = tmp_path / "prefix"
    for name in ("bin", "lib", "work"):
        (prefix / name).mkdir(parents=True)
    monkeypatch.chdir(prefix / "work" if inside == "working directory" else tmp_path)
    monkeypatch.setenv("HOME", str(prefix / "work") if inside == "home" else str(tmp_path / "elsewhere"))
    monkeypatch.setattr(sys, "prefix", str(prefix))
    sources = isolation.interpreter_sources()
    assert str(prefix) not in sources and {str(prefix / "bin"), str(prefix / "lib")} <= set(sources)
    assert not any(_contains(s, str(prefix / "work")) for s in sources)


def test_a_git_folder_or_file_inside_a_bound_folder_is_hidden(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / ".git").mkdir(parents=True)
    (site / ".git" / "config").write_text("[remote] token = leak-git\n")
    sources = isolation.interpreter_sources()
    monkeypatch.setattr(isolation, "interpreter_sources", lambda: [*sources, str(site)])
    argv = _argv(tmp_path, monkeypatch)
    git = f"{site}/.git"
    assert argv[argv.index(git) - 1] == "--tmpfs" and argv.index(git) > argv.index(str(site))
    (site / ".git" / "config").unlink()
    (site / ".git").rmdir()
    (site / ".git").write_text("gitdir: /elsewhere/.git/worktrees/site\n")  # a worktree's .git file
    argv = _argv(tmp_path, monkeypatch)
    assert argv[argv.index(git) - 2:argv.index(git)] == ["--ro-bind", "/dev/null"]


def test_a_git_folder_in_the_candidates_named_folder_is_hidden(tmp_path, monkeypatch):
    root = tmp_path / "kernel"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("[remote] token = leak-git\n")
    (root / "kernel.py").write_text("def attention(q, k, v, **kw): return q\n")
    argv = _argv(tmp_path, monkeypatch, candidate_file=str(root / "kernel.py"), candidate_root=str(root))
    git = f"{isolation.CANDIDATE_DIR}/.git"
    if os.geteuid() == 0:  # a root grader binds a copy its sandbox uid can read, without the .git
        plan = json.loads(_argv.launch.argv[-1])
        copy = [source for source, seen in plan["stage"] if seen == argv[argv.index(isolation.CANDIDATE_DIR) - 1]]
        assert len(copy) == 1 and Path(copy[0], "kernel.py").exists() and not Path(copy[0], ".git").exists()
    else:
        assert argv[argv.index(git) - 1] == "--tmpfs" and argv.index(git) > argv.index(isolation.CANDIDATE_DIR)


def test_a_named_candidate_folder_is_bound_whole_and_a_file_must_lie_inside_it(tmp_path, monkeypatch):
    root = tmp_path / "kernel"
    root.mkdir()
    (root / "main.py").write_text("from helper import attention\n")
    argv = _argv(tmp_path, monkeypatch, candidate_file=str(root / "main.py"), candidate_root=str(root))
    assert isolation.CANDIDATE_DIR in _targets(argv, "--ro-bind") and _targets(argv, "--ro-bind-data") == []
    assert isolation.inside_path(str(root / "main.py"), str(root)) == f"{isolation.CANDIDATE_DIR}/main.py"
    assert resolve(f"{root / 'main.py'}:attention", root=root).root == str(root.resolve())
    with pytest.raises(CandidateSpecError, match="not inside"):
        resolve(f"{tmp_path / 'other.py'}:attention", root=root)
    with pytest.raises(CandidateSpecError, match="not a folder"):
        resolve(f"{root / 'main.py'}:attention", root=root / "main.py")


def test_a_module_candidate_binds_its_own_package_only(tmp_path, monkeypatch):
    (tmp_path / "mykernels").mkdir()
    (tmp_path / "mykernels" / "__init__.py").write_text("")
    (tmp_path / "single_kernel.py").write_text("def attention(q, k, v, **kw): return q\n")
    (tmp_path / "token").write_text("leak-beside-the-package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = _argv(tmp_path, monkeypatch, candidate_module="mykernels.flash")
    assert str(tmp_path / "mykernels") in _targets(argv, "--ro-bind")
    assert not any(_contains(b, str(tmp_path / "token")) for b in _targets(argv, "--ro-bind"))
    assert isolation.worker_path(None, "mykernels.flash")[0] == str(tmp_path)
    argv = _argv(tmp_path, monkeypatch, candidate_module="single_kernel")
    assert _targets(argv, "--ro-bind-data") == [str(tmp_path / "single_kernel.py")]
    assert isolation.module_sources("json") == []  # the standard library is bound already


@pytest.mark.skipif(WHY is not None, reason=f"no bubblewrap sandbox here: {WHY}")
def test_a_candidate_reads_nothing_near_the_grader(tmp_path):
    """A ``python -m`` grader started from a folder holding a token, its home holding a Hub token, the
    candidate downloaded beside notes: the candidate's report through its error carries none of them."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / "Downloads").mkdir()
    work.mkdir()
    (home / ".cache" / "huggingface" / "token").write_text("leak-home-token\n")
    (home / "Downloads" / "notes.txt").write_text("leak-beside-the-kernel\n")
    (work / "token").write_text("leak-working-directory\n")
    (home / "Downloads" / "kernel.py").write_text((HOSTILE / "reads_neighbours.py").read_text())
    out = tmp_path / "cards.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), HF_TOKEN="leak-environment")
    proc = subprocess.run([sys.executable, "-m", "tpu_kernel_records_tools.cli.rubric", "--quick", "--quiet",
                           "--candidate", "../home/Downloads/kernel.py:attention", "--json", str(out)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    card = json.loads(out.read_text())["scorecards"][0]
    detail = card["checks"][0]["detail"]
    assert card["isolation"] == "bubblewrap" and "raised RuntimeError: read [" in detail, detail
    read = detail.split("read [")[1].split("]")[0].split()
    assert [bytes.fromhex(w) for w in read] == [], detail
    beside = detail.split("checkout has ")[1]
    assert set(eval(beside)) <= {"tpu_kernel_records_tools", "kernel_src", ".venv"}, beside  # noqa: S307
    for secret in ("leak-home-token", "leak-beside-the-kernel", "leak-working-directory", "leak-environment"):
        assert secret not in out.read_text() + proc.stdout + proc.stderr


@pytest.mark.skipif(WHY is not None, reason=f"no bubblewrap sandbox here: {WHY}")
def test_an_exported_program_carries_nothing_read_near_the_grader(tmp_path, monkeypatch):
    """``measure --candidate``'s exporter runs the submitter's Python in the same sandbox: a kernel that
    embeds what it read as a constant of its program gets nothing a release could publish."""
    from tpu_kernel_records_tools.grading.export import Signature
    from tpu_kernel_records_tools.grading.exporter import export_candidate

    (tmp_path / "Downloads").mkdir()
    (tmp_path / "Downloads" / "notes.txt").write_text("leak-beside-the-kernel\n")
    (tmp_path / "token").write_text("leak-working-directory\n")
    kernel = tmp_path / "Downloads" / "kernel.py"
    kernel.write_text((HOSTILE / "reads_neighbours.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    sig = Signature((1, 8, 2, 8), (1, 8, 1, 8), (1, 8, 1, 8), "float32", True, False, None)
    (program,) = export_candidate(f"{kernel}:embeds", [sig], platform="cpu", isolation="bubblewrap",
                                  time_limit_s=300).values()
    xored = lambda text: bytes(b ^ 0x5A for b in text.encode())  # noqa: E731
    assert xored("kernel_src|tpu_kernel_records_tools") in program  # the constant is there, with what it saw
    for secret in ("leak-beside-the-kernel", "leak-working-directory", "README.md", "pyproject.toml", ".git"):
        assert xored(secret) not in program and secret.encode() not in program, secret


@pytest.mark.skipif(WHY is not None, reason=f"no bubblewrap sandbox here: {WHY}")
@pytest.mark.slow
def test_a_kernel_of_several_files_is_graded_from_the_folder_its_user_names(tmp_path):
    from tpu_kernel_records_tools.grading.rubric import grade

    (tmp_path / "helper.py").write_text("from kernel_src.reference import reference_attention as attention\n")
    (tmp_path / "main.py").write_text("from helper import attention\n")
    alone = grade(f"{tmp_path / 'main.py'}:attention", level="quick", isolation="bubblewrap")
    assert not alone.passed and "No module named 'helper'" in alone.error and "--candidate-dir" in alone.error
    named = grade(resolve(f"{tmp_path / 'main.py'}:attention", root=tmp_path), level="quick", isolation="bubblewrap")
    assert named.passed and named.isolation == "bubblewrap", named.error


def test_a_deleted_working_directory_does_not_stop_the_binds(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert str(ROOT.resolve() / "kernel_src") in _targets(_argv(tmp_path, monkeypatch), "--ro-bind")
