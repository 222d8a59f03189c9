"""Each property ``records.secrets`` claims in its docstring, one test each.

* A variable is recorded iff its name is in ``ALLOWED_NAMES`` or starts with an ``ALLOWED_PREFIXES``
  entry, and its name carries no credential marker (case-insensitively).
* ``find_secrets`` finds every kind it lists, in any field, and returns kinds, never values.
* ``scan_file`` reads parquet cells (nested ones too) as text and unpacks ``.gz``; anything else is
  scanned byte for byte.
"""

from __future__ import annotations

import gzip
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tpu_kernel_records_tools.records import secrets

# One value of each kind the scanner lists (made up; the right shape, no real credential).
EXAMPLES = {
    "Hugging Face token": "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "Kaggle API token": "KGAT_" + "0123456789abcdefABCDEF",
    "Kaggle key": '"key": "' + "0123456789abcdef" * 2 + '"',
    "AWS access key id": "ASIA" + "QWERTYUIOPASDFGH",
    "Google API key": "AIza" + "SyA-0123456789abcdefghijklmnopqrstu",
    "Google service-account JSON": '"private_key_id": "abc"',
    "PEM private key": "-----BEGIN EC PRIVATE KEY-----",
    "GitHub token": "ghp_" + "A" * 36,
}


def test_every_listed_kind_has_an_example_here():
    assert set(EXAMPLES) == set(secrets.SECRET_PATTERNS)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_kind_is_found_inside_other_text_and_never_echoed(kind):
    text = f'{{"notes": "ran with {EXAMPLES[kind]} set", "flags": "--x"}}'
    found = secrets.find_secrets(text)
    assert found == [kind]
    assert not any(EXAMPLES[kind] in item or item in EXAMPLES[kind] for item in found)


@pytest.mark.parametrize("name", sorted(secrets.ALLOWED_NAMES))
def test_every_allowed_name_is_recorded(name):
    assert secrets.env_var_allowed(name)


@pytest.mark.parametrize("prefix", secrets.ALLOWED_PREFIXES)
def test_a_name_with_an_allowed_prefix_is_recorded_unless_it_names_a_credential(prefix):
    assert secrets.env_var_allowed(prefix + "SETTING")
    for marker in secrets.SECRET_MARKERS:
        assert not secrets.env_var_allowed(prefix + marker)
        assert not secrets.env_var_allowed((prefix + "_" + marker).lower())


@pytest.mark.parametrize("name", ["HOME", "PATH", "USER", "HF_HOME", "PYTHONPATH", "LD_PRELOAD", "SSH_AUTH_SOCK",
                                  "XLA", "JAX", "KAGGLE_USERNAME", "ALL_PROXY", "xla_flags"])
def test_any_other_name_is_not_recorded(name):
    assert not secrets.env_var_allowed(name)


@pytest.mark.parametrize("marker", secrets.SECRET_MARKERS)
def test_markers_are_matched_case_insensitively_anywhere_in_the_name(marker):
    assert secrets.looks_secret(f"a_{marker.lower()}_b") and secrets.looks_secret(marker)


def _parquet(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def test_scan_file_reads_parquet_cells_nested_ones_too():
    token = EXAMPLES["GitHub token"]
    table = pa.table({"run": ["a"], "env": [[{"name": "X", "value": token}]]})
    assert secrets.scan_file("x.parquet", _parquet(table)) == ["GitHub token"]
    assert secrets.scan_file("x.parquet", _parquet(pa.table({"run": ["a"]}))) == []
    assert secrets.scan_file("x.parquet", _parquet(pa.table({token: ["a"]}))) == ["GitHub token"]  # a column name


def test_scan_file_unpacks_gzip_and_scans_other_files_byte_for_byte():
    token = EXAMPLES["AWS access key id"]
    assert secrets.scan_file("hlo.txt.gz", gzip.compress(f"x {token} y".encode())) == ["AWS access key id"]
    assert secrets.scan_file("blob.bin", b"\xff\x00" + token.encode() + b"\x80") == ["AWS access key id"]
    # a .gz that is not gzip is scanned as it is
    assert secrets.scan_file("broken.gz", token.encode()) == ["AWS access key id"]
