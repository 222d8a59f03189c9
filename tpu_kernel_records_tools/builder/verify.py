"""Verify a data folder: checksums, parquet schemas, tables regenerated from raw, the card's generated parts.

Problems are returned as a list of lines (empty means the release is consistent); any single edited
byte under data/ or in the card shows up as at least one problem, and so does any value shaped like
a credential in any file (``records.secrets``).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from ..records import rawio
from ..records.secrets import scan_file
from ..records.schema import CHECKSUMS, CONFIG_NAMES, FEATURES

from . import card
from .derive import CARD_SUM, RAW, Derived, card_sum_text, data_files, derive, record_ids
from .tables import ROW_GROUP_SIZE


def default_card(data_dir: Path) -> Path:
    """The card beside a data folder: ``dataset_card.md``, or ``README.md`` in a staged release."""
    for name in ("dataset_card.md", "README.md"):
        if (data_dir.parent / name).is_file():
            return data_dir.parent / name
    return data_dir.parent / "dataset_card.md"


def _checksums(data_dir: Path) -> list[str]:
    sums = data_dir / CHECKSUMS
    if not sums.is_file():
        return [f"{sums}: missing"]
    problems, listed = [], {}
    for n, line in enumerate(sums.read_text(errors="replace").splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64:
            problems.append(f"{CHECKSUMS} line {n}: not '<sha256>  <path>'")
            continue
        listed[rel] = digest
    present = set(data_files(data_dir))
    for rel, digest in sorted(listed.items()):
        if rel not in present:
            problems.append(f"{rel}: listed in {CHECKSUMS} but missing")
        elif rawio.sha256_file(data_dir / rel) != digest:
            problems.append(f"{rel}: sha256 differs from {CHECKSUMS}")
    problems += [f"{rel}: not listed in {CHECKSUMS}" for rel in sorted(present - set(listed))]
    return problems


def _tables(data_dir: Path, derived: Derived) -> list[str]:
    problems = []
    expected = {f"{name}/{rid}.parquet" for name in CONFIG_NAMES for rid in derived.records
                if derived.records[rid][name].num_rows}  # a record without rows in a config has no file there
    actual = {rel for rel in data_files(data_dir) if rel.endswith(".parquet")}
    problems += [f"{rel}: no such record under {RAW}/" for rel in sorted(actual - expected)]
    problems += [f"{rel}: missing" for rel in sorted(expected - actual)]
    for rel in sorted(expected & actual):
        name, rid = rel[:-len(".parquet")].split("/")
        try:
            parquet = pq.ParquetFile(data_dir / rel)
            table = parquet.read()
        except Exception as e:  # any unreadable file is a problem to report, not a crash
            problems.append(f"{rel}: unreadable parquet ({e})")
            continue
        if not table.schema.equals(FEATURES[name], check_metadata=True):
            problems.append(f"{rel}: schema differs from records.schema.FEATURES[{name!r}]")
        elif not table.equals(derived.records[rid][name]):
            problems.append(f"{rel}: rows differ from the table regenerated from {RAW}/{rid}")
        if any(parquet.metadata.row_group(i).num_rows > ROW_GROUP_SIZE for i in range(parquet.num_row_groups)):
            problems.append(f"{rel}: row groups larger than {ROW_GROUP_SIZE} rows")
    return problems


def _figure(data_dir: Path, derived: Derived) -> list[str]:
    path = data_dir / card.FIGURE
    if not path.is_file():
        return [f"{card.FIGURE}: missing"]
    try:
        stored = card.png_text(path.read_bytes()).get(card.FIGURE_KEY)
    except ValueError as e:
        return [f"{card.FIGURE}: {e}"]
    if stored != derived.figure_digest:
        return [f"{card.FIGURE}: plots other data than data/{RAW} holds; rebuild"]
    return []


def _card(data_dir: Path, card_path: Path, derived: Derived) -> list[str]:
    if not card_path.is_file():
        return [f"{card_path}: missing"]
    data = card_path.read_bytes()
    problems = []
    recorded = (data_dir / CARD_SUM).read_text() if (data_dir / CARD_SUM).is_file() else None
    if recorded is None:
        problems.append(f"{CARD_SUM}: missing")
    elif recorded != card_sum_text(data):
        problems.append(f"{card_path.name}: sha256 differs from {CARD_SUM} (edited since the last build; "
                        "run `tpu-kernel-records build` to refresh)")
    try:
        text = data.decode()
        for name, content in derived.sections.items():
            if name == "usage":  # names the placeholder, or the repo it was published to
                content = card.usage(card.usage_repo(text) or card.PLACEHOLDER_REPO)
            if card.extract(text, name) != content:
                problems.append(f"{card_path.name}: generated section {name!r} is not current")
    except (UnicodeDecodeError, ValueError) as e:
        problems.append(f"{card_path.name}: {e}")
    return problems


def secrets(data_dir: Path, card_path: Path | None = None) -> list[str]:
    """Every file of the release (parquet cells, raw JSON, gzipped evidence, the card) that holds a
    value shaped like a credential; names the file and the kind, never the value."""
    paths = [data_dir / rel for rel in [*data_files(data_dir), CHECKSUMS] if (data_dir / rel).is_file()]
    if card_path is not None and card_path.is_file():
        paths.append(card_path)
    problems = []
    for path in paths:
        try:
            found = scan_file(path.name, path.read_bytes())
        except Exception:  # an unreadable parquet is reported by _tables; scan its bytes instead
            found = scan_file(path.name + ".bytes", path.read_bytes())
        if found:
            shown = path.relative_to(data_dir).as_posix() if path.is_relative_to(data_dir) else path.name
            problems.append(f"{shown}: holds a value shaped like a {', '.join(found)} (secret scan)")
    return problems


def check(data_dir: Path, card_path: Path, derived: Derived) -> list[str]:
    """Every problem of ``data_dir`` and ``card_path`` against ``derived`` (what data/raw implies)."""
    return (_checksums(data_dir) + secrets(data_dir, card_path) + _tables(data_dir, derived)
            + _figure(data_dir, derived) + _card(data_dir, card_path, derived))


def verify(data_dir: Path | str = "data", card_path: Path | str | None = None) -> list[str]:
    """Every problem found in a data folder and its card; an empty list means it verifies."""
    data_dir = Path(data_dir)
    card_path = Path(card_path) if card_path is not None else default_card(data_dir)
    if not data_dir.is_dir():
        return [f"{data_dir}: not a folder"]
    if not record_ids(data_dir):
        return [f"{data_dir / RAW}: no records"]
    problems = _checksums(data_dir) + secrets(data_dir, card_path)
    try:
        derived = derive(data_dir)
    except rawio.RunError as e:
        return problems + [f"{RAW}/: {e}"]
    return problems + _tables(data_dir, derived) + _figure(data_dir, derived) + _card(data_dir, card_path, derived)
