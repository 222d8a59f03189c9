"""What a release is, declared once: its version, configs, checksum file and Arrow schemas.

Imports only ``pyarrow``: the builder writes every parquet file with these schemas, and the loading
script (``tpu_kernel_records.py``, which travels alone to the Hub) reads the same schemas back from
the parquet files themselves, so nothing here is declared a second time.

* ``VERSION``: the release version ``X.Y.Z``; the package version (pyproject reads it), the loading
  script's ``VERSION`` (a test keeps them equal), the Hub tag ``vX.Y.Z`` and the card's examples.
* ``CONFIG_NAMES``: the three configs; each is ``data/<config>/<record_id>.parquet``.
* ``CHECKSUMS``: ``data/SHA256SUMS`` (sha256sum format); it also lists each config's files for the
  loading script.
* ``FEATURES``: config -> ``pyarrow.Schema``. Times are UTC timestamps (microseconds), lists are
  standard parquet lists (``list<element>``), the grader-power columns are structs, and so is a
  benchmark case's ``compiled_tpu`` (the TPU compiler's facts: predicted, not measured). A submitted
  kernel's record (source ``submitted``) fills ``program_sha256``, ``roofline_floor_ms`` and
  ``output_checks`` (benchmark), ``programs`` (correctness: the sha256 of every program graded) and
  ``submission_spec`` / ``submission_file_sha256`` (environment); other records leave them null.
  A ``masks-*`` case fills ``model``, ``window`` (a struct ``left`` / ``right``), ``softcap``,
  ``segments`` and ``sinks`` where its mask has them; every other row, and every record from before
  they existed, leaves them null. A ``paged-decode`` case fills ``page_size``, ``pages`` and
  ``pool_pages`` (and ``model``, ``window``); a ``ragged`` case those (``model``, the cache) and
  ``num_seqs``, ``q_rows``, ``kv_dtype``, ``quantized_kv``; others leave them null. A correctness check row's
  ``contract`` is ``attention`` or ``paged`` (a scorecard naming none was graded on ``attention``);
  a power row's is the contract its candidate was swept on.
"""

from __future__ import annotations

import pyarrow as pa

VERSION = "1.0.0"
TAG = f"v{VERSION}"
CONFIG_NAMES = ("benchmark", "correctness", "environment")
DEFAULT_CONFIG = "benchmark"
CHECKSUMS = "SHA256SUMS"
LICENSE = "cc-by-nc-4.0"

_str, _int, _float, _bool = pa.string(), pa.int64(), pa.float64(), pa.bool_()
UTC_TIME = pa.timestamp("us", tz="UTC")


def _struct(**fields: pa.DataType) -> pa.StructType:
    return pa.struct([pa.field(name, kind) for name, kind in fields.items()])


def _list(kind: pa.DataType) -> pa.ListType:
    return pa.list_(pa.field("element", kind))


def _schema(**fields: pa.DataType) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in fields.items()])


_RECORD = dict(record_id=_str, source=_str, platform=_str, interpret=_bool)
_SHAPE = dict(batch=_int, q_len=_int, kv_len=_int, num_q_heads=_int, num_kv_heads=_int, head_dim=_int)
# Keys of a grader-power summary (or of one candidate's entry) that have no column of their own.
OTHER = _list(_struct(name=_str, json=_str))

POWER_DETAIL = _struct(
    seconds_per_trial=_float, load_error=_str, min_k_to_pass_tolerances=_float,
    calibration=_list(_struct(key=_str, max_ratio=_float, needed_k=_float, needed_floor_eps=_float)),
    other=OTHER)
# A benchmark case's compiled TPU program (``compiled_tpu``): predicted by the compiler, not measured.
COMPILED_TPU = _struct(
    source=_str, device_kind=_str, jax=_str, libtpu=_str, flops=_float, bytes_accessed=_float,
    argument_bytes=_int, output_bytes=_int, temp_bytes=_int, generated_code_bytes=_int,
    vmem_bytes=_int, outside_bytes=_int, outside_ops=_list(_str),
    kernels=_list(_struct(name=_str, vmem_bytes=_int, result_bytes=_int, declared_flops=_int,
                          declared_bytes=_int)),
    hlo=_str)
# A masked case's window_size (left, right); a null side is unbounded.
WINDOW = _struct(left=_int, right=_int)
# A submitted kernel's timed call whose output was checked against the truth after timing.
OUTPUT_CHECK = _struct(sample=_int, passed=_bool, detail=_str)
POWER_SETTINGS = _struct(
    seeds=_int, first_seed=_int, shapes=_list(_struct(name=_str, **_SHAPE)), dtypes=_list(_str),
    checks=_list(_str),
    policy=_struct(k_forward=_float, k_gradient=_float, floor=_float, floor_float32_eps_multiple=_float,
                   rule=_str),
    false_rejects=_int, correct_trials=_int, missed_bad=_int, bad_trials=_int, other=OTHER)

FEATURES: dict[str, pa.Schema] = {
    "benchmark": _schema(
        **_RECORD, device_kind=_str, device_count=_int, profile=_str,
        case_id=_str, scope=_str, implementation=_str, graded_verdict=_str, seq_len=_int, **_SHAPE,
        dtype=_str, causal=_bool, padded=_bool, model=_str, window=WINDOW, softcap=_float, segments=_int,
        sinks=_bool, page_size=_int, pages=_int, pool_pages=_int, num_seqs=_int, q_rows=_int, kv_dtype=_str,
        quantized_kv=_bool, devices_used=_int,
        status=_str, error=_str, warmups=_int, samples_per_case=_int, num_samples=_int,
        samples_ms=_list(_float),
        transfer_ms=_float, lower_ms=_float, compile_ms=_float,
        median_ms=_float, min_ms=_float, max_ms=_float, q1_ms=_float, q3_ms=_float, iqr_ms=_float,
        peak_memory_bytes=_int, flops=_float, bytes_moved=_float, tflops=_float, gbps=_float,
        peak_flops_fraction=_float, peak_bandwidth_fraction=_float,
        baseline_case_id=_str, ratio_to_baseline=_float, ratio_ci_low=_float, ratio_ci_high=_float,
        scaling_efficiency=_float,
        pairs=_list(_struct(baseline_case_id=_str, ratio=_float, ci_low=_float, ci_high=_float, devices=_int,
                            scaling_efficiency=_float)),
        stablehlo=_str, stablehlo_tpu=_str, compiled_tpu=COMPILED_TPU, compiled_tpu_reason=_str,
        program_sha256=_str, roofline_floor_ms=_float, output_checks=_list(OUTPUT_CHECK)),
    "correctness": _schema(
        **_RECORD, seed=_int, row_kind=_str,
        candidate=_str, kind=_str, measured=_bool, candidate_passed=_bool, score=_float,
        max_score=_float, candidate_error=_str, isolation=_str, memory_limit=_str, features=_list(_str),
        programs=_list(_str), contract=_str,
        check=_str, passed=_bool, points=_float, max_points=_float, detail=_str,
        error=_float, tolerance=_float, baseline_error=_float,
        trials=_int, rejected=_int, rejected_by=_list(_struct(check=_str, count=_int)),
        expected=_str, intended_checks=_list(_str), rejected_by_intended=_int,
        power_detail=POWER_DETAIL, power_settings=POWER_SETTINGS),
    "environment": _schema(
        **_RECORD, created_utc=UTC_TIME, profile=_str, device_kind=_str, device_count=_int,
        expected_device_count=_int, devices_used=_int, process_count=_int,
        jax=_str, jaxlib=_str, libtpu=_str, gpu_plugin=_str, python=_str, numpy=_str,
        os=_str, other_versions=_list(_struct(name=_str, version=_str)),
        cpu_model=_str, git_commit=_str, kernel_src_sha256=_str,
        env_vars=_list(_struct(name=_str, value=_str)),
        bootstrap=_list(_struct(jax=_str, jaxlib=_str, libtpu=_str, outcome=_str, error=_str)),
        notes=_str, measured_candidate=_str, checks=_int, checks_passed=_int,
        submission_spec=_str, submission_file_sha256=_str,
        cases=_int, cases_ok=_int, warmups=_int, samples_per_case=_int,
        raw_files=_list(_struct(path=_str, sha256=_str))),
}
