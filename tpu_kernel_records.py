"""tpu-kernel-records: attention kernels measured on real hardware (loading script).

Three configs, each one parquet file per record under ``data/<config>/``:

* ``benchmark`` (default): one row per benchmark case, every timing sample as a list.
* ``correctness``: one row per candidate x check of the correctness rubric, and one row per
  candidate of the grader-power summary where a record carries one.
* ``environment``: one row per record: machine, versions, bootstrap history.

This file travels alone (datasets copies it into its modules cache), so it declares no schema and
globs no folder: each config's files are listed in ``data/SHA256SUMS`` and fetched through the download
manager relative to the dataset's base path (a local release, a checkout, a Hub repo at a revision);
each file's sha256 is checked; the features are read from the parquet files' own Arrow schema, which
the builder wrote from ``records.schema.FEATURES``. It needs only the standard library, ``datasets``
and ``pyarrow`` (``huggingface_hub``, a dependency of ``datasets``, only for the Hub route of ``load``).

With ``datasets`` 2.x/3.x (``load_dataset`` on the Hub repository itself reads its parquet configs)::

    load_dataset("path/to/release/tpu_kernel_records.py", "benchmark", trust_remote_code=True)

``datasets`` >= 4 no longer runs loading scripts through ``load_dataset``; use the builder directly::

    from tpu_kernel_records import VERSION_STRING, TpuKernelRecords, load
    builder = TpuKernelRecords(config_name="benchmark")      # data/ next to this file
    builder.download_and_prepare()
    table = builder.as_dataset(split="train")
    table = load("correctness")                                # the same, in one call
    table = load("benchmark", repo_id="OWNER/tpu-kernel-records", revision="v" + VERSION_STRING)  # from the Hub

``OWNER/tpu-kernel-records`` stands for the Hub repository the release is published to.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

# These four equal records.schema's (a test keeps them so); this file cannot import the package.
VERSION_STRING = "1.0.0"
CONFIG_NAMES = ("benchmark", "correctness", "environment")
CHECKSUMS = "SHA256SUMS"
DATA = "data"  # the data folder, relative to the dataset's base path
DEFAULT_CONFIG = "benchmark"
LICENSE = "cc-by-nc-4.0"
HOMEPAGE = "https://huggingface.co/datasets?search=tpu-kernel-records"
DESCRIPTION = (
    "Attention kernels (Pallas kernels and a pure-JAX/XLA reference) measured on real hardware: a "
    "synchronized benchmark with every timing sample, the correctness rubric and grader power that decide "
    "when two correct answers disagree, and the environment each record was measured in. A record with "
    "source 'published-summary' is transcribed from a published card (medians only, no samples); rows with "
    "interpret=true ran Pallas in interpret mode on a CPU and say nothing about kernel speed."
)
CITATION = """\
@misc{tpu_kernel_records,
  title        = {tpu-kernel-records: attention kernels measured on real hardware},
  author       = {{The tpu-kernel-records authors}},
  year         = {2026},
  howpublished = {Hugging Face dataset},
  note         = {The published TPU v5e records were measured by Laela Zorana on a Kaggle TPU v5e worker.}
}
"""

VERSION = datasets.Version(VERSION_STRING)


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding ``SHA256SUMS`` and ``<config>/*.parquet``: ``data_dir`` itself, its ``data/``,
    or ``data/`` beside this file."""
    root = Path(data_dir) if data_dir is not None else Path(__file__).resolve().parent
    if not (root / CHECKSUMS).is_file() and (root / DATA).is_dir():
        root = root / DATA
    return root


def data_fingerprint(data_dir: Path) -> str | None:
    """A short hash of a local ``SHA256SUMS`` (None where there is none): it keys the ``datasets``
    cache, so a prepared dataset is never served after the data changed."""
    sums = Path(data_dir) / CHECKSUMS
    return hashlib.sha256(sums.read_bytes()).hexdigest()[:16] if sums.is_file() else None


def config_files(sums_text: str, config: str) -> dict[str, str]:
    """``{path relative to data/: sha256}`` of ``config``'s parquet files, from ``SHA256SUMS`` text."""
    files = {}
    for line in sums_text.splitlines():
        digest, sep, rel = line.partition("  ")
        if sep and rel.startswith(f"{config}/") and rel.endswith(".parquet"):
            files[rel] = digest
    return dict(sorted(files.items()))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class TpuKernelRecordsConfig(datasets.BuilderConfig):
    """One of ``CONFIG_NAMES``."""


class TpuKernelRecords(datasets.ArrowBasedBuilder):
    """Reads ``data/<config>/*.parquet`` as listed in ``data/SHA256SUMS`` under the dataset's base path.

    ``load_dataset`` passes the base path (the release folder or ``hf://datasets/...@revision``); used
    directly, the base path is ``data_dir``'s release (``data_dir`` may be a release or its ``data/``),
    else the folder of this file.
    """

    VERSION = VERSION
    BUILDER_CONFIG_CLASS = TpuKernelRecordsConfig
    BUILDER_CONFIGS = [TpuKernelRecordsConfig(name=name, version=VERSION, description=f"The {name} table.")
                       for name in CONFIG_NAMES]
    DEFAULT_CONFIG_NAME = DEFAULT_CONFIG

    def __init__(self, *args: Any, data_dir: str | Path | None = None, base_path: str | None = None,
                 hash: str | None = None, **kwargs: Any):
        if base_path is None or data_dir is not None:
            local = resolve_data_dir(data_dir)
            base_path, hash = str(local.parent), hash or data_fingerprint(local)
            self._data = local.name
        else:
            self._data = DATA
            # load_dataset keys the cache on the script's hash alone; a local release also on its data.
            fingerprint = data_fingerprint(Path(base_path) / DATA) if "://" not in base_path else None
            if fingerprint is not None:
                hash = hashlib.sha256(f"{hash}:{fingerprint}".encode()).hexdigest()[:16]
        super().__init__(*args, base_path=base_path, hash=hash, **kwargs)

    @classmethod
    def get_all_exported_dataset_infos(cls) -> dict:
        """None: the card's ``dataset_info`` describes the parquet route, and datasets 2.x/3.x keep the card
        of the first release loaded beside this script's cached module, then check later releases' split
        sizes against it. The rows are verified by ``SHA256SUMS`` instead."""
        return {}

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(description=DESCRIPTION, citation=CITATION, homepage=HOMEPAGE,
                                    license=LICENSE)

    def _split_generators(self, dl_manager: Any) -> list[datasets.SplitGenerator]:
        sums_path = dl_manager.download(f"{self._data}/{CHECKSUMS}")
        with open(sums_path, encoding="utf-8") as f:
            listed = config_files(f.read(), self.config.name)
        if not listed:
            raise FileNotFoundError(f"{CHECKSUMS} lists no parquet file of config {self.config.name!r}")
        local = dl_manager.download([f"{self._data}/{rel}" for rel in listed])
        for (rel, digest), path in zip(listed.items(), local):
            if _sha256(path) != digest:
                raise OSError(f"{DATA}/{rel}: sha256 differs from {CHECKSUMS}; the download is damaged or stale")
        if self.info.features is None:
            self.info.features = datasets.Features.from_arrow_schema(pq.read_schema(local[0]))
        return [datasets.SplitGenerator(name=datasets.Split.TRAIN, gen_kwargs={"files": local})]

    def _generate_tables(self, files: list[str]) -> Iterator[tuple[Any, pa.Table]]:
        schema = self.info.features.arrow_schema
        key = getattr(datasets.builder, "Key", lambda shard, batch: (shard, batch))
        for shard, path in enumerate(files):
            for batch, record_batch in enumerate(pq.ParquetFile(path).iter_batches()):
                yield key(shard, batch), pa.Table.from_batches([record_batch]).cast(schema)


class AccessError(PermissionError):
    """The Hub refused access to the gated dataset."""


def _access_error(repo_id: str) -> AccessError:
    return AccessError(
        f"Access to the gated dataset {repo_id} was not granted. Log in (`hf auth login`, or set HF_TOKEN) "
        f"and accept the terms at https://huggingface.co/datasets/{repo_id}, then try again.")


def load(config: str = DEFAULT_CONFIG, *, repo_id: str | None = None, revision: str | None = None,
         data_dir: str | Path | None = None, split: str = "train", cache_dir: str | None = None,
         token: str | bool | None = None, api: Any = None) -> datasets.Dataset:
    """Load one config as a ``datasets.Dataset``.

    Without ``repo_id``: builds from local ``data/`` (``data_dir``, or the folder beside this file).
    With ``repo_id``: ``datasets.load_dataset(repo_id, config, revision=...)`` after an access check
    (``HfApi.auth_check``; ``api`` replaces the ``HfApi`` in tests). Raises ``AccessError`` with how to
    get access when the Hub refuses it (gated, 401 or 403).
    """
    if config not in CONFIG_NAMES:
        raise ValueError(f"config must be one of {CONFIG_NAMES}, got {config!r}")
    if repo_id is None:
        builder = TpuKernelRecords(config_name=config, data_dir=data_dir, cache_dir=cache_dir)
        builder.download_and_prepare()
        return builder.as_dataset(split=split)

    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    api = api if api is not None else HfApi()
    try:
        api.auth_check(repo_id, repo_type="dataset", token=token)
    except GatedRepoError as e:
        raise _access_error(repo_id) from e
    except HfHubHTTPError as e:
        if getattr(e.response, "status_code", None) in (401, 403):
            raise _access_error(repo_id) from e
        raise
    try:
        return datasets.load_dataset(repo_id, config, revision=revision, split=split, cache_dir=cache_dir,
                                     token=token)
    except datasets.exceptions.DatasetNotFoundError as e:
        if isinstance(e.__cause__, GatedRepoError) or "gated" in str(e):
            raise _access_error(repo_id) from e
        raise
