"""Publish against a stand-in Hub on 127.0.0.1 (HF_ENDPOINT, ``tests/hub_standin.py``): the real
huggingface_hub client runs, the server answers 401, 403, gated, 404, 409 or 500 (or nothing listens).
Each failure is one line on stderr with its own exit status, never a traceback, and the token is never
printed."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

from hub_standin import StandInHub, built_workspace, client_env
from tpu_kernel_records_tools.builder.publish import HUB_STATUS
from tpu_kernel_records_tools.cli import main as commands

TOKEN = "hf_" + "StandInHubToken" * 3


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return built_workspace(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def env(monkeypatch):
    return client_env(monkeypatch, TOKEN)


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
