"""Everything under data/ that is derived from data/raw: tables, figure, card sections, checksums.

Layout of a data folder::

    raw/<record_id>/...            accepted run folders, byte for byte (manifest, JSON, evidence)
    <config>/<record_id>.parquet   one file per record and config (benchmark, correctness, environment);
                                   none where the record has no rows (a grader-power record's benchmark)
    figures/pallas_xla_ratio.png   the ratio figure of the card
    plan/tpu-v5e.json              the static v5e plan (``builder.plan``), predicted by the compiler, not
                                   measured; the card's plan section; absent until ``build --plan``
    CARD.sha256                    sha256 of the dataset card built with this data
    SHA256SUMS                     sha256 of every other file here (``cd data && sha256sum -c SHA256SUMS``)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ..records import rawio
from ..records.schema import CHECKSUMS, CONFIG_NAMES, FEATURES

from . import card, plan
from .rules import Accepted, accept, run_files
from .tables import record_tables

RAW = "raw"
CARD_SUM = "CARD.sha256"


@dataclass
class Derived:
    """What data/raw implies: each record's tables, the combined tables, the figure and the card sections."""

    records: dict[str, dict[str, pa.Table]]
    combined: dict[str, pa.Table]
    figure_digest: str
    sections: dict[str, str]

    def figure(self) -> bytes:
        """The ratio figure (PNG); rendered on demand, verifying needs only ``figure_digest``."""
        return card.figure_png(self.combined["benchmark"])


def read_record(data_dir: Path, record_id: str) -> Accepted:
    """Read and re-accept ``data/raw/<record_id>`` (interpret runs were admitted explicitly at build time)."""
    try:
        folder = data_dir / RAW / record_id
        run = rawio.read_run(folder)
        if run["manifest"]["run_id"] != record_id:
            raise rawio.RunError("record-id", "manifest.json", "run_id",
                                 f"run id {run['manifest']['run_id']!r} differs from its folder name")
        return accept(run, allow_interpret=True, read_file=run_files(folder))
    except rawio.RunError as e:
        message = str(e).split(": ", 1)[-1]
        raise rawio.RunError(e.rule, f"{RAW}/{record_id}/{e.file}", e.field, message) from e


def record_ids(data_dir: Path) -> list[str]:
    raw = data_dir / RAW
    return sorted(p.name for p in raw.iterdir() if p.is_dir()) if raw.is_dir() else []


def derive(data_dir: Path, accepted: dict[str, Accepted] | None = None) -> Derived:
    """Derive every generated artefact from the records under ``data_dir/raw``.

    ``accepted`` supplies records already read (by id); the others are read from disk.
    """
    accepted = dict(accepted or {})
    for record_id in record_ids(data_dir):
        if record_id not in accepted:
            accepted[record_id] = read_record(data_dir, record_id)
    records = {rid: record_tables(accepted[rid]) for rid in sorted(accepted)}
    combined = {name: pa.concat_tables([records[rid][name] for rid in records])
                if records else FEATURES[name].empty_table() for name in CONFIG_NAMES}
    digest = card.figure_digest(card.ratio_series(combined["benchmark"]))
    return Derived(records, combined, digest, {**card.sections(combined), "plan": plan.section(data_dir)})


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_files(data_dir: Path) -> list[str]:
    """Every file under ``data_dir`` except ``SHA256SUMS``, as sorted POSIX paths."""
    return sorted(p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*")
                  if p.is_file() and p.relative_to(data_dir).as_posix() != CHECKSUMS)


def checksums_text(data_dir: Path) -> str:
    """``SHA256SUMS`` for the current contents of ``data_dir`` (sha256sum format, sorted)."""
    return "".join(f"{rawio.sha256_file(data_dir / rel)}  {rel}\n" for rel in data_files(data_dir))


def card_sum_text(card_bytes: bytes) -> str:
    """``CARD.sha256``: sha256 of the card (README.md in a release, dataset_card.md here) with its usage
    section emptied (``card.without_usage``): publishing names the repo there and changes nothing else."""
    try:
        card_bytes = card.without_usage(card_bytes.decode()).encode()
    except (UnicodeDecodeError, ValueError):
        pass  # no usage markers: hash the bytes as they are (verify reports the missing markers)
    return f"{sha256_bytes(card_bytes)}  dataset_card.md\n"
