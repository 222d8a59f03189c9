"""No secret in a record: the environment-variable allow-list and a scanner for secret-shaped values.

* The allow-list (``env_var_allowed``) is the one the measure job captures with and the builder
  re-applies: a name must be in ``ALLOWED_NAMES`` or start with one of ``ALLOWED_PREFIXES``, and must
  not look like a credential (``looks_secret``).
* ``find_secrets(text)`` finds values shaped like credentials, whatever field they hide in: Hugging
  Face tokens, Kaggle keys and API tokens, AWS access key ids, Google API keys, Google service-account
  JSON, PEM private keys, GitHub tokens. It returns what kind was found and where, never the value.
"""

from __future__ import annotations

import gzip
import io
import re
from typing import Any, Iterator

ALLOWED_NAMES = frozenset({
    "XLA_FLAGS", "LIBTPU_INIT_ARGS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "PJRT_DEVICE", "TPU_KERNEL_RECORDS_BOOTSTRAP",
})
ALLOWED_PREFIXES = ("JAX_", "TPU_", "XLA_PYTHON_CLIENT_", "NCCL_", "KAGGLE_KERNEL_RUN_TYPE")
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE",
                  "PRIVATE")

SECRET_PATTERNS: dict[str, re.Pattern[str]] = {
    "Hugging Face token": re.compile(r"\b(?:hf_[A-Za-z0-9]{30,}|api_org_[A-Za-z0-9]{30,})"),
    "Kaggle API token": re.compile(r"\bKGAT_[A-Za-z0-9]{20,}"),
    "Kaggle key": re.compile(r"(?i)(?:kaggle_key\W{0,4}|\"key\"\s*:\s*\")[0-9a-f]{32}\b"),
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "Google API key": re.compile(r"\bAIza[0-9A-Za-z_\-]{35}"),
    "Google service-account JSON": re.compile(r"\"type\"\s*:\s*\"service_account\"|\"private_key_id\"\s*:"),
    "PEM private key": re.compile(r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----"),
    "GitHub token": re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}\b|\bgithub_pat_[A-Za-z0-9_]{40,}"),
}


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name suggests a credential (checked case-insensitively)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def env_var_allowed(name: str) -> bool:
    """Whether a run may record environment variable ``name``."""
    return not looks_secret(name) and (name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES))


def find_secrets(text: str) -> list[str]:
    """The kinds of secret-shaped values in ``text`` (empty: none), each once, in pattern order."""
    return [kind for kind, pattern in SECRET_PATTERNS.items() if pattern.search(text)]


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def scan_file(name: str, data: bytes) -> list[str]:
    """Secret kinds found in one file's contents: parquet cells are read as text, ``.gz`` is
    unpacked, anything else is scanned as bytes (latin-1, so no byte is skipped)."""
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        text = "\n".join(_strings(table.to_pylist()))
    else:
        if name.endswith(".gz"):
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError):
                pass  # scan the bytes as they are
        text = data.decode("latin-1")
    return find_secrets(text)
