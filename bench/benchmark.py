"""The synchronized benchmark: run every case, keep every sample, pair the implementations.

A case that raises or returns non-finite values is recorded with ``status: "failed"`` and its
error, and the run goes on. Case records follow benchmark.schema.json ``$defs/case``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from bench import evidence, roofline, stats
from bench.cases import Case, Pair, Profile, build_cases
from bench.timing import Clock, Timing, block_until_ready, peak_memory_bytes, time_jitted

MAX_ERROR_CHARS = 2000


@dataclass
class BenchmarkResult:
    """Case and pair records, the evidence files they name, and notes for the environment."""

    cases: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    files: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def interpret(self) -> bool:
        return any(c["interpret"] for c in self.cases)

    @property
    def devices_used(self) -> int:
        return max(c["devices_used"] for c in self.cases)


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ...[truncated]"


def _non_finite(output: Any) -> str | None:
    bad = total = 0
    for leaf in jax.tree_util.tree_leaves(output):
        values = np.asarray(jax.device_get(leaf), dtype=np.float32)
        bad += int(values.size - np.isfinite(values).sum())
        total += values.size
    return f"non-finite output: {bad} of {total} values" if bad else None


def _devices_of(compiled_shardings: Any) -> int:
    devices = set()
    for sharding in jax.tree_util.tree_leaves(compiled_shardings,
                                              is_leaf=lambda s: hasattr(s, "device_set")):
        if hasattr(sharding, "device_set"):
            devices |= set(sharding.device_set)
    return max(1, len(devices))


def run_case(case: Case, *, warmups: int, samples: int, device_kind: str,
             clock: Clock = time.perf_counter,
             sync: Callable[[Any], Any] = block_until_ready) -> tuple[dict[str, Any], dict[str, bytes], list[str]]:
    """Measure one case. Returns its record, its evidence files and any notes; never raises
    for a failure of the case itself (the record says ``failed``)."""
    record: dict[str, Any] = {
        "case_id": case.case_id, "scope": case.scope, "implementation": case.implementation,
        "seq_len": case.seq_len, "shape": dict(case.shape), "dtype": case.dtype,
        "causal": case.causal, "padded": case.padded, "devices_used": case.mesh_devices or 1,
        "status": "ok", "error": None, "interpret": case.interpret,
        "transfer_ms": None, "lower_ms": None, "compile_ms": None, "samples_ms": [],
        **stats.summarize([]), "peak_memory_bytes": None,
        "flops": case.flops, "bytes_moved": case.bytes_moved,
        **roofline.rates(None, None, None, device_kind, 1),
        "stablehlo": None, "stablehlo_tpu": None,
    }
    files, notes = {}, []
    timing = Timing()
    try:
        time_jitted(case.fn, case.abstract_args, case.make_inputs(), warmups=warmups, samples=samples,
                    clock=clock, sync=sync, timing=timing)
    except Exception as error:  # noqa: BLE001 - any failure of the case is recorded, the run goes on
        record["status"], record["error"] = "failed", _error_text(error)
        timing.samples_ms = []
    record.update(transfer_ms=timing.transfer_ms, lower_ms=timing.lower_ms, compile_ms=timing.compile_ms,
                  samples_ms=list(timing.samples_ms))
    if timing.lowered is not None:
        rel = evidence.stablehlo_path(case.case_id)
        files[rel] = evidence.gzip_text(evidence.lowered_text(timing.lowered))
        record["stablehlo"] = rel
    if timing.compiled is not None:
        record["devices_used"] = _devices_of(timing.compiled.input_shardings)
    if record["status"] == "ok":
        problem = _non_finite(timing.output)
        if problem:
            record["status"], record["error"] = "failed", problem
    timing.output = timing.compiled = None
    gc.collect()
    if record["samples_ms"]:
        record.update(stats.summarize(record["samples_ms"]))
        record.update(roofline.rates(case.flops, case.bytes_moved, record["median_ms"], device_kind,
                                     record["devices_used"]))
    record["peak_memory_bytes"] = peak_memory_bytes(jax.devices()[:record["devices_used"]])
    if case.tpu_fn is not None:
        try:
            rel = evidence.stablehlo_path(case.case_id, ".tpu")
            files[rel] = evidence.gzip_text(evidence.tpu_export_text(case.tpu_fn, case.abstract_args))
            record["stablehlo_tpu"] = rel
        except Exception as error:  # noqa: BLE001
            notes.append(f"TPU export of {case.case_id} failed ({_error_text(error)[:300]}).")
    return record, files, notes


def pair_record(pair: Pair, by_id: dict[str, dict[str, Any]], seed: int) -> dict[str, Any]:
    """The ratio of medians of ``pair`` with its bootstrap 95% CI (nulls where a side failed)."""
    num, den = by_id[pair.numerator], by_id[pair.denominator]
    ok = num["status"] == "ok" and den["status"] == "ok"
    ratio, low, high = (stats.ratio_of_medians(num["samples_ms"], den["samples_ms"], seed=seed,
                                               key=f"{pair.numerator}/{pair.denominator}")
                        if ok else (None, None, None))
    record = {"scope": pair.scope, "seq_len": pair.seq_len, "numerator": pair.numerator,
              "denominator": pair.denominator, "ratio": ratio, "ci_low": low, "ci_high": high}
    if pair.devices is not None:
        record["devices"] = num["devices_used"]
        record["scaling_efficiency"] = (stats.scaling_efficiency(den["median_ms"], num["median_ms"],
                                                                 num["devices_used"]) if ok else None)
    return record


def run_benchmark(profile: Profile, scopes: Sequence[str], *, warmups: int, samples: int,
                  seed: int = 0, progress: bool = True) -> BenchmarkResult:
    """Build, run and pair every case of ``profile`` over ``scopes`` on the default backend."""
    cases, pairs = build_cases(profile, scopes, seed=seed)
    device_kind = jax.devices()[0].device_kind
    result = BenchmarkResult(cases=[], pairs=[])
    bar = tqdm(cases, desc="benchmark", unit="case", disable=not progress)
    for case in bar:
        bar.set_postfix_str(case.case_id)
        record, files, notes = run_case(case, warmups=warmups, samples=samples, device_kind=device_kind)
        result.cases.append(record)
        result.files.update(files)
        result.notes += notes
    by_id = {c["case_id"]: c for c in result.cases}
    result.pairs = [pair_record(p, by_id, seed) for p in pairs]
    return result
