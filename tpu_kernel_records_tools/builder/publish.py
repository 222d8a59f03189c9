"""Publish a verified release to the Hugging Face Hub as a gated dataset, one commit and one tag per version.

Order of operations (``publish``): check the repo id (``huggingface_hub.utils.validate_repo_id``) and
that the version is ``records.schema.VERSION`` (the one place it is set); refuse unless ``verify``
passes; stage the release (the card as README.md with its usage examples naming this repo and tag,
data/, the loading script, kernel_src/, NOTICE, the two licences, PLAN_V5E.md when present); then on the Hub: ``create_repo``
(``private`` for a first release into a scratch repo; exist_ok), refuse if tag ``vX.Y.Z`` exists
(``list_repo_refs``), turn gating on (``update_repo_settings``) *before* any data is committed, one
``create_commit`` (``parent_commit`` pinned to the head seen) that adds every file (the client
itself skips files the Hub already holds unchanged) and deletes remote files no longer in the
release (``list_repo_files``), then ``create_tag``. The token comes from huggingface_hub's usual
sources and is never printed.

Every Hub failure becomes a ``HubError``: one line saying what happened and what to do, with its own
exit status (``HUB_STATUS``), never a traceback. Tested against a local HTTP server standing in for
the Hub, not against the live Hub: LFS/Xet uploads, how the Hub renders the gating form and the
``dataset_info`` YAML were never exercised here. Run a first release with ``--private`` into a
scratch repository before the public one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..records.schema import VERSION

from . import card
from .verify import default_card, verify

MODULE_NAME = "tpu_kernel_records"
RELEASE_FILES = {"tpu_kernel_records.py": "tpu_kernel_records.py", "NOTICE": "NOTICE",
                 "LICENSE-data": "LICENSE-data", "LICENSE-code": "LICENSE-code"}
RELEASE_DIRS = ("kernel_src",)
# Staged when present: the static v5e plan the card's plan section links to (predicted, not measured).
OPTIONAL_RELEASE_FILES = ("PLAN_V5E.md",)
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
KEEP_REMOTE = {".gitattributes"}

# Exit status of each kind of Hub failure (0 ok, 1 refused, 2 usage are the CLI's own).
HUB_STATUS = {"unauthorized": 3, "forbidden": 4, "gated": 5, "not-found": 6, "conflict": 7, "server": 8,
              "network": 9}


class PublishError(RuntimeError):
    """The release was refused before anything was pushed. ``status`` is the exit status (1)."""

    status = 1


class HubError(PublishError):
    """The Hub refused or failed a step; ``kind`` is a key of ``HUB_STATUS``; the message is one line."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.status = kind, HUB_STATUS[kind]


def hub_error(error: BaseException, repo_id: str, step: str) -> HubError | None:
    """The ``HubError`` for an exception raised by ``huggingface_hub`` during ``step`` (None: not a Hub error)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled

    url = f"https://huggingface.co/datasets/{repo_id}"
    if isinstance(error, GatedRepoError):
        return HubError("gated", f"{step}: {repo_id} is gated and this account has no access; accept its terms "
                                 f"at {url} or publish with a token of the owner")
    if isinstance(error, HfHubHTTPError):
        code = getattr(error.response, "status_code", None)
        if code == 401:
            return HubError("unauthorized", f"{step}: not logged in, or the token is invalid (HTTP 401); run "
                                            "`hf auth login` or set HF_TOKEN to a write token")
        if code == 403:
            return HubError("forbidden", f"{step}: this token may not write to {repo_id} (HTTP 403); use a write "
                                         "token of its owner or of a member of its organisation")
        if code == 404:
            return HubError("not-found", f"{step}: {repo_id} or its owner was not found (HTTP 404); check "
                                         "--repo-id (OWNER must be you or an organisation you write to)")
        if code in (409, 412):
            return HubError("conflict", f"{step}: the repository changed meanwhile (HTTP {code}: another commit "
                                        "moved the branch); nothing was tagged, run publish again")
        return HubError("server", f"{step}: the Hub answered HTTP {code}; nothing was tagged, try again later "
                                  "(https://status.huggingface.co)")
    if isinstance(error, OfflineModeIsEnabled):
        return HubError("network", f"{step}: HF_HUB_OFFLINE is set; unset it to publish")
    if isinstance(error, (ConnectionError, TimeoutError, OSError)) or type(error).__module__.startswith(
            ("httpx", "httpcore", "requests", "urllib3")):
        return HubError("network", f"{step}: the Hub could not be reached ({type(error).__name__}); check the "
                                   "network (and HF_ENDPOINT), then run publish again")
    return None


@dataclass
class Plan:
    """What a publish does (or would do)."""

    repo_id: str
    tag: str
    gated: str
    private: bool
    files: dict[str, str]  # path in repo -> sha256
    deletions: list[str] = field(default_factory=list)
    remote_known: bool = False

    def lines(self) -> list[str]:
        visibility = "private" if self.private else "public (unless it exists as private)"
        out = [f"repo:     https://huggingface.co/datasets/{self.repo_id} (dataset, {visibility}; created if "
               "missing)", f"gating:   {self.gated} (set before the commit)",
               f"tag:      {self.tag} (refused if it exists)"]
        deleted = (f"{len(self.deletions)} remote files deleted" if self.remote_known
                   else "remote files not in the release are deleted")
        out.append(f"commit:   {len(self.files)} files (the client skips those the Hub holds unchanged); {deleted}")
        out += [f"  + {path}  {digest[:12]}" for path, digest in sorted(self.files.items())]
        out += [f"  - {path}" for path in self.deletions]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "tag": self.tag, "gated": self.gated, "private": self.private,
                "files": dict(sorted(self.files.items())), "deletions": self.deletions,
                "remote_known": self.remote_known}


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed id (``validate_repo_id``, and an owner is required), or a name equal to the
    loading script's module name."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise PublishError(f"--repo-id must be OWNER/NAME: {str(e).splitlines()[0]}") from None
    if repo_id.count("/") != 1:
        raise PublishError(f"--repo-id must be OWNER/NAME, got {repo_id!r}")
    if repo_id.split("/")[1].lower() == MODULE_NAME:
        raise PublishError(f"the repository name must not be {MODULE_NAME!r}: datasets then finds "
                           f"{MODULE_NAME}.py and refuses the repository as a script dataset; use a hyphenated "
                           "name such as tpu-kernel-records")


def check_version(version: str | None) -> str:
    """The tag of the release (``vX.Y.Z``); ``version`` must be ``records.schema.VERSION`` (or None)."""
    if version is not None and version != VERSION:
        raise PublishError(f"--version {version} is not the release version {VERSION}: the version is set in one "
                           "place, records/schema.py (VERSION); change it there, rebuild, then publish")
    return f"v{VERSION}"


def stage(root: Path, dest: Path, data_dir: Path | None = None, card_path: Path | None = None,
          repo_id: str = card.PLACEHOLDER_REPO) -> Path:
    """Write the release folder ``dest`` (atomically; refuses an existing ``dest``). Its README.md is the
    card with the usage examples naming ``repo_id`` (the only difference; ``CARD.sha256`` still holds)."""
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
        text = card_path.read_bytes().decode()
        (tmp / "README.md").write_bytes(card.replace(text, {"usage": card.usage(repo_id)}).encode())
        shutil.copytree(data_dir, tmp / "data", ignore=IGNORED)
        for src, name in RELEASE_FILES.items():
            shutil.copyfile(root / src, tmp / name)
        for name in OPTIONAL_RELEASE_FILES:
            if (root / name).is_file():
                shutil.copyfile(root / name, tmp / name)
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


def publish(root: Path | str, repo_id: str, version: str | None = None, *, data_dir: Path | None = None,
            card_path: Path | None = None, dry_run: bool = False, stage_dir: Path | None = None,
            gated: str = "auto", private: bool = False, api: Any = None,
            out: Callable[[str], None] = print) -> Plan:
    """Verify, stage and (unless ``dry_run`` or ``stage_dir``) push one tagged release. See the module doc.

    ``api`` replaces ``huggingface_hub.HfApi(endpoint=$HF_ENDPOINT)`` (tests pass a recorder). ``stage_dir``
    only writes the staged folder there; ``dry_run`` only plans; neither touches the network. Raises
    ``PublishError`` (refused, status 1) or ``HubError`` (a Hub failure, its own status).
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
        staged = stage(root, Path(stage_dir), data_dir, card_path, repo_id)
        plan = Plan(repo_id, tag, gated, private, staged_files(staged))
        out(f"staged {len(plan.files)} files in {staged} (nothing pushed)")
        return plan

    with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-release-") as tmp:
        staged = stage(root, Path(tmp) / "release", data_dir, card_path, repo_id)
        plan = Plan(repo_id, tag, gated, private, staged_files(staged))
        if dry_run:
            out("dry run: no network access; the release would be:")
            for line in plan.lines():
                out(line)
            return plan
        if api is None:
            from huggingface_hub import HfApi
            api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        _push(api, plan, staged, out)
    return plan


def _push(api: Any, plan: Plan, staged: Path, out: Callable[[str], None]) -> None:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    repo = {"repo_id": plan.repo_id, "repo_type": "dataset"}
    step = "create the repository"

    def hub(name: str, call: Callable[[], Any]) -> Any:
        nonlocal step
        step = name
        return call()

    try:
        hub("create the repository", lambda: api.create_repo(exist_ok=True, private=plan.private, **repo))
        refs = hub("read its tags", lambda: api.list_repo_refs(**repo))
        if any(ref.name == plan.tag for ref in refs.tags):
            raise PublishError(f"tag {plan.tag} already exists in {plan.repo_id}; raise VERSION in "
                               "records/schema.py, rebuild, then publish")
        head = next((ref.target_commit for ref in refs.branches if ref.name == "main"), None)
        hub("switch gating on", lambda: api.update_repo_settings(gated=plan.gated, **repo))
        remote = hub("list its files", lambda: api.list_repo_files(revision=head, **repo)) if head else []
        plan.deletions = sorted(set(remote) - set(plan.files) - KEEP_REMOTE)
        plan.remote_known = True
        for line in plan.lines():
            out(line)
        operations = ([CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(staged / p)) for p in sorted(plan.files)]
                      + [CommitOperationDelete(path_in_repo=p) for p in plan.deletions])
        info = hub("commit the release", lambda: api.create_commit(
            operations=operations, commit_message=f"Release {plan.tag}",
            commit_description=f"tpu-kernel-records {plan.tag[1:]}: {len(plan.files)} files, "
                               f"{len(plan.deletions)} deleted.", parent_commit=head, **repo))
        hub("tag the release", lambda: api.create_tag(tag=plan.tag, tag_message=f"tpu-kernel-records {plan.tag[1:]}",
                                                      revision=info.oid, **repo))
    except PublishError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one line; anything else propagates
        error = hub_error(e, plan.repo_id, f"publish could not {step}")
        if error is None:
            raise
        raise error from None
    out(f"published {plan.repo_id} at {plan.tag} ({info.oid})")
