"""The environment record: where and with what a run was measured (environment.schema.json).

Environment variables are captured through an allow-list, never wholesale: a name must match an
allowed name or prefix *and* must not look like a credential. Values of credential-like variables
are also collected so that a run can be scanned for them before it is written
(:func:`find_secrets`).
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import importlib.metadata
import json
import os
import platform as _platform
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np

import kernel_src

from ..records.secrets import (ALLOWED_NAMES, ALLOWED_PREFIXES, SECRET_MARKERS, env_var_allowed,  # noqa: F401
                               looks_secret)

BOOTSTRAP_ENV = "TPU_KERNEL_RECORDS_BOOTSTRAP"
"""Path of a JSON list of version attempts (written by the Kaggle runner) for ``bootstrap``."""

MIN_SECRET_LENGTH = 8
KERNEL_SRC = Path(kernel_src.__file__).resolve().parent


def allowed_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed variables of ``environ`` (default ``os.environ``), sorted by name.

    A value that contains the value of any credential-like variable is dropped too.
    """
    environ = os.environ if environ is None else environ
    secrets = secret_values(environ)
    picked = {}
    for name in sorted(environ):
        if not env_var_allowed(name):
            continue
        value = environ[name]
        if not any(secret in value for secret in secrets):
            picked[name] = value
    return picked


def secret_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of credential-like variables, long enough to search for without false alarms."""
    environ = os.environ if environ is None else environ
    return {v for k, v in environ.items() if looks_secret(k) and len(v) >= MIN_SECRET_LENGTH}


def find_secrets(files: Mapping[str, bytes], environ: Mapping[str, str] | None = None) -> list[str]:
    """Relative paths in ``files`` whose bytes (gunzipped for ``*.gz``) contain a secret value."""
    secrets = [s.encode() for s in secret_values(environ)]
    leaks = []
    for rel, data in sorted(files.items()):
        texts = [data, gzip.decompress(data)] if rel.endswith(".gz") else [data]
        if any(secret in text for secret in secrets for text in texts):
            leaks.append(rel)
    return leaks


def kernel_src_sha256(root: Path = KERNEL_SRC) -> str:
    """sha256 over every ``*.py`` under ``root``: sorted relative POSIX paths, each hashed as
    ``path NUL byte-length NUL bytes``, so renaming, moving or editing any file changes it."""
    digest = hashlib.sha256()
    root = Path(root)
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "__pycache__" in path.parts:
            continue
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def git_commit(root: Path = KERNEL_SRC.parent) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding the project, or ``None`` outside one."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else None


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


GPU_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-rocm7-plugin", "jax-rocm60-plugin")


def versions() -> dict[str, str | None]:
    """Versions of jax, jaxlib, libtpu, the GPU plugin, python, numpy and the OS."""
    import jaxlib

    gpu = next(((p, v) for p in GPU_PLUGINS if (v := _version(p))), (None, None))
    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or _version("jaxlib") or "unknown",
        "libtpu": _version("libtpu", "libtpu-nightly"),
        "gpu_plugin": f"{gpu[0]}=={gpu[1]}" if gpu[0] else None,
        "python": _platform.python_version(),
        "numpy": np.__version__,
        "os": _platform.platform(),
    }


def cpu_model() -> str | None:
    """The host CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or None


def bootstrap_attempts(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The version attempts that led to this run.

    Read from the JSON file named by ``$TPU_KERNEL_RECORDS_BOOTSTRAP`` (the Kaggle runner writes
    it); otherwise one ``"used"`` entry for the running versions. Raises ``ValueError`` for a file
    that is not a JSON list.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(BOOTSTRAP_ENV)
    if path:
        attempts = json.loads(Path(path).read_text())
        if not isinstance(attempts, list):
            raise ValueError(f"{BOOTSTRAP_ENV}={path} must hold a JSON list of attempts")
        return attempts
    v = versions()
    return [{"jax": v["jax"], "jaxlib": v["jaxlib"], "libtpu": v["libtpu"], "outcome": "used", "error": None}]


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


def run_id_for(platform: str, device_kind: str, when: _dt.datetime) -> str:
    """``<platform>-<device kind>-<UTC stamp>``, lowercase, e.g. ``tpu-tpu-v5-lite-20250601t120000z``."""
    device = re.sub(r"[^a-z0-9.]+", "-", device_kind.lower()).strip("-.") or "device"
    return f"{platform}-{device}-{when.strftime('%Y%m%dt%H%M%Sz')}"[:128]


def capture(*, run_id: str, created: _dt.datetime, profile: str, devices_used: int, interpret: bool,
            notes: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The environment document of a run (validated later, on write)."""
    device = jax.devices()[0]
    return {
        "format_version": 1,
        "run_id": run_id,
        "source": "measured",
        "created_utc": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "profile": profile,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "devices_used": devices_used,
        "process_count": jax.process_count(),
        "interpret": interpret,
        "versions": versions(),
        "cpu_model": cpu_model(),
        "git_commit": git_commit(),
        "kernel_src_sha256": kernel_src_sha256(),
        "env_vars": allowed_env_vars(environ),
        "bootstrap": bootstrap_attempts(environ),
        "notes": " ".join(notes) or None,
    }
