"""Publishing against an HfApi-shaped recorder (no network): the plan, one commit with deletions, the tag,
gating before data, refusals (verify, existing tag, repo name, version), dry run and staging."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.builder.card import without_usage
from tpu_kernel_records_tools.builder.publish import PublishError, publish, staged_files
from tpu_kernel_records_tools.records.schema import VERSION
from release_fixtures import PUBLISHED


class Recorder:
    """Records every HfApi call; answers like a Hub repo that holds an older release."""

    def __init__(self, remote: dict[str, bytes] | None = None, tags: tuple[str, ...] = (), lfs: tuple[str, ...] = ()):
        self.calls: list[tuple[str, dict]] = []
        self.remote, self.tags, self.lfs = remote or {}, tags, lfs

    def _record(self, name: str, kwargs: dict) -> None:
        self.calls.append((name, kwargs))

    def create_repo(self, repo_id, **kwargs):
        self._record("create_repo", {"repo_id": repo_id, **kwargs})

    def list_repo_refs(self, repo_id, **kwargs):
        self._record("list_repo_refs", {"repo_id": repo_id, **kwargs})
        return SimpleNamespace(tags=[SimpleNamespace(name=t, target_commit="0" * 40) for t in self.tags],
                               branches=[SimpleNamespace(name="main", target_commit="a" * 40)])

    def update_repo_settings(self, repo_id, **kwargs):
        self._record("update_repo_settings", {"repo_id": repo_id, **kwargs})

    def list_repo_files(self, repo_id, **kwargs):
        self._record("list_repo_files", {"repo_id": repo_id, **kwargs})
        return list(self.remote)

    def create_commit(self, repo_id, operations, **kwargs):
        self._record("create_commit", {"repo_id": repo_id, "operations": list(operations), **kwargs})
        return SimpleNamespace(oid="c" * 40)

    def create_tag(self, repo_id, **kwargs):
        self._record("create_tag", {"repo_id": repo_id, **kwargs})

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("publish"))
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


@pytest.fixture
def ws(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "ws"))


def test_publish_plans_one_commit_then_tags(ws):
    readme = (ws / "dataset_card.md").read_bytes()
    parquet = (ws / "data" / "benchmark" / f"{PUBLISHED}.parquet").read_bytes()
    api = Recorder(remote={".gitattributes": b"*.parquet filter=lfs\n", "README.md": readme,
                           f"data/benchmark/{PUBLISHED}.parquet": parquet,
                           "data/benchmark/old-record.parquet": b"PAR1", "old_script.py": b"x"})
    lines: list[str] = []
    plan = publish(ws, "me/tpu-kernel-records", gated="manual", private=True, api=api, out=lines.append)

    assert api.names() == ["create_repo", "list_repo_refs", "update_repo_settings", "list_repo_files",
                           "create_commit", "create_tag"]
    calls = dict(api.calls)
    assert calls["create_repo"] == {"repo_id": "me/tpu-kernel-records", "repo_type": "dataset", "exist_ok": True,
                                    "private": True}
    assert calls["update_repo_settings"]["gated"] == "manual"
    assert calls["list_repo_files"]["revision"] == "a" * 40
    commit = calls["create_commit"]
    assert commit["repo_type"] == "dataset" and commit["parent_commit"] == "a" * 40
    added = sorted(op.path_in_repo for op in commit["operations"] if type(op).__name__ == "CommitOperationAdd")
    deleted = sorted(op.path_in_repo for op in commit["operations"] if type(op).__name__ == "CommitOperationDelete")
    assert deleted == ["data/benchmark/old-record.parquet", "old_script.py"] == plan.deletions
    # Every file is added; huggingface_hub's create_commit itself skips the ones the Hub holds unchanged.
    assert added == sorted(plan.files)
    assert {"tpu_kernel_records.py", "NOTICE", "LICENSE-data", "LICENSE-code", "kernel_src/contract.py",
            "data/SHA256SUMS", f"data/raw/{PUBLISHED}/manifest.json", "README.md"} <= set(added)
    assert not any("__pycache__" in path for path in plan.files)
    assert calls["create_tag"] == {"repo_id": "me/tpu-kernel-records", "repo_type": "dataset", "tag": f"v{VERSION}",
                                   "tag_message": f"tpu-kernel-records {VERSION}", "revision": "c" * 40}
    assert any("- old_script.py" in line for line in lines)


def test_existing_tag_is_refused_before_any_change(ws):
    api = Recorder(tags=(f"v{VERSION}",))
    with pytest.raises(PublishError, match=f"tag v{VERSION} already exists"):
        publish(ws, "me/tpu-kernel-records", "1.0.0", api=api, out=lambda line: None)
    assert api.names() == ["create_repo", "list_repo_refs"]


def test_verify_failure_refuses_before_the_network(ws):
    card = ws / "dataset_card.md"
    card.write_text(card.read_text() + "\nan unbuilt edit\n")
    api = Recorder()
    with pytest.raises(PublishError, match="verify failed"):
        publish(ws, "me/tpu-kernel-records", "1.0.0", api=api)
    assert api.calls == []


@pytest.mark.parametrize("repo_id, version, match", [
    ("me/tpu_kernel_records", "1.0.0", "must not be 'tpu_kernel_records'"),
    ("me/TPU_Kernel_Records", "1.0.0", "must not be 'tpu_kernel_records'"),
    ("tpu-kernel-records", "1.0.0", "OWNER/NAME"),
    ("me/tpu-kernel-records", "1.0", "records/schema.py"),
    ("me/tpu-kernel-records", "9.9.9", "is not the release version"),
    ("me/bad name", VERSION, "OWNER/NAME"),
    ("me/a/b", VERSION, "OWNER/NAME"),
])
def test_repo_name_and_version_guards(ws, capsys, repo_id, version, match):
    api = Recorder()
    with pytest.raises(PublishError, match=match):
        publish(ws, repo_id, version, api=api)
    assert api.calls == []
    code = commands.main(["publish", "--repo-id", repo_id, "--version", version, "--dry-run",
                          "--data", str(ws / "data")])
    assert code == 1 and match in capsys.readouterr().err


def test_dry_run_prints_the_whole_plan_offline(ws, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_canary_0123456789")
    monkeypatch.setattr("huggingface_hub.HfApi", lambda *a, **k: pytest.fail("dry run must not build an HfApi"))
    code = commands.main(["publish", "--repo-id", "me/tpu-kernel-records", "--version", "1.0.0", "--dry-run",
                          "--data", str(ws / "data")])
    out = capsys.readouterr().out
    assert code == 0 and "dry run: no network access" in out and "hf_canary" not in out
    for path in ("README.md", "tpu_kernel_records.py", "NOTICE", "LICENSE-code", "LICENSE-data",
                 "kernel_src/contract.py", f"data/environment/{PUBLISHED}.parquet"):
        assert f"+ {path} " in out
    assert "gating:   auto" in out and "tag:      v1.0.0" in out


def test_stage_writes_the_release_folder_only(ws):
    dest = ws / "release"
    plan = publish(ws, "me/tpu-kernel-records", "1.0.0", stage_dir=dest, api=Recorder(), out=lambda line: None)
    assert plan.files == staged_files(dest)
    # The published card names its repo and tag in the examples, and differs from the built card only there.
    readme, built_card = (dest / "README.md").read_text(), (ws / "dataset_card.md").read_text()
    assert f'load_dataset("me/tpu-kernel-records", "benchmark", split="train", revision="v{VERSION}")' in readme
    assert 'load_dataset("OWNER' not in readme and 'repo_id="OWNER' not in readme
    assert 'load_dataset("OWNER/tpu-kernel-records"' in built_card
    assert without_usage(readme) == without_usage(built_card)
    assert (dest / "data" / "SHA256SUMS").read_bytes() == (ws / "data" / "SHA256SUMS").read_bytes()
    with pytest.raises(PublishError, match="already exists"):
        publish(ws, "me/tpu-kernel-records", "1.0.0", stage_dir=dest, out=lambda line: None)
    with pytest.raises(PublishError, match="must not be named 'tpu_kernel_records'"):
        publish(ws, "me/tpu-kernel-records", "1.0.0", stage_dir=ws / "tpu_kernel_records", out=lambda line: None)
    # The staged release verifies on its own, with README.md as the card.
    from tpu_kernel_records_tools.builder.verify import verify
    assert verify(dest / "data") == []
