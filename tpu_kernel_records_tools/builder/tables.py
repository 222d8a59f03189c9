"""An accepted run as one Arrow table per config, with the schemas declared in ``records.schema``.

Row layouts:

* benchmark: one row per case, with the verdict of the scorecard of the implementation it timed
  (``graded_verdict``, ``builder.verdicts``); a ``masks-*`` case's mask in ``model``, ``window``, ``softcap``,
  ``segments``, ``sinks``, a ``paged-decode`` case's cache in ``page_size``, ``pages``, ``pool_pages``, a
  ``ragged`` case's those and its step in ``num_seqs``, ``q_rows``, ``kv_dtype``, ``quantized_kv``
  (null elsewhere, and for runs from before them); ``compiled_tpu`` (a struct, null where the case has no compiled TPU
  program or it could not be compiled: ``compiled_tpu_reason``) holds the TPU compiler's facts,
  predicted by the compiler, not measured. ``pairs`` lists every pair with this case as numerator (baseline,
  ratio of medians, CI, devices and scaling efficiency for the sharded scope); the flat
  ``baseline_case_id``/``ratio_to_baseline``/``ratio_ci_*``/``scaling_efficiency`` repeat the primary
  one: the pair against the XLA case where there is one, else the first in the raw run.
* correctness: ``row_kind="check"``: one row per candidate x check (a candidate that could not be
  graded gets one row with ``check=null``); ``row_kind="power"``: one row per candidate of the
  grader-power summary (``contract``, ``trials``, ``rejected``, ``rejected_by``, ``expected``, ``intended_checks``,
  ``rejected_by_intended``; its other fields in the struct ``power_detail``), the summary's settings
  and totals in the struct ``power_settings``. Keys without a field of their own go to ``other`` as
  ``{name, json}`` (canonical JSON), so nothing of the summary is lost.
* environment: ``created_utc`` a UTC timestamp (null where the source states no time).
* environment: one row per record, bootstrap attempts as a list of structs.

Every row carries ``record_id``, ``source``, ``platform`` and ``interpret``.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..records.rawio import utc_time
from ..records.schema import CONFIG_NAMES, FEATURES

from .rules import Accepted
from .verdicts import graded_verdict

ROW_GROUP_SIZE = 64
POWER_COLUMNS = ("candidate", "kind", "contract", "trials", "rejected", "rejected_by", "expected", "intended_checks",
                 "rejected_by_intended")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _other(mapping: dict[str, Any], known: set[str]) -> list[dict[str, str]]:
    return [{"name": k, "json": _json(mapping[k])} for k in sorted(mapping) if k not in known]


def power_settings(power: dict[str, Any]) -> dict[str, Any]:
    """The ``power_settings`` struct of a grader-power summary (see ``records.schema.POWER_SETTINGS``)."""
    policy = power.get("policy") or {}
    k, floor = policy.get("k") or {}, policy.get("floor") or {}
    counts = ("seeds", "first_seed", "false_rejects", "correct_trials", "missed_bad", "bad_trials")
    return {**{key: power.get(key) for key in counts},
            "shapes": power.get("shapes"), "dtypes": power.get("dtypes"), "checks": power.get("checks"),
            "policy": {"k_forward": k.get("forward"), "k_gradient": k.get("gradient"), "floor": floor.get("value"),
                       "floor_float32_eps_multiple": floor.get("float32_eps_multiple"), "rule": policy.get("rule")},
            "other": _other(power, {*counts, "shapes", "dtypes", "checks", "policy", "candidates"})}


def power_detail(entry: dict[str, Any]) -> dict[str, Any]:
    """The ``power_detail`` struct of one candidate of a grader-power summary."""
    calibration = entry.get("calibration") or {}
    own = ("seconds_per_trial", "load_error", "min_k_to_pass_tolerances")
    return {**{key: entry.get(key) for key in own},
            "calibration": [{"key": key, **{f: calibration[key].get(f)
                                            for f in ("max_ratio", "needed_k", "needed_floor_eps")}}
                            for key in sorted(calibration)],
            "other": _other(entry, {*POWER_COLUMNS, *own, "calibration"})}


def _common(acc: Accepted) -> dict[str, Any]:
    env = acc.run["environment"]
    return {"record_id": acc.record_id, "source": env["source"], "platform": env["platform"],
            "interpret": acc.interpret}


def _compiled_tpu(facts: dict[str, Any] | None, raw: str) -> dict[str, Any] | None:
    """The ``compiled_tpu`` struct (predicted by the compiler, not measured), its HLO path under data/."""
    return None if facts is None else {**facts, "hlo": raw + facts["hlo"]}


def mask_columns(case: dict[str, Any]) -> dict[str, Any]:
    """A case's mask and paged-cache columns: ``model``, ``window`` (``[left, right]`` as the struct
    ``left`` / ``right``), ``softcap``, ``segments``, ``sinks``, ``page_size``, ``pages``, ``pool_pages`` and
    a ragged step's ``num_seqs``, ``q_rows``, ``kv_dtype``, ``quantized_kv``; null where the case (or a run from
    before masks, paged caches or ragged steps) has none."""
    window = case.get("window")
    return {"model": case.get("model"),
            "window": None if window is None else {"left": window[0], "right": window[1]},
            "softcap": case.get("softcap"), "segments": case.get("segments"), "sinks": case.get("sinks"),
            "page_size": case.get("page_size"), "pages": case.get("pages"), "pool_pages": case.get("pool_pages"),
            "num_seqs": case.get("num_seqs"), "q_rows": case.get("q_rows"), "kv_dtype": case.get("kv_dtype"),
            "quantized_kv": case.get("quantized_kv")}


def benchmark_rows(acc: Accepted) -> list[dict[str, Any]]:
    env, bench = acc.run["environment"], acc.run["benchmark"]
    impl = {case["case_id"]: case["implementation"] for case in bench["cases"]}
    rows = []
    for case in bench["cases"]:
        pairs = [p for p in bench["pairs"] if p["numerator"] == case["case_id"]]
        pair = next((p for p in pairs if impl[p["denominator"]] == "xla"), pairs[0] if pairs else {})
        raw = f"data/raw/{acc.record_id}/"
        rows.append({
            **_common(acc), "device_kind": env["device_kind"], "device_count": env["device_count"],
            "profile": bench["profile"],
            **{k: case[k] for k in ("case_id", "scope", "implementation")},
            "graded_verdict": graded_verdict(acc.run, case["implementation"]), "seq_len": case["seq_len"],
            **case["shape"],
            **{k: case[k] for k in ("dtype", "causal", "padded")}, **mask_columns(case),
            **{k: case[k] for k in ("devices_used", "status", "error")},
            "warmups": bench["warmups"], "samples_per_case": bench["samples_per_case"],
            "num_samples": len(case["samples_ms"]), "samples_ms": case["samples_ms"],
            **{k: case[k] for k in ("transfer_ms", "lower_ms", "compile_ms", "median_ms", "min_ms", "max_ms",
                                    "q1_ms", "q3_ms", "iqr_ms", "peak_memory_bytes", "flops", "bytes_moved",
                                    "tflops", "gbps", "peak_flops_fraction", "peak_bandwidth_fraction")},
            "baseline_case_id": pair.get("denominator"), "ratio_to_baseline": pair.get("ratio"),
            "ratio_ci_low": pair.get("ci_low"), "ratio_ci_high": pair.get("ci_high"),
            "scaling_efficiency": pair.get("scaling_efficiency"),
            "pairs": [{"baseline_case_id": p["denominator"], "ratio": p["ratio"], "ci_low": p["ci_low"],
                       "ci_high": p["ci_high"], "devices": p.get("devices"),
                       "scaling_efficiency": p.get("scaling_efficiency")} for p in pairs],
            "stablehlo": raw + case["stablehlo"] if case["stablehlo"] else None,
            "stablehlo_tpu": raw + case["stablehlo_tpu"] if case["stablehlo_tpu"] else None,
            "compiled_tpu": _compiled_tpu(case.get("compiled_tpu"), raw),
            "compiled_tpu_reason": case.get("compiled_tpu_reason"),
            "program_sha256": case.get("program_sha256"), "roofline_floor_ms": case.get("roofline_floor_ms"),
            "output_checks": None if case.get("output_checks") is None else [
                {k: check[k] for k in ("sample", "passed", "detail")} for check in case["output_checks"]],
        })
    return rows


def correctness_rows(acc: Accepted) -> list[dict[str, Any]]:
    doc = acc.run["correctness"]
    base = {**_common(acc), "seed": doc["seed"]}
    empty_check = dict.fromkeys(("check", "passed", "points", "max_points", "detail", "error", "tolerance",
                                 "baseline_error"))
    empty_power = dict.fromkeys(("trials", "rejected", "rejected_by", "expected", "intended_checks",
                                 "rejected_by_intended", "power_detail", "power_settings"))
    rows = []
    for card in doc["scorecards"]:
        candidate = {"row_kind": "check", "candidate": card["candidate"], "kind": card["kind"],
                     "measured": card["candidate"] == doc["measured_candidate"], "candidate_passed": card["passed"],
                     "score": card["score"], "max_score": card["max_score"], "candidate_error": card.get("error"),
                     # where its worker ran (sandbox.isolation); null in runs graded before it was recorded
                     "isolation": card.get("isolation"), "memory_limit": card.get("memory_limit"),
                     # declared features graded on top of the base contract ([]: base only); null in runs
                     # graded before features existed
                     "features": card.get("features"), "programs": card.get("programs"),
                     # the contract graded (grading.candidates.CONTRACTS); a scorecard naming none: attention
                     "contract": card.get("contract") or "attention"}
        checks = [{"check": c["name"], "passed": c["passed"], "points": c["points"], "max_points": c["max_points"],
                   "detail": c["detail"], "error": c.get("error"), "tolerance": c.get("tolerance"),
                   "baseline_error": c.get("baseline_error")} for c in card["checks"]]
        rows += [{**base, **candidate, **check, **empty_power} for check in checks or [empty_check]]
    power = doc["power"]
    if power is not None:
        settings = power_settings(power)
        for entry in power["candidates"]:
            by = entry.get("rejected_by") or {}
            rows.append({
                **base, **empty_check, "row_kind": "power", "candidate": entry["candidate"],
                "kind": entry.get("kind"), "measured": entry["candidate"] == doc["measured_candidate"],
                "candidate_passed": None, "score": None, "max_score": None, "candidate_error": None,
                "isolation": None, "memory_limit": None, "features": None, "programs": None,
                "contract": entry.get("contract", "attention"),  # sweeps before paged ones graded dense only
                "trials": entry.get("trials"), "rejected": entry.get("rejected"),
                "rejected_by": [{"check": name, "count": by[name]} for name in sorted(by)],
                "expected": entry.get("expected"), "intended_checks": entry.get("intended_checks"),
                "rejected_by_intended": entry.get("rejected_by_intended"),
                "power_detail": power_detail(entry), "power_settings": settings,
            })
    return rows


def environment_rows(acc: Accepted) -> list[dict[str, Any]]:
    env, bench, doc = acc.run["environment"], acc.run["benchmark"], acc.run["correctness"]
    versions = env["versions"]
    main = ("jax", "jaxlib", "libtpu", "gpu_plugin", "python", "numpy", "os")
    measured = [c for card in doc["scorecards"] if card["candidate"] == doc["measured_candidate"]
                for c in card["checks"]]
    return [{
        **_common(acc), "created_utc": utc_time(env["created_utc"]),
        **{k: env[k] for k in ("profile", "device_kind", "device_count")},
        "expected_device_count": acc.expected_device_count,
        **{k: env[k] for k in ("devices_used", "process_count")},
        **{k: versions[k] for k in main},
        "other_versions": [{"name": k, "version": versions[k]} for k in sorted(versions) if k not in main],
        **{k: env[k] for k in ("cpu_model", "git_commit", "kernel_src_sha256")},
        "env_vars": [{"name": k, "value": env["env_vars"][k]} for k in sorted(env["env_vars"])],
        "bootstrap": env["bootstrap"], "notes": env["notes"],
        "measured_candidate": doc["measured_candidate"], "checks": len(measured),
        "checks_passed": sum(c["passed"] for c in measured),
        "submission_spec": (doc.get("submission") or {}).get("spec"),
        "submission_file_sha256": (doc.get("submission") or {}).get("file_sha256"),
        "cases": len(bench["cases"]), "cases_ok": sum(c["status"] == "ok" for c in bench["cases"]),
        "warmups": bench["warmups"], "samples_per_case": bench["samples_per_case"],
        "raw_files": [{"path": path, "sha256": digest}
                      for path, digest in sorted(acc.run["manifest"]["files"].items())],
    }]


ROWS = {"benchmark": benchmark_rows, "correctness": correctness_rows, "environment": environment_rows}


def record_tables(acc: Accepted) -> dict[str, pa.Table]:
    """The record's table for each config, with that config's declared Arrow schema."""
    return {name: pa.Table.from_pylist(ROWS[name](acc), schema=FEATURES[name])
            for name in CONFIG_NAMES}


def write_parquet(table: pa.Table, path: str) -> None:
    """Deterministic parquet: fixed row groups, compression and statistics, standard nested lists."""
    pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE, compression="zstd", compression_level=3,
                   use_dictionary=True, write_statistics=True)
