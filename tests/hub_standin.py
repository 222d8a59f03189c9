"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the real ``huggingface_hub`` client (``HF_ENDPOINT``).

Two modes. ``StandInHub(status, error_code)`` answers every request with that status (and the Hub's
error headers): publish's and submit's failure paths. ``StandInHub()`` keeps one dataset repository in
memory, commits as whole snapshots, and implements only what ``submit`` and ``review`` call: repo info,
preupload and commit (``create_pr=1`` opens pull request ``refs/pr/N``), commit history, the recursive
tree, resolve (HEAD and GET) at a revision, and the discussions list and comment. Every request is
recorded as ``(method, path, Authorization)``. Not the Hub: no LFS, no Xet, no pagination.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import build

REPO_ID = "me/tpu-kernel-records"
DATE = "2026-01-01T00:00:00.000Z"


def client_env(monkeypatch, token: str):
    """A huggingface_hub client's environment for the stand-in: ``token`` as HF_TOKEN, no telemetry, online
    (HF_ENDPOINT is set per hub)."""
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


def built_workspace(dest: Path) -> Path:
    """``release_fixtures.workspace`` with its data/ built from the published record: a release to publish,
    and the state a refused contribution must leave as it was."""
    ws = testing.workspace(dest)
    build([ws / "runs" / testing.PUBLISHED], ws / "data")
    return ws


def blob_id(data: bytes) -> str:
    """git's blob sha1, as the Hub reports a file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandInHub(http.server.ThreadingHTTPServer):
    """See the module doc. ``repo_exists=False``: the repository is missing (404 RepoNotFound)."""

    def __init__(self, status: int | None = None, error_code: str | None = None, repo_id: str = REPO_ID,
                 repo_exists: bool = True):
        super().__init__(("127.0.0.1", 0), Handler)
        self.status, self.error_code, self.requests = status, error_code, []
        self.repo_id, self.repo_exists = repo_id, repo_exists
        self.commits: dict[str, dict] = {}
        self.branches: dict[str, str | None] = {"main": None}
        self.discussions: list[dict] = []
        self.lock = threading.Lock()
        self.commit("main", {".gitattributes": b"*.parquet filter=lfs\n"}, title="initial commit")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> "StandInHub":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    # --- the repository ---------------------------------------------------------------------------
    def resolve(self, revision: str) -> str | None:
        return self.branches[revision] if revision in self.branches else (
            revision if revision in self.commits else None)

    def files(self, revision: str = "main") -> dict[str, bytes]:
        head = self.resolve(revision)
        return dict(self.commits[head]["files"]) if head else {}

    def commit(self, branch: str, added: dict[str, bytes], deleted=(), title: str = "commit",
               description: str = "") -> str:
        files = self.files(branch) if self.branches.get(branch) else {}
        files.update(added)
        for path in deleted:
            files.pop(path)
        oid = hashlib.sha1(f"{len(self.commits)}:{title}".encode()).hexdigest()
        self.commits[oid] = {"id": oid, "parent": self.branches.get(branch), "files": files, "title": title,
                             "message": description}
        self.branches[branch] = oid
        return oid

    def open_pr(self, added: dict[str, bytes], deleted=(), title: str = "a pull request", description: str = "") -> int:
        """Open a pull request from main's head (as the client's create_pr does); returns its number."""
        num = len(self.discussions) + 1
        self.branches[f"refs/pr/{num}"] = self.branches["main"]
        self.commit(f"refs/pr/{num}", added, deleted, title, description)
        self.discussions.append({"num": num, "title": title, "status": "open", "isPullRequest": True,
                                 "comments": [], "description": description})
        return num

    def history(self, revision: str) -> list[dict]:
        out, oid = [], self.resolve(revision)
        while oid:
            out.append(self.commits[oid])
            oid = self.commits[oid]["parent"]
        return out


class Handler(http.server.BaseHTTPRequestHandler):
    server: StandInHub

    def _send(self, status: int, body: object = b"", headers: dict | None = None, head: bool = False) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if isinstance(body, bytes) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        hub = self.server
        hub.requests.append((self.command, self.path, self.headers.get("Authorization")))
        if hub.status is not None:  # the failure mode: every request answered alike; as the Hub does, the body
            # names the repo's url (create_repo reads it when a 409 means "exists")
            error = {"error": f"stand-in hub says {hub.status}", "url": f"{hub.url}/datasets/{hub.repo_id}"}
            codes = {"X-Error-Code": hub.error_code, "X-Error-Message": "stand-in hub error"} if hub.error_code else {}
            return self._send(hub.status, error, codes)
        split = urlsplit(self.path)
        segs, query = [unquote(s) for s in split.path.strip("/").split("/")], parse_qs(split.query)
        api = segs[:2] == ["api", "datasets"]
        repo = "/".join(segs[2:4] if api else segs[1:3])
        if repo != hub.repo_id or not hub.repo_exists:
            return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        with hub.lock:
            return self._route(segs[4:] if api else segs[3:], query, body, api)

    def _route(self, rest: list[str], query: dict, body: bytes, api: bool) -> None:
        hub = self.server
        if not api and rest[0] == "resolve":  # /datasets/OWNER/NAME/resolve/REV/PATH
            head, path = hub.resolve(rest[1]), "/".join(rest[2:])
            files = hub.files(head) if head else {}
            if path not in files:
                return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            etag = f'"{blob_id(files[path])}"'
            return self._send(200, files[path], {"X-Repo-Commit": head, "ETag": etag},
                              head=self.command == "HEAD")
        if not rest or rest[0] == "revision":
            head = hub.resolve(rest[1] if rest else "main")
            return self._send(200, {"id": hub.repo_id, "sha": head, "private": False, "gated": False,
                                    "siblings": [{"rfilename": p} for p in hub.files(head)]})
        if rest[0] == "preupload":
            files = json.loads(body)["files"]
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if rest[0] == "commit":
            return self._commit(rest[1], query, body)
        if rest[0] in ("commits", "tree") and hub.resolve(rest[1]) is None:
            return self._send(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
        if rest[0] == "commits":
            return self._send(200, [{"id": c["id"], "authors": [], "date": DATE, "title": c["title"],
                                     "message": c["message"]} for c in hub.history(rest[1])])
        if rest[0] == "tree":
            return self._send(200, [{"type": "file", "path": p, "size": len(d), "oid": blob_id(d)}
                                    for p, d in sorted(hub.files(rest[1]).items())])
        if rest[0] == "discussions":
            return self._discussions(rest[1:], query, body)
        return self._send(404, {"error": f"the stand-in hub has no {self.command} {self.path}"})

    def _commit(self, revision: str, query: dict, body: bytes) -> None:
        hub = self.server
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        added = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                 for item in lines if item["key"] == "file"}
        deleted = [item["value"]["path"] for item in lines if item["key"] == "deletedFile"]
        if query.get("create_pr") == ["1"]:
            num = hub.open_pr(added, deleted, header["summary"], header.get("description", ""))
            oid = hub.branches[f"refs/pr/{num}"]
            pr_url = f"{hub.url}/datasets/{hub.repo_id}/discussions/{num}"
        else:
            oid, pr_url = hub.commit(revision, added, deleted, header["summary"]), None
        return self._send(200, {"commitUrl": f"{hub.url}/datasets/{hub.repo_id}/commit/{oid}", "commitOid": oid,
                                "pullRequestUrl": pr_url})

    def _discussions(self, rest: list[str], query: dict, body: bytes) -> None:
        hub = self.server
        if not rest:  # the list (one page)
            wanted = [d for d in hub.discussions
                      if query.get("status", ["all"])[0] in ("all", d["status"])
                      and (query.get("type", ["all"])[0] != "pull_request" or d["isPullRequest"])]
            return self._send(200, {"count": len(wanted), "start": 0, "discussions": [
                {"num": d["num"], "title": d["title"], "status": d["status"], "isPullRequest": d["isPullRequest"],
                 "createdAt": DATE, "author": {"name": "someone"}, "repo": {"name": hub.repo_id, "type": "dataset"}}
                for d in wanted]})
        discussion = hub.discussions[int(rest[0]) - 1]
        if rest[1:] == ["comment"]:
            text = json.loads(body)["comment"]
            discussion["comments"].append(text)
            return self._send(200, {"newMessage": {
                "id": f"c{len(discussion['comments'])}", "type": "comment", "createdAt": DATE,
                "author": {"name": "maintainer"}, "data": {"edited": False, "hidden": False, "latest": {"raw": text}}}})
        return self._send(404, {"error": "not implemented by the stand-in hub"})

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass
