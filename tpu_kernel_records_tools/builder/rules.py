"""Acceptance rules: which raw runs may become records.

A run is accepted when (after ``rawio.read_run``'s schema and checksum checks):

* its three documents agree on source, platform and interpret mode;
* a TPU run shows every device of its slice (``expected_device_count``);
* the measured candidate's scorecard exists and every one of its checks passed, and so did the
  scorecards of every kernel the run timed, whichever its position (``builder.verdicts``: a timed
  kernel without a scorecard is refused; the XLA references and vendor kernels need none); every scorecard adds
  up as the rubric writes it (a check earns its points exactly when it passed, the score and maximum
  are their sums, a card passes exactly when it has checks, no error, and every check passed); its
  declared ``features`` are in the contract's order, each with the check of its name (``paged-<name>``
  on a paged scorecard; unless the card could not be graded), and it has no check of a feature it does
  not declare;
* it was not made in the future (``created_utc`` at most ``CLOCK_SKEW`` after the build);
* every benchmark case succeeded, with a finite, positive median; a ``measured`` case also has exactly
  ``samples_per_case`` finite, positive samples and states its whole shape;
* a ``published-summary`` (a card transcribed by hand) carries medians only: no samples, no
  min/max/quartiles, no confidence intervals; its ratios are those of its medians up to the card's
  rounding; and, since nothing in it can be recomputed, it is one of the transcriptions this project
  pins (``PUBLISHED_SUMMARIES``), document for document;
* every pair names cases of the run, once, and has a positive ratio;
* a CPU or interpret-mode run only with ``allow_interpret``; every row of its tables then says so;
* a ``grader-power`` record (``builder.grader_power``: the grader's power summary, measured on a CPU,
  no benchmark cases) needs no ``allow_interpret``: it states no kernel speed; its summary is checked;
* every recorded environment variable is on the allow-list (``records.secrets``): one outside it is
  refused, not dropped;
* a ``measured`` run holds every case and pair of its profile and scopes, and every derived number
  follows from its samples and shapes (``builder.recompute``);
* a ``submitted`` run (a submitted kernel, ``measure --candidate``) also meets ``builder.submitted``'s
  rules: the timed programs are the graded programs' bytes, its output checks passed, no median below
  the roofline floor, no interpret mode under a TPU or GPU profile.

A refusal raises ``rawio.RunError`` naming the rule, the file and the field.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..grading import contracts
from ..records.rawio import DOCUMENTS, RunError, dumps, scorecard_features, utc_time
from ..records.secrets import env_var_allowed

from .recompute import check_measured
from .submitted import check_submitted
from .verdicts import check_candidate, check_timed

# Devices a single-host TPU slice shows to JAX, by TPU_ACCELERATOR_TYPE (v4/v5p count two
# TensorCores per chip in the name; JAX shows one device per chip).
SLICE_DEVICES_BY_ACCELERATOR = {
    "v2-8": 8, "v3-8": 8, "v4-8": 4, "v5p-8": 4,
    "v5litepod-1": 1, "v5litepod-4": 4, "v5litepod-8": 8, "v5e-1": 1, "v5e-4": 4, "v5e-8": 8,
    "v6e-1": 1, "v6e-4": 4, "v6e-8": 8,
}
# Fallback when the accelerator type was not captured: the slice Kaggle offers for the device kind.
SLICE_DEVICES_BY_DEVICE_KIND = {"TPU v5 lite": 8, "TPU v5e": 8, "TPU v3": 8, "TPU v2": 8}

# The published cards transcribed by scripts/transcribe_published.py (every number parsed from the
# card's text): sha256 of each document's canonical JSON (rawio.dumps). A published summary states
# numbers nothing can recompute, so an edited or invented one would pass every other rule.
PUBLISHED_SUMMARIES = {
    "published-tpu-v5e-8": {
        "environment": "f4b39a02b1dd11fc58c4032750d9ea310bac7bd58bfbd9ad26b93a51c11ff28e",
        "correctness": "560fa98d544d1d0bf72906821b4f08961b232a4d5974e06e6bdbb98651278fde",
        "benchmark": "949233e6aa11dd3810ab8896ab27e147a9657d6ec5e700ee4fdb508fdac3fd30",
    },
}
CLOCK_SKEW = dt.timedelta(days=1)  # how far ahead of the builder's clock a run's created_utc may be

STATS = ("min_ms", "max_ms", "q1_ms", "q3_ms", "iqr_ms")
NUMBERS = ("transfer_ms", "lower_ms", "compile_ms", "median_ms", *STATS, "peak_memory_bytes", "flops",
           "bytes_moved", "tflops", "gbps", "peak_flops_fraction", "peak_bandwidth_fraction")


@dataclass(frozen=True)
class Accepted:
    """A run that passed every rule, and what the tables need to know about it."""

    record_id: str
    run: dict[str, Any]
    interpret: bool
    expected_device_count: int | None


def expected_device_count(environment: dict[str, Any]) -> int | None:
    """Devices the run's TPU slice has (None off TPU); refuses a slice this table does not know."""
    if environment["platform"] != "tpu":
        return None
    accelerator = environment["env_vars"].get("TPU_ACCELERATOR_TYPE")
    if accelerator is not None:
        if accelerator not in SLICE_DEVICES_BY_ACCELERATOR:
            raise RunError("slice-size", "environment.json", "env_vars/TPU_ACCELERATOR_TYPE",
                           f"unknown TPU slice {accelerator!r}; add it to builder.rules.SLICE_DEVICES_BY_ACCELERATOR")
        return SLICE_DEVICES_BY_ACCELERATOR[accelerator]
    kind = environment["device_kind"]
    if kind not in SLICE_DEVICES_BY_DEVICE_KIND:
        raise RunError("slice-size", "environment.json", "device_kind",
                       f"no TPU_ACCELERATOR_TYPE captured and no known slice for device kind {kind!r}")
    return SLICE_DEVICES_BY_DEVICE_KIND[kind]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_consistency(run: dict[str, Any]) -> None:
    env = run["environment"]
    for name in ("benchmark", "correctness"):
        if run[name]["source"] != env["source"]:
            raise RunError("consistency", f"{name}.json", "source",
                           f"{run[name]['source']!r} differs from environment.json's {env['source']!r}")
    for field in ("platform", "interpret"):
        if run["benchmark"][field] != env[field]:
            raise RunError("consistency", "benchmark.json", field,
                           f"{run['benchmark'][field]!r} differs from environment.json's {env[field]!r}")
    for i, case in enumerate(run["benchmark"]["cases"]):
        if case["interpret"] and env["platform"] != "cpu":
            raise RunError("interpret", "benchmark.json", f"cases/{i}/interpret",
                           f"case {case['case_id']!r} says interpret mode on a {env['platform']} run")
    created = utc_time(env.get("created_utc"))
    if created is not None and created > dt.datetime.now(dt.timezone.utc) + CLOCK_SKEW:
        raise RunError("created-utc", "environment.json", "created_utc",
                       f"{env['created_utc']} is in the future of this build's clock")
    if env["devices_used"] > env["device_count"]:
        raise RunError("devices", "environment.json", "devices_used",
                       f"{env['devices_used']} used but only {env['device_count']} visible")


def _check_scorecard(i: int, card: dict[str, Any]) -> None:
    """The sums and verdicts of one scorecard, as ``grading.rubric.Scorecard`` writes them."""
    where = f"scorecards/{i}"
    for j, check in enumerate(card["checks"]):
        earned = check["max_points"] if check["passed"] else 0.0
        if not math.isclose(check["points"], earned, rel_tol=1e-9, abs_tol=1e-9):
            raise RunError("scorecard", "correctness.json", f"{where}/checks/{j}/points",
                           f"{check['points']!r} points for a check that {'passed' if check['passed'] else 'failed'}"
                           f" (it earns {earned!r})")
    for field, key in (("score", "points"), ("max_score", "max_points")):
        total = sum(check[key] for check in card["checks"])
        if not math.isclose(card[field], total, rel_tol=1e-9, abs_tol=1e-9):
            raise RunError("scorecard", "correctness.json", f"{where}/{field}",
                           f"{card[field]!r}, but its checks' {key} add up to {total!r}")
    passed = not card.get("error") and bool(card["checks"]) and all(c["passed"] for c in card["checks"])
    if card["passed"] != passed:
        raise RunError("scorecard", "correctness.json", f"{where}/passed",
                       f"{card['passed']!r}, but it follows as {passed!r} from its error and checks")
    _check_features(where, card)


def _check_features(where: str, card: dict[str, Any]) -> None:
    """A scorecard's declared features (absent: graded before features existed, the base contract only)
    are in the contract's order, and its feature checks are exactly those features' (one check named
    after each declared feature, none for another; a card that could not be graded may lack them)."""
    names = scorecard_features()
    declared = card.get("features") or []
    if declared != [f for f in names if f in declared]:
        raise RunError("scorecard", "correctness.json", f"{where}/features",
                       f"{declared!r} is not in the contract's order ({', '.join(names)})")
    # a contract's scorecard grades feature f by the check prefix + f (paged: paged-f, grading.contracts)
    prefix = contracts.get(card.get("contract")).check_prefix
    graded = set()
    for j, check in enumerate(card["checks"]):
        feature = check["name"][len(prefix):] if check["name"].startswith(prefix) else None
        if feature in names and feature not in declared:
            raise RunError("scorecard", "correctness.json", f"{where}/checks/{j}/name",
                           f"a check of feature {feature!r}, which the scorecard does not declare "
                           f"(features: {declared!r})")
        graded.add(feature)
    missing = [f for f in declared if f not in graded]
    if missing and not card.get("error"):
        raise RunError("scorecard", "correctness.json", f"{where}/features",
                       f"declares feature {missing[0]!r} but has no check of that name: it was not graded on it")


def _check_correctness(run: dict[str, Any]) -> None:
    correctness = run["correctness"]
    name = correctness["measured_candidate"]
    if not any(card["candidate"] == name for card in correctness["scorecards"]):
        raise RunError("correctness", "correctness.json", "measured_candidate",
                       f"no scorecard for the measured candidate {name!r}")
    check_candidate(correctness, name, name)
    for i, card in enumerate(correctness["scorecards"]):
        _check_scorecard(i, card)
    check_timed(run)
    _check_power(correctness["power"])


def _check_power(power: dict[str, Any] | None) -> None:
    if power is not None:
        try:
            json.dumps(power, allow_nan=False)
        except ValueError:
            raise RunError("non-finite", "correctness.json", "power", "holds a NaN or infinite number") from None
        candidates = power.get("candidates")
        if not isinstance(candidates, list):
            raise RunError("power-format", "correctness.json", "power/candidates", "must be a list")
        for i, entry in enumerate(candidates):
            where = f"power/candidates/{i}"
            if not (isinstance(entry, dict) and isinstance(entry.get("candidate"), str)):
                raise RunError("power-format", "correctness.json", where, "needs a 'candidate' name")
            for key in ("trials", "rejected", "rejected_by_intended"):
                value = entry.get(key)
                if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                    raise RunError("power-format", "correctness.json", f"{where}/{key}", "must be a count")
            for key in ("kind", "expected", "contract"):
                if entry.get(key) is not None and not isinstance(entry[key], str):
                    raise RunError("power-format", "correctness.json", f"{where}/{key}", "must be a string")
            checks = entry.get("intended_checks")
            if checks is not None and not (isinstance(checks, list) and all(isinstance(c, str) for c in checks)):
                raise RunError("power-format", "correctness.json", f"{where}/intended_checks",
                               "must be a list of check names")
            by = entry.get("rejected_by") or {}
            if not (isinstance(by, dict) and all(isinstance(n, int) and n >= 0 for n in by.values())):
                raise RunError("power-format", "correctness.json", f"{where}/rejected_by",
                               "must map check names to counts")
            trials = entry.get("trials")
            if trials is not None:
                for key, value in [("rejected", entry.get("rejected")), *((f"rejected_by/{k}", n) for k, n in by.items())]:
                    if value is not None and value > trials:
                        raise RunError("power-derived", "correctness.json", f"{where}/{key}",
                                       f"{value} rejections in {trials} trials")
        _check_power_totals(power, candidates)


def _check_power_totals(power: dict[str, Any], candidates: list[dict[str, Any]]) -> None:
    """The summary's totals follow from its candidates (as ``sweeps.power`` computes them)."""
    correct = [e for e in candidates if e.get("expected") == "pass"]
    bad = [e for e in candidates if e.get("expected") == "reject"]
    totals = {"false_rejects": sum(e.get("rejected") or 0 for e in correct),
              "correct_trials": sum(e.get("trials") or 0 for e in correct),
              "missed_bad": sum((e.get("trials") or 0) - (e.get("rejected") or 0) for e in bad),
              "bad_trials": sum(e.get("trials") or 0 for e in bad)}
    for key, value in totals.items():
        if key in power and power[key] != value:
            raise RunError("power-derived", "correctness.json", f"power/{key}",
                           f"recorded {power[key]!r}, but the candidates give {value}")


def _check_case(i: int, case: dict[str, Any], benchmark: dict[str, Any], summary: bool, files: set[str]) -> None:
    where = f"cases/{i}"
    if case["status"] != "ok":
        raise RunError("benchmark-case", "benchmark.json", f"{where}/status",
                       f"case {case['case_id']!r} failed: {case['error']}")
    for field in NUMBERS:
        value = case[field]
        if value is not None and not _finite(value):
            raise RunError("non-finite", "benchmark.json", f"{where}/{field}", f"{value!r} is not finite")
    if summary and (case.get("compiled_tpu") is not None or case.get("compiled_tpu_reason") is not None):
        raise RunError("published-summary", "benchmark.json", f"{where}/compiled_tpu",
                       "a published summary carries no compiled program")
    if case["median_ms"] is None or case["median_ms"] <= 0:
        raise RunError("median", "benchmark.json", f"{where}/median_ms",
                       f"case {case['case_id']!r} needs a positive median, got {case['median_ms']!r}")
    samples = case["samples_ms"]
    if summary:
        if samples:
            raise RunError("published-summary", "benchmark.json", f"{where}/samples_ms",
                           "a published summary carries no samples (none were published)")
        for field in STATS:
            if case[field] is not None:
                raise RunError("published-summary", "benchmark.json", f"{where}/{field}",
                               "a published summary carries medians only")
        return
    if len(samples) != benchmark["samples_per_case"]:
        raise RunError("samples", "benchmark.json", f"{where}/samples_ms",
                       f"{len(samples)} samples, expected samples_per_case={benchmark['samples_per_case']}")
    for j, sample in enumerate(samples):
        if not (_finite(sample) and sample > 0):
            raise RunError("samples", "benchmark.json", f"{where}/samples_ms/{j}",
                           f"sample {sample!r} is not a finite, positive time")
    for field, value in [*case["shape"].items(), ("causal", case["causal"]), ("padded", case["padded"])]:
        if value is None:
            raise RunError("shape", "benchmark.json", f"{where}/{field}", "a measured case states its whole shape")
    for field in ("stablehlo", "stablehlo_tpu"):
        if case[field] is not None and case[field] not in files:
            raise RunError("missing-file", "benchmark.json", f"{where}/{field}",
                           f"{case[field]!r} is not a file of the run")
    if case.get("compiled_tpu") is not None and case["compiled_tpu"]["hlo"] not in files:
        raise RunError("missing-file", "benchmark.json", f"{where}/compiled_tpu/hlo",
                       f"{case['compiled_tpu']['hlo']!r} is not a file of the run")


def _check_benchmark(benchmark: dict[str, Any], files: set[str]) -> None:
    summary = benchmark["source"] == "published-summary"
    ids: dict[str, int] = {}
    for i, case in enumerate(benchmark["cases"]):
        if case["case_id"] in ids:
            raise RunError("case-id", "benchmark.json", f"cases/{i}/case_id", f"duplicate {case['case_id']!r}")
        ids[case["case_id"]] = i
        _check_case(i, case, benchmark, summary, files)
    seen: set[tuple[str, str]] = set()
    for i, pair in enumerate(benchmark["pairs"]):
        for field in ("numerator", "denominator"):
            if pair[field] not in ids:
                raise RunError("pair", "benchmark.json", f"pairs/{i}/{field}", f"no case {pair[field]!r}")
        if (pair["numerator"], pair["denominator"]) in seen:
            raise RunError("pair", "benchmark.json", f"pairs/{i}", "the same pair is listed twice")
        seen.add((pair["numerator"], pair["denominator"]))
        for field in ("ratio", "ci_low", "ci_high", "scaling_efficiency"):
            if pair.get(field) is not None and not (_finite(pair[field]) and pair[field] > 0):
                raise RunError("pair", "benchmark.json", f"pairs/{i}/{field}",
                               f"{pair[field]!r} is not a positive number")
        if pair["ratio"] is None:
            raise RunError("pair", "benchmark.json", f"pairs/{i}/ratio", "every pair of successful cases has a ratio")
        if summary and (pair["ci_low"] is not None or pair["ci_high"] is not None):
            raise RunError("published-summary", "benchmark.json", f"pairs/{i}/ci_low",
                           "a published summary has no samples, so no confidence interval")
        if summary:
            _check_published_ratio(i, pair, benchmark["cases"][ids[pair["numerator"]]]["median_ms"],
                                   benchmark["cases"][ids[pair["denominator"]]]["median_ms"])


# A published card prints ratios to 2 decimals and medians to 4 decimals (in ms).
PUBLISHED_RATIO_DIGITS, PUBLISHED_MEDIAN_DIGITS = 2, 4


def _check_published_ratio(i: int, pair: dict[str, Any], numerator_ms: float, denominator_ms: float) -> None:
    """A transcribed ratio must be the ratio of its transcribed medians, up to the card's rounding."""
    ratio = numerator_ms / denominator_ms
    half = 0.5 * 10.0 ** -PUBLISHED_MEDIAN_DIGITS
    allowed = 0.5 * 10.0 ** -PUBLISHED_RATIO_DIGITS + ratio * (half / numerator_ms + half / denominator_ms) + 1e-9
    if abs(pair["ratio"] - ratio) > allowed:
        raise RunError("derived", "benchmark.json", f"pairs/{i}/ratio",
                       f"{pair['ratio']!r}, but its medians give {ratio:.4f} (allowing the card's rounding)")


def accept(run: dict[str, Any], *, allow_interpret: bool = False,
           read_file: Callable[[str], bytes] | None = None) -> Accepted:
    """Apply every rule to a run read by ``rawio.read_run``; return it accepted or raise ``RunError``.

    ``read_file(relative path) -> bytes`` reads the run folder's evidence (``run_files``); a run
    whose cases carry compiled TPU facts is refused without it (they are checked against their HLO).
    """
    env, benchmark = run["environment"], run["benchmark"]
    _check_consistency(run)
    grader_power = env["source"] == "grader-power"
    interpret = (env["interpret"] or env["platform"] == "cpu"
                 or any(case["interpret"] for case in benchmark["cases"]))
    if interpret and not allow_interpret and not grader_power:
        field = "interpret" if env["interpret"] else "platform"
        raise RunError("interpret", "environment.json", field,
                       "a CPU/interpret-mode run says nothing about kernel speed; pass --allow-interpret to "
                       "add it anyway (every row is then flagged interpret=true)")
    expected = expected_device_count(env)
    if expected is not None and env["device_count"] != expected:
        raise RunError("slice-devices", "environment.json", "device_count",
                       f"{env['device_count']} devices visible, but the slice has {expected}: "
                       "a TPU run must show every device of its slice")
    for name in env["env_vars"]:
        if not env_var_allowed(name):
            raise RunError("env-allow-list", "environment.json", f"env_vars/{name}",
                           "not on the environment allow-list (records.secrets); a run records only "
                           "allow-listed variables, so this one is refused rather than dropped")
    if grader_power:  # the grader's power, measured on a CPU: no kernel is timed or graded as the record's
        _check_power(run["correctness"]["power"])
        return Accepted(env["run_id"], run, interpret, expected)
    _check_correctness(run)
    _check_benchmark(benchmark, set(run["manifest"]["files"]))
    if benchmark["source"] == "measured":
        check_measured(run, read_file)
    elif benchmark["source"] == "submitted":
        check_submitted(run, read_file)
    elif benchmark["source"] == "published-summary":
        _check_published_source(run)
    return Accepted(env["run_id"], run, interpret, expected)


def _check_published_source(run: dict[str, Any]) -> None:
    pinned = PUBLISHED_SUMMARIES.get(run["environment"]["run_id"])
    for name in DOCUMENTS:
        try:
            digest = hashlib.sha256(dumps(run[name])).hexdigest()
        except ValueError:
            digest = None
        if pinned is None or digest != pinned[name]:
            raise RunError("published-source", f"{name}.json", None,
                           "not a published summary this project transcribed (rules.PUBLISHED_SUMMARIES, from "
                           "scripts/transcribe_published.py): its numbers cannot be recomputed, so an edited "
                           "or new one needs the card and a reviewed change")


def run_files(run_dir: Path) -> Callable[[str], bytes]:
    """``read_file`` for ``accept``: the bytes of a file of the run folder ``run_dir``."""
    return lambda rel: (Path(run_dir) / rel).read_bytes()
