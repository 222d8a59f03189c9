"""Build: accept raw runs into data/, all or nothing.

The new state of data/ is assembled in a temporary copy beside it (raw run copied, one parquet file
per config for each new record, figure, card sections, checksums), verified, and only then swapped
in by renames; the card is replaced right after. Any refusal or failure leaves data/ and the card
untouched. Old records' files are carried over as they are: a new record never rewrites an old one.
Building with no runs regenerates every derived file from data/raw (after a builder change).
Builds of one data folder are serialised by a lock file (``filelock``; in the temp folder, named by
the data folder's path),
held from reading the current state to the swap, so two builds at once cannot lose a record.
Every file of a run is scanned for secret-shaped values (``records.secrets``) before it is accepted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from ..records import rawio
from ..records.secrets import scan_file
from ..records.schema import CHECKSUMS, CONFIG_NAMES

from . import card, plan
from .derive import CARD_SUM, RAW, card_sum_text, checksums_text, derive, record_ids
from .rules import Accepted, accept, run_files
from .tables import write_parquet
from .verify import check, default_card


class BuildError(RuntimeError):
    """A refused build. ``rule``, ``file`` and ``field`` name what broke (file as a path), as in ``RunError``."""

    def __init__(self, rule: str, file: str, field: str | None, message: str):
        self.rule, self.file, self.field = rule, file, field
        where = file + (f" at {field}" if field else "")
        super().__init__(f"[{rule}] {where}: {message}")


LOCK_TIMEOUT_S = 600


def _read(run_dir: Path, allow_interpret: bool) -> Accepted:
    try:
        acc = accept(rawio.read_run(run_dir), allow_interpret=allow_interpret, read_file=run_files(run_dir))
    except rawio.RunError as e:
        file = e.file if Path(e.file).is_absolute() or e.file == str(run_dir) else str(run_dir / e.file)
        raise BuildError(e.rule, file, e.field, str(e).split(": ", 1)[-1]) from e
    for rel in [rawio.MANIFEST, *acc.run["manifest"]["files"]]:
        found = scan_file(rel, (run_dir / rel).read_bytes())
        if found:
            raise BuildError("secret", str(run_dir / rel), None,
                             f"holds a value shaped like a {', '.join(found)}; remove it and re-measure")
    return acc


def check_run(run_dir: Path | str, *, allow_interpret: bool = False) -> Accepted:
    """Every rule ``build`` applies to one run folder (schemas, checksums, acceptance rules, secrets), and
    nothing written: the run accepted, or the ``BuildError`` build would refuse it with."""
    return _read(Path(run_dir), allow_interpret)


def _copy_run(run_dir: Path, accepted: Accepted, dest: Path) -> None:
    """Copy exactly the manifest and the files it lists."""
    for rel in [rawio.MANIFEST, *accepted.run["manifest"]["files"]]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / rel, dest / rel)


def _swap(new: Path, data_dir: Path) -> None:
    old = None
    if data_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{data_dir.name}.old-", dir=data_dir.parent))
        os.rename(data_dir, old / data_dir.name)
    try:
        os.rename(new, data_dir)
    except BaseException:
        if old is not None:
            os.rename(old / data_dir.name, data_dir)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old)


def build(run_dirs: Sequence[Path | str] = (), data_dir: Path | str = "data", card_path: Path | str | None = None,
          *, allow_interpret: bool = False, replace: bool = False, progress: bool = False,
          plan_path: Path | str | None = None) -> list[str]:
    """Accept ``run_dirs`` as records of ``data_dir``; update its checksums and the card. Returns the new ids.

    ``plan_path``: a ``tpu-kernel-records plan --json`` file to keep as ``data/plan/tpu-v5e.json``
    (``builder.plan``: checked, then shown in the card as predicted by the compiler, not measured).

    Raises ``BuildError`` (nothing written) when a run breaks a rule, a record id already exists
    (unless ``replace``), or the resulting state would not verify.
    """
    data_dir = Path(data_dir).absolute()
    card_path = Path(card_path) if card_path is not None else default_card(data_dir)
    if not card_path.is_file():
        raise BuildError("card", str(card_path), None, "the dataset card (with its marker comments) is missing")
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    lock = FileLock(str(Path(tempfile.gettempdir()) / f"tpu-kernel-records-build-{key}.lock"))
    try:
        with lock.acquire(timeout=LOCK_TIMEOUT_S):
            return _build_locked(paths=[Path(p) for p in run_dirs], data_dir=data_dir, card_path=card_path,
                                 allow_interpret=allow_interpret, replace=replace, progress=progress,
                                 plan_path=plan_path)
    except Timeout:
        raise BuildError("lock", lock.lock_file, None,
                         f"another build of {data_dir} held the lock for {LOCK_TIMEOUT_S} s") from None


def _build_locked(*, paths: list[Path], data_dir: Path, card_path: Path, allow_interpret: bool, replace: bool,
                  progress: bool, plan_path: Path | str | None = None) -> list[str]:
    existing = set(record_ids(data_dir))
    try:
        plan_doc = plan.read_plan(Path(plan_path)) if plan_path is not None else None
    except rawio.RunError as e:
        raise BuildError(e.rule, str(plan_path), e.field, str(e).split(": ", 1)[-1]) from e
    accepted: dict[str, tuple[Path, Accepted]] = {}
    for run_dir in tqdm(paths, desc="checking runs", unit="run", disable=not progress or len(paths) < 2):
        acc = _read(run_dir, allow_interpret)
        where = str(run_dir / rawio.MANIFEST)
        if acc.record_id in accepted:
            raise BuildError("duplicate-record", where, "run_id", f"{acc.record_id!r} is given twice")
        if acc.record_id in existing and not replace:
            raise BuildError("duplicate-record", where, "run_id",
                             f"record {acc.record_id!r} already exists in {data_dir}; pass --replace to replace it")
        accepted[acc.record_id] = (run_dir, acc)

    tmp = Path(tempfile.mkdtemp(prefix=f".{data_dir.name}.build-", dir=data_dir.parent))
    new = tmp / data_dir.name
    card_tmp = card_path.with_name(f".{card_path.name}.build-{os.getpid()}")
    try:
        if data_dir.exists():
            shutil.copytree(data_dir, new, symlinks=True)
        else:
            new.mkdir()
        for rid, (run_dir, acc) in accepted.items():
            if (new / RAW / rid).exists():
                shutil.rmtree(new / RAW / rid)
            _copy_run(run_dir, acc, new / RAW / rid)
        if plan_doc is not None:
            (new / plan.PLAN_FILE).parent.mkdir(parents=True, exist_ok=True)
            (new / plan.PLAN_FILE).write_bytes(plan.plan_bytes(plan_doc))
        derived = derive(new, {rid: acc for rid, (_, acc) in accepted.items()})
        rewrite = set(accepted) if accepted else set(derived.records)
        for rid in sorted(rewrite):
            for name in CONFIG_NAMES:
                (new / name).mkdir(exist_ok=True)
                (new / name / f"{rid}.parquet").unlink(missing_ok=True)
                if derived.records[rid][name].num_rows:  # no empty file: datasets cannot read one
                    write_parquet(derived.records[rid][name], str(new / name / f"{rid}.parquet"))
        (new / card.FIGURE).parent.mkdir(parents=True, exist_ok=True)
        (new / card.FIGURE).write_bytes(derived.figure())
        try:
            text = card.replace(card_path.read_bytes().decode(), derived.sections)
        except (UnicodeDecodeError, ValueError) as e:
            raise BuildError("card", str(card_path), None, str(e)) from e
        card_tmp.write_bytes(text.encode())
        (new / CARD_SUM).write_text(card_sum_text(text.encode()))
        (new / CHECKSUMS).write_text(checksums_text(new))
        problems = check(new, card_tmp, derived)
        if problems:
            raise BuildError("verify", str(data_dir), None, "the new state would not verify:\n  "
                             + "\n  ".join(problems) + "\n(a builder change? build with no runs to regenerate)")
        _swap(new, data_dir)
        os.replace(card_tmp, card_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        card_tmp.unlink(missing_ok=True)
    return sorted(accepted)
