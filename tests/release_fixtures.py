"""Synthetic, schema-valid run folders for tests. SYNTHETIC TEST DATA: never a measurement.

Every number here is made up by a formula so the builder can be exercised without hardware; the
runs say so in their notes (and jax version ``0.0.0-synthetic``), and must never be built into the
repository's data/. Their cases are the ``tiny`` profile's, with every derived number computed from
the made-up samples as the benchmark computes it, so only a deliberate edit makes the builder object.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

from tpu_kernel_records_tools.bench import roofline, stats
from tpu_kernel_records_tools.bench.cases import build_cases, get_profile
from tpu_kernel_records_tools.builder.verdicts import features_by_candidate, graded_candidate
from tpu_kernel_records_tools.records import rawio
from kernel_src.registry import by_grading_name

SYNTHETIC = "SYNTHETIC TEST DATA: made up by tests/release_fixtures.py, not a measurement."


PROFILE = "tiny"  # a real profile: the builder checks the run against it
SCOPES = ("softmax", "attention")
SEED = 0


def _times(case_id: str, samples: int) -> list[float]:
    scale = 1.5 if "pallas" in case_id else 1.0
    return [round(scale * (1 + 0.01 * i) + 0.001 * len(case_id), 6) for i in range(samples)]


def cases_and_pairs(platform: str, device_kind: str, samples: int, interpret: bool, scopes=SCOPES
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The profile's cases with made-up samples, every derived number computed as the benchmark does."""
    expected, pairs = build_cases(get_profile(PROFILE), scopes, platform=platform)
    cases = []
    for c in expected:
        times = _times(c.case_id, samples)
        summary = stats.summarize(times)
        cases.append({
            "case_id": c.case_id, "scope": c.scope, "implementation": c.implementation, "seq_len": c.seq_len,
            "shape": dict(c.shape), "dtype": c.dtype, "causal": c.causal, "padded": c.padded, "devices_used": 1,
            "status": "ok", "error": None, "interpret": c.interpret and interpret, "transfer_ms": 0.01,
            "lower_ms": 1.0, "compile_ms": 2.0, "samples_ms": times, **summary, "peak_memory_bytes": 1024,
            "flops": c.flops, "bytes_moved": c.bytes_moved,
            **roofline.rates(c.flops, c.bytes_moved, summary["median_ms"], device_kind, 1),
            "stablehlo": None, "stablehlo_tpu": None})
    by_id = {c["case_id"]: c for c in cases}
    records = []
    for p in pairs:
        ratio, low, high = stats.ratio_of_medians(by_id[p.numerator]["samples_ms"], by_id[p.denominator]["samples_ms"],
                                                  seed=SEED, key=f"{p.numerator}/{p.denominator}")
        records.append({"scope": p.scope, "seq_len": p.seq_len, "numerator": p.numerator,
                        "denominator": p.denominator, "ratio": ratio, "ci_low": low, "ci_high": high})
    return cases, records


def timed_kernels(cases: list[dict[str, Any]], correctness: dict[str, Any]) -> list[str]:
    """The candidates of the kernels ``cases`` time that ``correctness`` has no scorecard of yet."""
    graded = {card["candidate"] for card in correctness["scorecards"]}
    names = [graded_candidate(case["implementation"], correctness) for case in cases]
    return list(dict.fromkeys(name for name, required in names if required and name not in graded))


def documents(run_id: str = "synthetic-cpu", *, platform: str = "cpu", interpret: bool = True,
              device_kind: str = "cpu", device_count: int = 1, env_vars: dict[str, str] | None = None,
              samples: int = 3, power: bool = True, scopes: tuple[str, ...] = SCOPES) -> dict[str, Any]:
    """The three documents of a synthetic run (see the module docstring)."""
    common = {"format_version": 1, "run_id": run_id, "source": "measured"}
    cases, pairs = cases_and_pairs(platform, device_kind, samples, interpret, scopes)
    environment = {
        **common, "created_utc": "2026-01-01T00:00:00Z", "profile": PROFILE, "platform": platform,
        "device_kind": device_kind, "device_count": device_count, "devices_used": 1, "process_count": 1,
        "interpret": interpret,
        "versions": {"jax": "0.0.0-synthetic", "jaxlib": "0.0.0-synthetic", "libtpu": None, "gpu_plugin": None,
                     "python": None, "numpy": None, "os": None},
        "cpu_model": None, "git_commit": None, "kernel_src_sha256": None, "env_vars": env_vars or {},
        "bootstrap": [{"jax": "0.0.0-synthetic", "jaxlib": None, "libtpu": None, "outcome": "used", "error": None}],
        "notes": SYNTHETIC,
    }
    benchmark = {**common, "profile": PROFILE, "platform": platform, "interpret": interpret,
                 "warmups": 1, "samples_per_case": samples, "cases": cases, "pairs": pairs}

    def card(candidate: str, kind: str, passed: bool) -> dict[str, Any]:
        checks = [{"name": name, "passed": ok, "points": float(ok), "max_points": 1,
                   "detail": SYNTHETIC, "error": 1e-3, "tolerance": 1e-2, "baseline_error": 5e-4}
                  for name in ("causal-mask", "padding-mask", "all-masked-row")
                  for ok in [passed or name != "causal-mask"]]
        score = sum(c["passed"] for c in checks)
        return {"candidate": candidate, "kind": kind, "passed": passed, "score": score, "max_score": 3,
                "error": None, "checks": checks}

    power_doc = {"seeds": 2, "first_seed": 0,
                 "shapes": [{"name": "A", "batch": 1, "q_len": 8, "kv_len": 8, "num_q_heads": 4,
                             "num_kv_heads": 2, "head_dim": 8}],
                 "policy": {"k": {"forward": 2.0, "gradient": 3.0}, "floor": {"value": 1e-6},
                            "rule": SYNTHETIC},
                 "candidates": [{"candidate": "ignores-causal", "kind": "known-bad", "trials": 4, "rejected": 4,
                                 "rejected_by": {"causal-mask": 4}, "expected": "reject",
                                 "intended_checks": ["causal-mask"], "rejected_by_intended": 4,
                                 "seconds_per_trial": 0.5},
                                {"candidate": "reference", "kind": "reference", "trials": 4, "rejected": 0,
                                 "rejected_by": {}}]}
    correctness = {**common, "seed": SEED, "measured_candidate": "pallas",
                   "scorecards": [card("reference", "reference", True), card("pallas", "kernel", True),
                                  card("ignores-causal", "known-bad", False)],
                   "power": power_doc if power else None}
    for name in timed_kernels(cases, correctness):  # every kernel the scopes time is graded, as measure does
        correctness["scorecards"].insert(-1, card(name, "kernel", True))
    return {"environment": environment, "benchmark": benchmark, "correctness": correctness}


def write(out: Path, run_id: str = "synthetic-cpu", edit: Callable[[dict[str, Any]], None] | None = None,
          *, graded_on_rows: bool = True, **kwargs: Any) -> Path:
    """Write a synthetic run folder ``out/run_id`` (``edit`` may change the documents first); with
    ``graded_on_rows``, each timed kernel's scorecard then covers the features its (edited) rows use."""
    docs = documents(run_id, **kwargs)
    if edit is not None:
        edit(docs)
    if graded_on_rows:
        grade_features_of_rows(docs)
    return rawio.write_run(Path(out) / run_id, docs)


def grade_features_of_rows(docs: dict[str, Any]) -> None:
    """Give each scorecard of a timed kernel a passing check per feature its rows use that it was not graded
    on, as ``measure`` grades every kernel on its rows' features (``builder.verdicts.check_features``)."""
    correctness = docs["correctness"]
    used = features_by_candidate(docs["benchmark"]["cases"], correctness)
    for card in correctness["scorecards"]:
        missing = [f for f in used.get(card["candidate"], ()) if f not in (card.get("features") or ())]
        if missing:
            card["features"] = [*(card.get("features") or ()), *missing]
            card["checks"] += [{"name": f, "passed": True, "points": 1, "max_points": 1, "detail": SYNTHETIC}
                               for f in missing]
            card["score"] += len(missing)
            card["max_score"] += len(missing)


def stand_in_kernel_cards(run_dir: Path) -> Path:
    """Give each kernel that the measured run ``run_dir`` timed but did not grade a passing SYNTHETIC scorecard
    (manifest re-signed), for tests whose ``measure`` grades a cheap candidate instead of kernels interpreted
    for minutes: every timed kernel answers for its rows (``builder.verdicts``), and ``measure`` grading
    each of them is tested apart (test_measure_run, test_paged_records)."""
    doc = json.loads((Path(run_dir) / "correctness.json").read_text())
    cases = json.loads((Path(run_dir) / "benchmark.json").read_text())["cases"]
    used = features_by_candidate(cases, doc)  # graded on the features its rows use, as measure grades them
    for name in timed_kernels(cases, doc):
        paged = (impl := by_grading_name(name)) is not None and impl.paged
        checks = [{"name": check, "passed": True, "points": 1, "max_points": 1, "detail": SYNTHETIC}
                  for check in ["stand-in", *(("paged-" if paged else "") + f for f in used[name])]]
        doc["scorecards"].append({
            "candidate": name, "kind": "kernel", "passed": True, "score": len(checks), "max_score": len(checks),
            "error": None, "contract": "paged" if paged else "attention", "features": used[name], "checks": checks})
    rewrite(Path(run_dir), "correctness", doc)
    return Path(run_dir)


def tpu(out: Path, run_id: str = "synthetic-tpu", **kwargs: Any) -> Path:
    """A synthetic run that claims a v5e-8 slice (for the device-count rules)."""
    kwargs = {"platform": "tpu", "interpret": False, "device_kind": "TPU v5 lite", "device_count": 8,
              "env_vars": {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, **kwargs}
    return write(out, run_id, **kwargs)


def rewrite(run_dir: Path, name: str, document: Any) -> None:
    """Replace one document of a run (NaN allowed, unlike ``rawio``) and re-sign the manifest, as a
    careless tool might: the checksums then pass and only the acceptance rules can object."""
    resign(run_dir, f"{name}.json", (json.dumps(document, indent=2) + "\n").encode())


def resign(run_dir: Path, rel: str, data: bytes) -> None:
    """Write ``data`` to ``run_dir/rel`` and record its sha256 in the manifest."""
    (run_dir / rel).write_bytes(data)
    manifest = json.loads((run_dir / rawio.MANIFEST).read_text())
    manifest["files"][rel] = hashlib.sha256(data).hexdigest()
    (run_dir / rawio.MANIFEST).write_bytes(rawio.dumps(manifest))


def tree_hash(*paths: Path) -> str:
    """sha256 over every file (path and bytes) under ``paths``; to show that nothing changed."""
    digest = hashlib.sha256()
    for root in paths:
        root = Path(root)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            if path.exists():
                digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


REPO = Path(__file__).resolve().parent.parent
PUBLISHED = "published-tpu-v5e-8"


def workspace(dest: Path) -> Path:
    """A scratch copy of what a release needs (card, script, kernel_src, NOTICE, licences; no data/),
    plus ``runs/published-tpu-v5e-8`` copied from the repository's data/raw. Returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("dataset_card.md", "tpu_kernel_records.py", "NOTICE", "LICENSE-data", "LICENSE-code"):
        shutil.copyfile(REPO / name, dest / name)
    shutil.copytree(REPO / "kernel_src", dest / "kernel_src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "data" / "raw" / PUBLISHED, dest / "runs" / PUBLISHED)
    return dest
