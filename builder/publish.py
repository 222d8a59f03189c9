"""Publish a verified release to the Hugging Face Hub as a gated dataset, one commit and one tag per version.

Order of operations (``publish``): check the repo id and version; refuse unless ``verify`` passes;
stage the release (the card as README.md, data/, the loading script, kernel_src/, NOTICE, the two
licences); then on the Hub: ``create_repo`` (exist_ok), refuse if tag ``vX.Y.Z`` exists
(``list_repo_refs``), turn gating on (``update_repo_settings``) *before* any data is committed, plan
the commit against the remote tree (``list_repo_tree``: new or changed files are added, files no
longer in the release are deleted), ``create_commit`` once (``parent_commit`` pinned to the head
seen), ``create_tag``. The token comes from huggingface_hub's usual sources and is never printed.

Not exercised against the live Hub (the tests use an HfApi-shaped recorder, no network): the real
calls' responses, LFS/Xet uploads, how the Hub renders the gating form and the ``dataset_info``
YAML, and ``datasets.load_dataset(repo_id, ...)`` on the uploaded repository. Run a first release
into a private scratch repository before the public one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .verify import default_card, verify

MODULE_NAME = "tpu_kernel_records"
RELEASE_FILES = {"tpu_kernel_records.py": "tpu_kernel_records.py", "NOTICE": "NOTICE",
                 "LICENSE-data": "LICENSE-data", "LICENSE-code": "LICENSE-code"}
RELEASE_DIRS = ("kernel_src",)
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
KEEP_REMOTE = {".gitattributes"}
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


class PublishError(RuntimeError):
    """The release was refused before anything was pushed (or a push step failed)."""


@dataclass
class Plan:
    """What a publish does (or would do)."""

    repo_id: str
    tag: str
    gated: str
    files: dict[str, str]  # path in repo -> sha256
    additions: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deletions: list[str] = field(default_factory=list)
    remote_known: bool = False

    def lines(self) -> list[str]:
        out = [f"repo:     https://huggingface.co/datasets/{self.repo_id} (dataset; created if missing)",
               f"gating:   {self.gated} (set before the commit)", f"tag:      {self.tag} (refused if it exists)"]
        if not self.remote_known:
            out.append(f"commit:   {len(self.files)} files; at publish time, only new or changed ones are added "
                       "and remote files not in the release are deleted")
            out += [f"  + {path}  {digest[:12]}" for path, digest in sorted(self.files.items())]
            return out
        out.append(f"commit:   {len(self.additions)} added or changed, {len(self.deletions)} deleted, "
                   f"{len(self.unchanged)} unchanged")
        out += [f"  + {path}" for path in self.additions] + [f"  - {path}" for path in self.deletions]
        return out


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed id, or a name equal to the loading script's module name."""
    if not REPO_ID.match(repo_id):
        raise PublishError(f"--repo-id must be OWNER/NAME, got {repo_id!r}")
    if repo_id.split("/")[1].lower() == MODULE_NAME:
        raise PublishError(f"the repository name must not be {MODULE_NAME!r}: datasets then finds "
                           f"{MODULE_NAME}.py and refuses the repository as a script dataset; use a hyphenated "
                           "name such as tpu-kernel-records")


def check_version(version: str) -> str:
    """The tag of ``version`` (``X.Y.Z`` -> ``vX.Y.Z``)."""
    if not VERSION.match(version):
        raise PublishError(f"--version must be X.Y.Z, got {version!r}")
    return f"v{version}"


def stage(root: Path, dest: Path, data_dir: Path | None = None, card_path: Path | None = None) -> Path:
    """Write the release folder ``dest`` (atomically; refuses an existing ``dest``)."""
    root = Path(root)
    data_dir = Path(data_dir) if data_dir is not None else root / "data"
    card_path = Path(card_path) if card_path is not None else default_card(data_dir)
    dest = Path(dest).absolute()
    if dest.name == MODULE_NAME:
        raise PublishError(f"the staged folder must not be named {MODULE_NAME!r} (datasets refuses it)")
    if dest.exists():
        raise PublishError(f"{dest} already exists; stage into a new folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        shutil.copyfile(card_path, tmp / "README.md")
        shutil.copytree(data_dir, tmp / "data", ignore=IGNORED)
        for src, name in RELEASE_FILES.items():
            shutil.copyfile(root / src, tmp / name)
        for name in RELEASE_DIRS:
            shutil.copytree(root / name, tmp / name, ignore=IGNORED)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def staged_files(stage_dir: Path) -> dict[str, str]:
    """Path in repo -> sha256 of every file of a staged release."""
    return {p.relative_to(stage_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(stage_dir.rglob("*")) if p.is_file()}


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def plan_against_remote(plan: Plan, stage_dir: Path, remote: list[Any]) -> None:
    """Fill in additions, unchanged and deletions from the remote tree (``RepoFile``-like entries)."""
    remote_files = {entry.path: entry for entry in remote if hasattr(entry, "blob_id")}
    for path, digest in sorted(plan.files.items()):
        entry = remote_files.get(path)
        lfs = getattr(entry, "lfs", None) if entry is not None else None
        same = entry is not None and (
            (lfs.sha256 == digest) if lfs is not None
            else entry.blob_id == _git_blob_sha1((stage_dir / path).read_bytes()))
        (plan.unchanged if same else plan.additions).append(path)
    plan.deletions = sorted(set(remote_files) - set(plan.files) - KEEP_REMOTE)
    plan.remote_known = True


def publish(root: Path | str, repo_id: str, version: str, *, data_dir: Path | None = None,
            card_path: Path | None = None, dry_run: bool = False, stage_dir: Path | None = None,
            gated: str = "auto", api: Any = None, out: Callable[[str], None] = print) -> Plan:
    """Verify, stage and (unless ``dry_run`` or ``stage_dir``) push one tagged release. See the module doc.

    ``api`` replaces ``huggingface_hub.HfApi()`` (tests pass a recorder). ``stage_dir`` only writes
    the staged folder there; ``dry_run`` prints the plan; neither touches the network.
    """
    root = Path(root)
    data_dir = Path(data_dir) if data_dir is not None else root / "data"
    card_path = Path(card_path) if card_path is not None else default_card(data_dir)
    check_repo_id(repo_id)
    tag = check_version(version)
    if gated not in ("auto", "manual"):
        raise PublishError(f"--gated must be auto or manual, got {gated!r}")
    problems = verify(data_dir, card_path)
    if problems:
        raise PublishError("verify failed; nothing was published:\n  " + "\n  ".join(problems))

    if stage_dir is not None:
        staged = stage(root, Path(stage_dir), data_dir, card_path)
        plan = Plan(repo_id, tag, gated, staged_files(staged))
        out(f"staged {len(plan.files)} files in {staged} (nothing pushed)")
        return plan

    with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-release-") as tmp:
        staged = stage(root, Path(tmp) / "release", data_dir, card_path)
        plan = Plan(repo_id, tag, gated, staged_files(staged))
        if dry_run:
            out("dry run: no network access; the release would be:")
            for line in plan.lines():
                out(line)
            return plan
        if api is None:
            from huggingface_hub import HfApi
            api = HfApi()
        _push(api, plan, staged, version, out)
    return plan


def _push(api: Any, plan: Plan, staged: Path, version: str, out: Callable[[str], None]) -> None:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    repo = {"repo_id": plan.repo_id, "repo_type": "dataset"}
    api.create_repo(exist_ok=True, **repo)
    refs = api.list_repo_refs(**repo)
    if any(ref.name == plan.tag for ref in refs.tags):
        raise PublishError(f"tag {plan.tag} already exists in {plan.repo_id}; choose a new --version")
    head = next((ref.target_commit for ref in refs.branches if ref.name == "main"), None)
    api.update_repo_settings(gated=plan.gated, **repo)
    plan_against_remote(plan, staged, list(api.list_repo_tree(recursive=True, revision=head, **repo))
                        if head else [])
    for line in plan.lines():
        out(line)
    revision = head
    if plan.additions or plan.deletions:
        operations = ([CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(staged / p)) for p in plan.additions]
                      + [CommitOperationDelete(path_in_repo=p) for p in plan.deletions])
        info = api.create_commit(operations=operations, commit_message=f"Release {plan.tag}",
                                 commit_description=f"tpu-kernel-records {version}: "
                                 f"{len(plan.additions)} files added or changed, {len(plan.deletions)} deleted.",
                                 parent_commit=head, **repo)
        revision = info.oid
    if revision is None:
        raise PublishError("nothing to commit to an empty repository")
    api.create_tag(tag=plan.tag, tag_message=f"tpu-kernel-records {version}", revision=revision, **repo)
    out(f"published {plan.repo_id} at {plan.tag} ({revision})")
