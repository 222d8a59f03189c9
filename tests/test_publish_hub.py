"""Publish against a stand-in Hub on 127.0.0.1 (HF_ENDPOINT): the real huggingface_hub client runs, the
server answers 401, 403, gated, 404, 409 or 500 (or nothing listens). Each failure is one line on stderr
with its own exit status, never a traceback, and the token is never printed."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.builder.publish import HUB_STATUS
from tpu_kernel_records_tools.cli import main as commands
from release_fixtures import PUBLISHED

TOKEN = "hf_" + "StandInHubToken" * 3


class StandInHub(http.server.ThreadingHTTPServer):
    """Answers every request with ``status`` (and the Hub's error headers); records what was asked."""

    def __init__(self, status: int, error_code: str | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.status, self.error_code, self.requests = status, error_code, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization")))
        # As the Hub does, the body names the repo's url (create_repo reads it when a 409 means "exists").
        body = json.dumps({"error": f"stand-in hub says {self.server.status}",
                           "url": f"{self.server.url}/datasets/me/tpu-kernel-records"}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.server.error_code:
            self.send_header("X-Error-Code", self.server.error_code)
            self.send_header("X-Error-Message", "stand-in hub error")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("hub"))
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


def _publish(built: Path, endpoint: str, env, capsys, *extra: str) -> tuple[int, str, str]:
    env.setenv("HF_ENDPOINT", endpoint)
    code = commands.main(["publish", "--repo-id", "me/tpu-kernel-records", "--data", str(built / "data"),
                          "--quiet", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("status, error_code, kind, says", [
    (401, None, "unauthorized", "hf auth login"),
    (403, None, "forbidden", "may not write"),
    (403, "GatedRepo", "gated", "is gated"),
    (404, "RepoNotFound", "not-found", "check --repo-id"),
    (409, None, "conflict", "run publish again"),
    (500, None, "server", "HTTP 500"),
])
def test_each_hub_failure_is_one_line_with_its_own_status(built, env, capsys, status, error_code, kind, says):
    hub = StandInHub(status, error_code)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        code, out, err = _publish(built, hub.url, env, capsys, "--private")
    finally:
        hub.shutdown()
        hub.server_close()
    assert code == HUB_STATUS[kind] and code not in (0, 1, 2)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("publish failed: publish could not ") and says in err
    assert TOKEN not in out + err
    # The real client talked to the stand-in: it asked to create the repo (private), with the token.
    method, path, auth = hub.requests[0]
    assert (method, path) == ("POST", "/api/repos/create") and auth == f"Bearer {TOKEN}"


def test_network_down_is_one_line(built, env, capsys):
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _publish(built, f"http://127.0.0.1:{port}", env, capsys)
    assert code == HUB_STATUS["network"] and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "could not be reached" in err and TOKEN not in out + err


def test_json_error_is_machine_readable(built, env, capsys):
    hub = StandInHub(401)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        code, out, err = _publish(built, hub.url, env, capsys, "--json")
    finally:
        hub.shutdown()
        hub.server_close()
    result = json.loads(out)
    assert code == 3 and result == {"ok": False, "status": 3, "kind": "unauthorized", "error": result["error"]}


def test_refusal_keeps_status_1_and_touches_no_hub(built, env, capsys, tmp_path):
    hub = StandInHub(200)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    (ws / "dataset_card.md").write_text((ws / "dataset_card.md").read_text() + "\nunbuilt edit\n")
    try:
        code, _, err = _publish(ws, hub.url, env, capsys)
    finally:
        hub.shutdown()
        hub.server_close()
    assert code == 1 and err.startswith("publish refused: verify failed") and hub.requests == []
