"""The CLI a person expects: --version, exit statuses documented and kept (0 ok / 1 refused / 2 usage),
--quiet, verify --json and publish --dry-run --json."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.records.schema import VERSION
from release_fixtures import PUBLISHED, REPO


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("cli"))
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


def test_version_is_the_release_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        commands.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"tpu-kernel-records {VERSION}"


def test_help_documents_the_exit_statuses():
    out = subprocess.run([sys.executable, "-m", "tpu_kernel_records_tools", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    text = " ".join(out.split())
    for words in ("0 ok", "1 refused or failed", "2 usage", "3 unauthorized", "9 network"):
        assert words in text


@pytest.mark.parametrize("argv", [["build", "--no-such-flag"], ["verify", "extra"], ["publish"], ["nope"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        commands.main(argv)
    assert exit_info.value.code == 2 and "usage:" in capsys.readouterr().err


def test_verify_json(built, tmp_path, capsys):
    assert commands.main(["verify", "--data", str(built / "data"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"data": str(built / "data"), "ok": True, "problems": []}
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    (ws / "data" / "SHA256SUMS").write_text("")
    assert commands.main(["verify", "--data", str(ws / "data"), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and any("not listed in SHA256SUMS" in p for p in result["problems"])


def test_quiet_build_and_verify_print_nothing(built, tmp_path, capsys):
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    run = testing.write(ws / "runs", "synthetic-cpu")
    assert commands.main(["build", str(run), "--data", str(ws / "data"), "--allow-interpret", "--quiet"]) == 0
    assert commands.main(["verify", "--data", str(ws / "data"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert commands.main(["build", str(run), "--data", str(ws / "data"), "--allow-interpret", "--quiet"]) == 1
    assert "[duplicate-record]" in capsys.readouterr().err


def test_publish_dry_run_json(built, capsys):
    assert commands.main(["publish", "--repo-id", "me/tpu-kernel-records", "--dry-run", "--json",
                          "--private", "--data", str(built / "data")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["ok"], plan["dry_run"], plan["tag"], plan["private"], plan["gated"]) == (
        True, True, f"v{VERSION}", True, "auto")
    assert "README.md" in plan["files"] and f"data/raw/{PUBLISHED}/manifest.json" in plan["files"]
    assert len(plan["files"]["README.md"]) == 64
