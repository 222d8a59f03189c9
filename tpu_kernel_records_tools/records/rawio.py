"""Raw run folders: JSON Schema validation, manifest checksums, atomic writes.

Formats are checked (``date-time`` by ``FORMAT_CHECKER``, which needs no extra package).
A run folder holds ``environment.json``, ``correctness.json``, ``benchmark.json``, any evidence files
(e.g. gzipped StableHLO) and ``manifest.json`` with the sha256 of every other file. The schemas ship
in ``records/schemas`` so contributors can validate their own runs.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import jsonschema

DOCUMENTS = ("environment", "correctness", "benchmark")
MANIFEST = "manifest.json"
# What parsing a stranger's JSON may raise besides OSError: malformed or undecodable text, and numbers
# too long or nesting too deep for Python (ValueError, RecursionError); each becomes one clear line.
JSON_ERRORS = (ValueError, RecursionError)
MAX_DOCUMENT_BYTES = 64 << 20  # a run's JSON documents are kilobytes; a larger one is refused unread


class RunError(ValueError):
    """A run folder broke a rule; names the rule, the file and (where known) the field."""

    def __init__(self, rule: str, file: str, field: str | None, message: str):
        self.rule, self.file, self.field = rule, file, field
        where = f"{file}" + (f" at {field}" if field else "")
        super().__init__(f"[{rule}] {where}: {message}")


RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
FORMAT_CHECKER = jsonschema.FormatChecker(formats=())


@FORMAT_CHECKER.checks("date-time", raises=ValueError)
def is_date_time(value: object) -> bool:
    """RFC 3339 ``date-time`` (what JSON Schema's format means), checked with the standard library only."""
    if not isinstance(value, str):
        return True  # formats constrain strings only; the type keyword handles the rest
    if not RFC3339.match(value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time such as 2026-01-01T00:00:00Z")
    utc_time(value)  # raises ValueError for 2026-13-01 etc.
    return True


def utc_time(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time (``...Z`` or with an offset) as an aware UTC datetime; None stays None."""
    if text is None:
        return None
    return dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00")).astimezone(dt.timezone.utc)


@functools.cache
def load_schema(name: str) -> dict:
    """The JSON Schema of ``name`` (one of ``DOCUMENTS`` or ``"manifest"``)."""
    text = resources.files(__package__).joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


def scorecard_features() -> tuple[str, ...]:
    """The features a scorecard may declare (``features``), in the contract's order: the correctness
    schema's enum, which a test keeps equal to ``kernel_src.contract.FEATURES`` (the records need no JAX)."""
    return tuple(load_schema("correctness")["$defs"]["scorecard"]["properties"]["features"]["items"]["enum"])


def validate(name: str, document: Any, file: str | None = None) -> None:
    """Raise ``RunError`` unless ``document`` matches schema ``name``."""
    validator = jsonschema.Draft202012Validator(load_schema(name), format_checker=FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path) or None
        raise RunError("schema", file or f"{name}.json", field, error.message)


def sha256_file(path: Path) -> str:
    """Lowercase hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dumps(document: Any) -> bytes:
    """Canonical JSON bytes; NaN and Inf are refused rather than written."""
    return (json.dumps(document, indent=2, allow_nan=False) + "\n").encode()


def write_run(run_dir: Path, documents: Mapping[str, Any], extra_files: Mapping[str, bytes] = ()) -> Path:
    """Validate and write a complete run folder atomically (temp folder, then rename).

    ``documents`` maps each name in ``DOCUMENTS`` to its JSON object; ``extra_files`` maps relative
    POSIX paths to bytes. Refuses to overwrite an existing ``run_dir``. Nothing is left behind on error.
    """
    run_dir = Path(run_dir)
    missing = [name for name in DOCUMENTS if name not in documents]
    if missing:
        raise ValueError(f"write_run needs documents {missing}")
    for name in DOCUMENTS:
        validate(name, documents[name])
    if run_dir.exists():
        raise FileExistsError(f"run folder {run_dir} already exists; refusing to overwrite it")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    files = {f"{name}.json": dumps(documents[name]) for name in DOCUMENTS}
    files.update(dict(extra_files))
    manifest = {
        "format_version": 1,
        "run_id": documents["environment"]["run_id"],
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())},
    }
    validate("manifest", manifest, MANIFEST)  # before any write: its names must stay inside the folder
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.", suffix=".partial", dir=run_dir.parent))
    try:
        for rel, data in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (tmp / MANIFEST).write_bytes(dumps(manifest))
        os.rename(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir


def _load_json(path: Path, rel: str) -> Any:
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_DOCUMENT_BYTES:
        raise RunError("too-large", rel, None, f"{size} bytes; a run's JSON document holds at most "
                       f"{MAX_DOCUMENT_BYTES} (rawio.MAX_DOCUMENT_BYTES)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError("missing-file", rel, None, f"{path} does not exist") from None
    except JSON_ERRORS as e:
        raise RunError("corrupt-json", rel, None, f"not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _refuse_links(run_dir: Path) -> None:
    """A run folder holds plain files and folders only: a symbolic link (or a device, a pipe) could
    make the builder read, or copy into ``data/``, something outside it."""
    for parent, dirs, names in os.walk(run_dir):
        for name in sorted(dirs + names):
            path = Path(parent, name)
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise RunError("not-a-plain-file", path.relative_to(run_dir).as_posix(), None,
                               "a symbolic link or special file; a run folder holds plain files only")


def read_run(run_dir: Path) -> dict[str, Any]:
    """Read a run folder, checking the manifest, every checksum, every schema and the run id.

    Returns ``{"manifest": ..., "environment": ..., "correctness": ..., "benchmark": ...}``. The
    manifest's names must stay inside the folder (its schema) and nothing in it may be a link.
    Raises ``RunError`` naming the rule, file and field on the first problem found.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError("missing-file", str(run_dir), None, "run folder does not exist")
    _refuse_links(run_dir)
    manifest = _load_json(run_dir / MANIFEST, MANIFEST)
    validate("manifest", manifest, MANIFEST)
    listed = set(manifest["files"])
    for rel, expected in sorted(manifest["files"].items()):
        path = run_dir / rel
        if not path.is_file():
            raise RunError("missing-file", rel, None, "listed in the manifest but absent")
        actual = sha256_file(path)
        if actual != expected:
            raise RunError("checksum", rel, None, f"sha256 {actual} != manifest {expected}")
    unlisted = sorted(
        p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and p.relative_to(run_dir).as_posix() not in listed
    )
    if unlisted:
        raise RunError("unlisted-file", unlisted[0], None, "present in the run folder but not in the manifest")
    run = {"manifest": manifest}
    for name in DOCUMENTS:
        rel = f"{name}.json"
        run[name] = _load_json(run_dir / rel, rel)
        validate(name, run[name], rel)
        if run[name]["run_id"] != manifest["run_id"]:
            raise RunError("run-id", rel, "run_id",
                           f"{run[name]['run_id']!r} differs from the manifest's {manifest['run_id']!r}")
    return run
