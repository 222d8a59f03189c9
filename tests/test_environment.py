"""The environment record: allow-listed variables only, the kernel hash, bootstrap, schema."""

import datetime as dt
import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from tpu_kernel_records_tools.measure import environment
from tpu_kernel_records_tools.records import rawio

SECRET = "canary-7f3a9c2e-do-not-publish"


def test_allow_list_keeps_only_named_variables_and_never_credentials():
    environ = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
        "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true", "TPU_NAME": "local",
        "TPU_SECRET_TOKEN": SECRET, "HF_TOKEN": SECRET, "KAGGLE_KEY": SECRET, "JAX_API_KEY": SECRET,
        "TPU_PASSWORD": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET, "HOME": "/root", "PATH": "/usr/bin",
        "USER": "root", "JAX_LEAKY": f"prefix-{SECRET}",
    }
    assert environment.allowed_env_vars(environ) == {
        "JAX_PLATFORMS": "cpu", "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true",
        "TPU_NAME": "local", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }


@pytest.mark.parametrize("name", ["HF_TOKEN", "KAGGLE_KEY", "TPU_SECRET_TOKEN", "my_password", "GH_AUTH"])
def test_credential_names_are_recognised(name):
    assert environment.looks_secret(name)


def test_find_secrets_looks_inside_gzip_too():
    environ = {"HF_TOKEN": SECRET, "XDG_SESSION": "short"}
    files = {"a.json": b"{}", "b.mlir.gz": gzip.compress(f"x {SECRET} y".encode()),
             "c.json": f'"{SECRET}"'.encode()}
    assert environment.find_secrets(files, environ) == ["b.mlir.gz", "c.json"]
    assert environment.find_secrets({"a.json": b"short"}, environ) == []


def test_kernel_src_hash_is_deterministic_and_sensitive(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("ignored")
    first = environment.kernel_src_sha256(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{64}", first) and first == environment.kernel_src_sha256(tmp_path)
    (tmp_path / "notes.txt").write_text("still ignored")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "c.py").write_text("cache")
    assert environment.kernel_src_sha256(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    edited = environment.kernel_src_sha256(tmp_path)
    assert edited != first
    (tmp_path / "a.py").rename(tmp_path / "c.py")
    assert environment.kernel_src_sha256(tmp_path) not in (first, edited)


def _independent_kernel_hash(root: Path) -> str:
    """The documented recipe, written again with os.walk: every ``*.py`` outside ``__pycache__``, by sorted
    relative POSIX path, hashed as ``path NUL byte-length NUL bytes``."""
    entries = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                entries.append((path.relative_to(root).as_posix(), path.read_bytes()))
    blob = b"".join(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data for rel, data in sorted(entries))
    return hashlib.sha256(blob).hexdigest()


def test_kernel_src_hash_covers_the_real_kernels():
    root = Path(__file__).resolve().parent.parent / "kernel_src"
    assert environment.KERNEL_SRC.resolve() == root
    expected = _independent_kernel_hash(root)
    assert environment.kernel_src_sha256() == expected
    assert (root / "reference.py").is_file() and len(list(root.rglob("*.py"))) >= 5  # the kernels are in it


def test_kernel_src_hash_matches_sha256_of_the_recipe(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.py").write_bytes(b"print(1)\n")
    (tmp_path / "sub" / "a.py").write_bytes(b"")
    want = hashlib.sha256(b"b.py\x009\x00print(1)\n" + b"sub/a.py\x000\x00").hexdigest()
    assert environment.kernel_src_sha256(tmp_path) == want == _independent_kernel_hash(tmp_path)


def test_bootstrap_defaults_to_the_running_versions(tmp_path):
    (default,) = environment.bootstrap_attempts({})
    assert default["outcome"] == "used" and default["error"] is None
    assert default["jax"] == environment.versions()["jax"]
    attempts = [{"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.17", "outcome": "rejected", "error": "x"},
                {"jax": "0.6.2", "jaxlib": "0.6.2", "libtpu": "0.0.17", "outcome": "used", "error": None}]
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps(attempts))
    assert environment.bootstrap_attempts({environment.BOOTSTRAP_ENV: str(path)}) == attempts
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        environment.bootstrap_attempts({environment.BOOTSTRAP_ENV: str(path)})


def test_run_id_matches_the_schema_pattern():
    when = dt.datetime(2025, 6, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    run_id = environment.run_id_for("tpu", "TPU v5 lite", when)
    assert run_id == "tpu-tpu-v5-lite-20250601t120000z"
    pattern = rawio.load_schema("environment")["properties"]["run_id"]["pattern"]
    assert re.fullmatch(pattern, run_id)
    assert re.fullmatch(pattern, environment.run_id_for("gpu", "NVIDIA H100 80GB HBM3", when))


def test_capture_is_schema_valid_and_lists_no_secret(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("TPU_RECORDS_TEST_MARKER", "visible")
    doc = environment.capture(run_id="cpu-cpu-test", created=environment.utc_now(), profile="tiny",
                              devices_used=1, interpret=True, notes=["a note."])
    rawio.validate("environment", doc)
    assert doc["env_vars"]["TPU_RECORDS_TEST_MARKER"] == "visible"
    assert SECRET not in json.dumps(doc)
    assert doc["versions"]["python"] and doc["device_count"] >= 1 and doc["notes"] == "a note."
