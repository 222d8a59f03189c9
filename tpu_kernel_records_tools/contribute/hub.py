"""The Hub side of a contribution: one dataset repository, its pull requests and their files.

A run is proposed as a pull request that adds ``submissions/<run_id>/`` to the dataset repository
(``create_commit(..., create_pr=True)``); a pull request's own changes are the files its head differs
in from the ``main`` commit it was opened on (:func:`pr_changes`). The token comes from huggingface_hub's
usual sources (``hf auth login``, ``HF_TOKEN``) and is never printed; ``HF_ENDPOINT`` is honoured. Every
Hub failure becomes ``builder.publish.HubError``: one line, with the exit status ``publish`` uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..builder.publish import HubError, hub_error

SUBMISSIONS = "submissions"  # a pull request adds one folder per run here: submissions/<run_id>/
T = TypeVar("T")


def client() -> Any:
    """``huggingface_hub.HfApi`` at ``$HF_ENDPOINT`` (read now, not at import) or the Hub."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)


def require_token(step: str) -> None:
    """Refuse (``unauthorized``) before any network access when no token is configured."""
    from huggingface_hub import get_token

    if get_token() is None:
        raise HubError("unauthorized", f"{step}: not logged in; run `hf auth login` or set HF_TOKEN to a token "
                                       "that may open pull requests")


def call(repo_id: str, step: str, fn: Callable[[], T]) -> T:
    """``fn()``, its Hub failure raised as the one-line ``HubError`` of ``step``."""
    try:
        return fn()
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one line; anything else propagates
        error = hub_error(e, repo_id, step)
        if error is None:
            raise
        raise error from None


@dataclass(frozen=True)
class Changes:
    """What pull request ``number`` changes: its head commit, and paths added, modified and deleted
    against the ``main`` commit it was opened on (``base``); ``added_bytes``: the added files' sizes."""

    number: int
    head: str
    base: str | None
    added: tuple[str, ...]
    modified: tuple[str, ...]
    deleted: tuple[str, ...]
    added_bytes: int = 0


def _tree(api: Any, repo_id: str, revision: str | None) -> dict[str, tuple[str, int]]:
    """``path -> (git blob id, size in bytes)`` of every file at ``revision``."""
    if revision is None:
        return {}
    from huggingface_hub.hf_api import RepoFile

    return {f.path: (f.blob_id, f.size) for f in api.list_repo_tree(repo_id, revision=revision, recursive=True,
                                                                    repo_type="dataset") if isinstance(f, RepoFile)}


def pr_changes(api: Any, repo_id: str, number: int) -> Changes:
    """The files pull request ``number`` changes (its commits that ``main`` lacks, taken together)."""
    from huggingface_hub.errors import RevisionNotFoundError

    step = f"review could not read pull request #{number}"

    def pr_history() -> list:
        try:
            return api.list_repo_commits(repo_id, revision=f"refs/pr/{number}", repo_type="dataset")
        except RevisionNotFoundError:
            raise HubError("not-found", f"{step}: {repo_id} has no pull request #{number}") from None

    history = call(repo_id, step, pr_history)
    main = {c.commit_id for c in call(repo_id, step, lambda: api.list_repo_commits(repo_id, repo_type="dataset"))}
    head = history[0].commit_id
    base = next((c.commit_id for c in history if c.commit_id in main), None)
    before, after = (call(repo_id, step, lambda r=r: _tree(api, repo_id, r)) for r in (base, head))
    added = tuple(sorted(set(after) - set(before)))
    return Changes(number, head, base, added,
                   tuple(sorted(p for p in set(after) & set(before) if after[p] != before[p])),
                   tuple(sorted(set(before) - set(after))), sum(after[p][1] for p in added))


def open_pull_requests(api: Any, repo_id: str) -> list[int]:
    """The numbers of the repository's open pull requests, oldest first."""
    found = call(repo_id, "review could not list the pull requests", lambda: list(api.get_repo_discussions(
        repo_id, discussion_type="pull_request", discussion_status="open", repo_type="dataset")))
    return sorted(d.num for d in found if d.is_pull_request)
