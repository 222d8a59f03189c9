"""The verifier catches any single edited byte: in a parquet file, in raw JSON, in the figure, in the card,
and a table that no longer matches its raw run even when the checksums were updated to hide it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.builder.derive import checksums_text
from tpu_kernel_records_tools.builder.tables import write_parquet
from release_fixtures import PUBLISHED
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.records.schema import CHECKSUMS


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("verify"))
    testing.write(ws / "runs", "synthetic-cpu")
    build([ws / "runs" / PUBLISHED, ws / "runs" / "synthetic-cpu"], ws / "data", allow_interpret=True)
    return ws


@pytest.fixture
def ws(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "ws"))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def test_clean_release_verifies(ws, capsys):
    assert verify(ws / "data") == []
    assert commands.main(["verify", "--data", str(ws / "data")]) == 0
    assert "consistent" in capsys.readouterr().out


@pytest.mark.parametrize("rel, offset, expect", [
    ("data/benchmark/published-tpu-v5e-8.parquet", 200, "benchmark/published-tpu-v5e-8.parquet"),
    ("data/correctness/synthetic-cpu.parquet", -20, "correctness/synthetic-cpu.parquet"),
    ("data/raw/published-tpu-v5e-8/benchmark.json", 300, "raw/published-tpu-v5e-8/benchmark.json"),
    ("data/raw/synthetic-cpu/manifest.json", 40, "raw/synthetic-cpu/manifest.json"),
    ("data/figures/pallas_xla_ratio.png", 100, "figures/pallas_xla_ratio.png"),
    ("data/SHA256SUMS", 3, CHECKSUMS),
    ("data/CARD.sha256", 5, "CARD.sha256"),
    ("dataset_card.md", 3000, "dataset_card.md"),   # hand-written prose
    ("dataset_card.md", -400, "dataset_card.md"),   # inside a generated section
])
def test_a_flipped_byte_is_caught(ws, capsys, rel, offset, expect):
    _flip(ws / rel, offset)
    problems = verify(ws / "data")
    assert problems and any(expect in p for p in problems), problems
    assert commands.main(["verify", "--data", str(ws / "data")]) == 1
    assert expect in capsys.readouterr().err


def test_a_flipped_byte_in_every_file_is_caught(ws):
    files = sorted(p for p in ws.glob("data/**/*") if p.is_file()) + [ws / "dataset_card.md"]
    for path in files:
        original = path.read_bytes()
        _flip(path, len(original) // 2)
        assert verify(ws / "data"), f"a flipped byte in {path.relative_to(ws)} went unnoticed"
        path.write_bytes(original)
    assert verify(ws / "data") == []


def test_a_table_that_disagrees_with_raw_is_caught_despite_fresh_checksums(ws):
    path = ws / "data" / "benchmark" / f"{PUBLISHED}.parquet"
    table = pq.read_table(path)
    medians = table.column("median_ms").to_pylist()
    medians[-1] = 1.0  # a hand-typed "correction"
    write_parquet(table.set_column(table.schema.get_field_index("median_ms"), table.schema.field("median_ms"),
                                   pa.array(medians, pa.float64())), str(path))
    (ws / "data" / CHECKSUMS).write_text(checksums_text(ws / "data"))
    assert verify(ws / "data") == [f"benchmark/{PUBLISHED}.parquet: rows differ from the table regenerated "
                                   f"from raw/{PUBLISHED}"]


def test_unlisted_and_missing_files_are_caught(ws):
    (ws / "data" / "benchmark" / "stray.parquet").write_bytes(b"PAR1")
    (ws / "data" / "environment" / "synthetic-cpu.parquet").unlink()
    problems = verify(ws / "data")
    assert "benchmark/stray.parquet: not listed in SHA256SUMS" in problems
    assert "environment/synthetic-cpu.parquet: listed in SHA256SUMS but missing" in problems
    assert "environment/synthetic-cpu.parquet: missing" in problems


def test_a_stale_card_section_is_caught(ws):
    card = ws / "dataset_card.md"
    text = card.read_text()
    assert "| 4 | 4 | 100% |" in text
    card.write_text(text.replace("| 4 | 4 | 100% |", "| 4 | 3 | 75% |"))
    assert any("generated section 'power' is not current" in p for p in verify(ws / "data"))


SECRETS = {
    "Hugging Face token": "hf_" + "Zq3x" * 9,
    "Kaggle API token": "KGAT_" + "0a1b2c3d" * 4,
    "Kaggle key": '{"username": "someone", "key": "' + "0123456789abcdef" * 2 + '"}',
    "AWS access key id": "AKIA" + "QWERTYUIOPASDFGH",
    "Google service-account JSON": '{"type": "service_account", "project_id": "p"}',
    "PEM private key": "-----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY-----",
}


@pytest.mark.parametrize("kind", sorted(SECRETS))
def test_verify_finds_a_secret_in_a_parquet_cell(ws, kind):
    """Even with every checksum updated to hide the edit, a secret-shaped value in a parquet cell fails verify."""
    path = ws / "data" / "environment" / "synthetic-cpu.parquet"
    table = pq.read_table(path)
    notes = pa.array([SECRETS[kind]], pa.string())
    write_parquet(table.set_column(table.schema.get_field_index("notes"), "notes", notes), str(path))
    (ws / "data" / CHECKSUMS).write_text(checksums_text(ws / "data"))
    problems = verify(ws / "data")
    assert f"environment/synthetic-cpu.parquet: holds a value shaped like a {kind} (secret scan)" in problems
    assert not any(SECRETS[kind][:12] in p for p in problems), "a problem line must not print the secret"


@pytest.mark.parametrize("rel", ["raw/synthetic-cpu/environment.json", "raw/synthetic-cpu/manifest.json",
                                 "notes.txt.gz"])
def test_verify_finds_a_secret_in_any_release_file(ws, rel, capsys):
    import gzip

    path = ws / "data" / rel
    token = SECRETS["Hugging Face token"]
    if rel.endswith(".gz"):
        path.write_bytes(gzip.compress(f"XLA_FLAGS=--x HF_TOKEN={token}".encode()))
    else:
        path.write_text(path.read_text().replace('"format_version": 1', f'"format_version": 1, "t": "{token}"', 1))
    problems = verify(ws / "data")
    assert f"{rel}: holds a value shaped like a Hugging Face token (secret scan)" in problems
    assert commands.main(["verify", "--data", str(ws / "data")]) == 1
    assert token not in capsys.readouterr().err


def test_verify_finds_a_secret_in_the_card(ws):
    card = ws / "dataset_card.md"
    card.write_text(card.read_text() + "\n" + SECRETS["PEM private key"] + "\n")
    assert "dataset_card.md: holds a value shaped like a PEM private key (secret scan)" in verify(ws / "data")


def test_look_alikes_are_not_secrets():
    """sha256 digests, git commits, run ids and the word 'key' do not trip the scanner."""
    from tpu_kernel_records_tools.records.secrets import find_secrets

    text = ('{"sha256": "' + "ab" * 32 + '", "git_commit": "' + "cd" * 20 + '", "key": "flash-xla-s128/x", '
            '"check": "hf_like_name", "KAGGLE_KERNEL_RUN_TYPE": "Batch", "notes": "AKIA is a prefix"}')
    assert find_secrets(text) == []
