"""tpu-kernel-records: attention kernels measured on real hardware (loading script).

Three configs, each one parquet file per record under ``data/<config>/``:

* ``benchmark`` (default): one row per benchmark case, every timing sample as a list.
* ``correctness``: one row per candidate x check of the correctness rubric, and one row per
  candidate of the grader-power summary where a record carries one.
* ``environment``: one row per record: machine, versions, bootstrap history.

The schemas are declared once, here (``FEATURES``); the builder writes its parquet with them.
This file travels with the release, so it needs only the standard library, ``datasets`` and
``pyarrow`` (``huggingface_hub``, a dependency of ``datasets``, only for the Hub route of ``load``).

``datasets`` >= 4 no longer runs loading scripts through ``load_dataset``; use the builder directly::

    from tpu_kernel_records import TpuKernelRecords, load
    builder = TpuKernelRecords(config_name="benchmark")      # data/ next to this file
    builder.download_and_prepare()
    table = builder.as_dataset(split="train")
    table = load("correctness")                                # the same, in one call
    table = load("benchmark", repo_id="OWNER/tpu-kernel-records", revision="v1.0.0")  # from the Hub
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

CONFIG_NAMES = ("benchmark", "correctness", "environment")
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

_str, _int, _float, _bool = (datasets.Value(t) for t in ("string", "int64", "float64", "bool"))
_RECORD = {"record_id": _str, "source": _str, "platform": _str, "interpret": _bool}

FEATURES: dict[str, datasets.Features] = {
    "benchmark": datasets.Features({
        **_RECORD, "device_kind": _str, "device_count": _int, "profile": _str,
        "case_id": _str, "scope": _str, "implementation": _str, "seq_len": _int,
        "batch": _int, "q_len": _int, "kv_len": _int, "num_q_heads": _int, "num_kv_heads": _int,
        "head_dim": _int, "dtype": _str, "causal": _bool, "padded": _bool, "devices_used": _int,
        "status": _str, "error": _str, "warmups": _int, "samples_per_case": _int, "num_samples": _int,
        "samples_ms": [_float],
        "transfer_ms": _float, "lower_ms": _float, "compile_ms": _float,
        "median_ms": _float, "min_ms": _float, "max_ms": _float, "q1_ms": _float, "q3_ms": _float,
        "iqr_ms": _float,
        "peak_memory_bytes": _int, "flops": _float, "bytes_moved": _float, "tflops": _float, "gbps": _float,
        "peak_flops_fraction": _float, "peak_bandwidth_fraction": _float,
        "baseline_case_id": _str, "ratio_to_baseline": _float, "ratio_ci_low": _float, "ratio_ci_high": _float,
        "scaling_efficiency": _float,
        "pairs": [{"baseline_case_id": _str, "ratio": _float, "ci_low": _float, "ci_high": _float, "devices": _int,
                   "scaling_efficiency": _float}],
        "stablehlo": _str, "stablehlo_tpu": _str,
    }),
    "correctness": datasets.Features({
        **_RECORD, "seed": _int, "row_kind": _str,
        "candidate": _str, "kind": _str, "measured": _bool, "candidate_passed": _bool, "score": _float,
        "max_score": _float, "candidate_error": _str,
        "check": _str, "passed": _bool, "points": _float, "max_points": _float, "detail": _str,
        "error": _float, "tolerance": _float, "baseline_error": _float,
        "trials": _int, "rejected": _int, "rejected_by": [{"check": _str, "count": _int}],
        "expected": _str, "intended_checks": [_str], "rejected_by_intended": _int, "power_detail": _str,
        "power_settings": _str,
    }),
    "environment": datasets.Features({
        **_RECORD, "created_utc": _str, "profile": _str, "device_kind": _str, "device_count": _int,
        "expected_device_count": _int, "devices_used": _int, "process_count": _int,
        "jax": _str, "jaxlib": _str, "libtpu": _str, "gpu_plugin": _str, "python": _str, "numpy": _str,
        "os": _str, "other_versions": [{"name": _str, "version": _str}],
        "cpu_model": _str, "git_commit": _str, "kernel_src_sha256": _str,
        "env_vars": [{"name": _str, "value": _str}],
        "bootstrap": [{"jax": _str, "jaxlib": _str, "libtpu": _str, "outcome": _str, "error": _str}],
        "notes": _str, "measured_candidate": _str, "checks": _int, "checks_passed": _int,
        "cases": _int, "cases_ok": _int, "warmups": _int, "samples_per_case": _int,
        "raw_files": [{"path": _str, "sha256": _str}],
    }),
}

CHECKSUMS = "SHA256SUMS"
VERSION = datasets.Version("1.0.0")


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding ``<config>/*.parquet``: ``data_dir`` itself, its ``data/``, or ``data/`` beside this file."""
    root = Path(data_dir) if data_dir is not None else Path(__file__).resolve().parent
    if not (root / DEFAULT_CONFIG).is_dir() and (root / "data").is_dir():
        root = root / "data"
    return root


def data_fingerprint(data_dir: Path) -> str:
    """A short hash of the data: of ``SHA256SUMS`` when present, else of every parquet file's bytes.

    It keys the ``datasets`` cache, so a prepared dataset is never served after the data changed.
    """
    digest = hashlib.sha256()
    sums = data_dir / CHECKSUMS
    if sums.is_file():
        digest.update(sums.read_bytes())
    else:
        for path in sorted(data_dir.glob("*/*.parquet")):
            digest.update(path.relative_to(data_dir).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class TpuKernelRecordsConfig(datasets.BuilderConfig):
    """One of ``CONFIG_NAMES``."""


class TpuKernelRecords(datasets.ArrowBasedBuilder):
    """Reads ``data/<config>/*.parquet`` from a local checkout or a downloaded Hub snapshot."""

    VERSION = VERSION
    BUILDER_CONFIG_CLASS = TpuKernelRecordsConfig
    BUILDER_CONFIGS = [TpuKernelRecordsConfig(name=name, version=VERSION, description=f"The {name} table.")
                       for name in CONFIG_NAMES]
    DEFAULT_CONFIG_NAME = DEFAULT_CONFIG

    def __init__(self, *args: Any, data_dir: str | Path | None = None, hash: str | None = None, **kwargs: Any):
        root = resolve_data_dir(data_dir)
        super().__init__(*args, data_dir=str(root), hash=hash or data_fingerprint(root), **kwargs)

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(description=DESCRIPTION, citation=CITATION, homepage=HOMEPAGE,
                                    license=LICENSE, features=FEATURES[self.config.name])

    def _split_generators(self, dl_manager: Any) -> list[datasets.SplitGenerator]:
        files = sorted(Path(self.config.data_dir, self.config.name).glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"no parquet files under {Path(self.config.data_dir, self.config.name)}")
        return [datasets.SplitGenerator(name=datasets.Split.TRAIN, gen_kwargs={"files": files})]

    def _generate_tables(self, files: list[Path]) -> Iterator[tuple[Any, pa.Table]]:
        schema = FEATURES[self.config.name].arrow_schema
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
