"""Every refusal rule of ``builder.rules.accept`` triggered on its own, checking rule, file and field.

The runs are in memory (``release_fixtures.documents`` and the committed published record), each with
one deliberate edit, so a rule that is weakened, skipped or reports the wrong place makes a test fail.
Damage that the JSON schemas already refuse is tested here too: the rules are the builder's own
defence and must not depend on the schema having run. (``tests/test_build.py`` checks that a refusal
through ``build`` writes nothing.)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, Callable

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder import rules
from tpu_kernel_records_tools.records import rawio

TPU_ENV = {"platform": "tpu", "interpret": False, "device_kind": "TPU v5 lite", "device_count": 8,
           "env_vars": {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}}


def _run(documents: dict[str, Any]) -> dict[str, Any]:
    """What ``rawio.read_run`` returns for these documents (the manifest lists the three JSON files)."""
    files = {f"{name}.json": "0" * 64 for name in rawio.DOCUMENTS}
    manifest = {"format_version": 1, "run_id": documents["environment"]["run_id"], "files": files}
    # Through JSON text, as read from a run folder (fresh strings, NaN allowed as in a hand-edited file).
    return json.loads(json.dumps({"manifest": manifest, **documents}))


def _base(kind: str) -> dict[str, Any]:
    if kind == "cpu":
        return _run(testing.documents("synthetic-cpu"))
    if kind == "tpu":
        return _run(testing.documents("synthetic-tpu", **TPU_ENV))
    run = rawio.read_run(testing.REPO / "data" / "raw" / testing.PUBLISHED)
    assert run["benchmark"]["source"] == "published-summary"
    return run


@pytest.mark.parametrize("kind", ["cpu", "tpu", "summary"])
def test_the_undamaged_runs_are_accepted(kind):
    accepted = rules.accept(_base(kind), allow_interpret=kind == "cpu")
    assert accepted.interpret is (kind == "cpu")
    assert accepted.expected_device_count == (None if kind == "cpu" else 8)


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Damage: set ``document/key/.../key`` (integers index lists) to ``value``."""
    def damage(run: dict) -> None:
        *parents, leaf = path.split("/")
        node = run
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return damage


def _both(*damages: Callable[[dict], None]) -> Callable[[dict], None]:
    def damage(run: dict) -> None:
        for d in damages:
            d(run)
    return damage


def _duplicate_case(run: dict) -> None:
    run["benchmark"]["cases"].append(copy.deepcopy(run["benchmark"]["cases"][0]))


def _duplicate_pair(run: dict) -> None:
    run["benchmark"]["pairs"].append(copy.deepcopy(run["benchmark"]["pairs"][0]))


def _no_measured_scorecard(run: dict) -> None:
    run["correctness"]["measured_candidate"] = "not-graded"


def _card_index(run: dict) -> int:
    name = run["correctness"]["measured_candidate"]
    return next(i for i, c in enumerate(run["correctness"]["scorecards"]) if c["candidate"] == name)


def _card(field: str, value: Any) -> Callable[[dict], None]:
    def damage(run: dict) -> None:
        run["correctness"]["scorecards"][_card_index(run)][field] = value
    return damage


def _failed_check(run: dict) -> None:
    run["correctness"]["scorecards"][_card_index(run)]["checks"][1]["passed"] = False


def _not_interpret(run: dict) -> None:
    """A CPU run that claims it did not run in interpret mode (the platform alone still refuses it)."""
    run["environment"]["interpret"] = run["benchmark"]["interpret"] = False
    for case in run["benchmark"]["cases"]:
        case["interpret"] = False


def _drop_sample(run: dict) -> None:
    run["benchmark"]["cases"][2]["samples_ms"].pop()


def _missing_stablehlo(run: dict) -> None:
    run["benchmark"]["cases"][0]["stablehlo"] = "evidence/absent.mlir.gz"


# name: (base run, damage, allow_interpret, rule, file, field)
REFUSALS: dict[str, tuple] = {
    # The three documents describe one run.
    "source-differs": ("cpu", _set("correctness/source", "published-summary"), True,
                       "consistency", "correctness.json", "source"),
    "benchmark-source-differs": ("cpu", _set("benchmark/source", "published-summary"), True,
                                 "consistency", "benchmark.json", "source"),
    "platform-differs": ("tpu", _set("benchmark/platform", "cpu"), False, "consistency", "benchmark.json", "platform"),
    "interpret-differs": ("tpu", _set("benchmark/interpret", True), False,
                          "consistency", "benchmark.json", "interpret"),
    "more-devices-used-than-visible": ("tpu", _set("environment/devices_used", 9), False,
                                       "devices", "environment.json", "devices_used"),
    # Interpret mode says nothing about kernel speed.
    "interpret-run-without-flag": ("cpu", lambda run: None, False, "interpret", "environment.json", "interpret"),
    "cpu-platform-without-flag": ("cpu", _not_interpret, False, "interpret", "environment.json", "platform"),
    "interpret-case-in-a-tpu-run": ("tpu", _set("benchmark/cases/1/interpret", True), False,
                                    "interpret", "benchmark.json", "cases/1/interpret"),
    "interpret-case-in-a-tpu-run-even-with-flag": ("tpu", _set("benchmark/cases/1/interpret", True), True,
                                                   "interpret", "benchmark.json", "cases/1/interpret"),
    # A TPU run shows every device of its slice.
    "slice-device-count": ("tpu", _set("environment/device_count", 4), False,
                           "slice-devices", "environment.json", "device_count"),
    "slice-device-count-by-device-kind": ("tpu", _both(_set("environment/env_vars", {}),
                                                       _set("environment/device_count", 1),
                                                       _set("environment/devices_used", 1)), False,
                                          "slice-devices", "environment.json", "device_count"),
    "unknown-accelerator": ("tpu", _set("environment/env_vars", {"TPU_ACCELERATOR_TYPE": "v9-1024"}), False,
                            "slice-size", "environment.json", "env_vars/TPU_ACCELERATOR_TYPE"),
    "unknown-device-kind": ("tpu", _both(_set("environment/env_vars", {}), _set("environment/device_kind", "TPU v99")),
                            False, "slice-size", "environment.json", "device_kind"),
    # Only allow-listed environment variables are recorded; one outside the list is refused, not dropped.
    "env-var-outside-allow-list": ("tpu", _set("environment/env_vars", {"TPU_ACCELERATOR_TYPE": "v5litepod-8",
                                                                        "HF_TOKEN": "hf_x"}), False,
                                   "env-allow-list", "environment.json", "env_vars/HF_TOKEN"),
    # The measured candidate passed every check.
    "no-scorecard-for-measured-candidate": ("cpu", _no_measured_scorecard, True,
                                            "correctness", "correctness.json", "measured_candidate"),
    "scorecard-error": ("cpu", _card("error", "could not load"), True, "correctness", "correctness.json",
                        "scorecards/1/error"),
    "scorecard-without-checks": ("cpu", _card("checks", []), True, "correctness", "correctness.json",
                                 "scorecards/1/checks"),
    "failed-check": ("cpu", _failed_check, True, "correctness", "correctness.json", "scorecards/1/checks/1/passed"),
    "scorecard-not-passed": ("cpu", _card("passed", False), True, "correctness", "correctness.json",
                             "scorecards/1/passed"),
    # Every scorecard adds up as the rubric writes it (a known-bad candidate cannot be shown passing).
    "scorecard-score-inflated": ("cpu", _set("correctness/scorecards/0/score", 4.0), True, "scorecard",
                                 "correctness.json", "scorecards/0/score"),
    "scorecard-max-changed": ("cpu", _set("correctness/scorecards/0/max_score", 2.0), True, "scorecard",
                              "correctness.json", "scorecards/0/max_score"),
    "scorecard-points-for-a-failed-check": ("cpu", _set("correctness/scorecards/2/checks/0/points", 1.0), True,
                                            "scorecard", "correctness.json", "scorecards/2/checks/0/points"),
    "scorecard-known-bad-shown-passing": ("cpu", _set("correctness/scorecards/2/passed", True), True,
                                          "scorecard", "correctness.json", "scorecards/2/passed"),
    # A run is not made in the future of the build.
    "created-in-the-future": ("cpu", _set("environment/created_utc", "2999-01-01T00:00:00Z"), True,
                              "created-utc", "environment.json", "created_utc"),
    # The power summary is well formed and finite.
    "power-nan": ("cpu", _set("correctness/power/candidates/0/seconds_per_trial", math.nan), True,
                  "non-finite", "correctness.json", "power"),
    "power-candidates-not-a-list": ("cpu", _set("correctness/power/candidates", {}), True,
                                    "power-format", "correctness.json", "power/candidates"),
    "power-entry-without-name": ("cpu", _set("correctness/power/candidates/0/candidate", None), True,
                                 "power-format", "correctness.json", "power/candidates/0"),
    "power-negative-count": ("cpu", _set("correctness/power/candidates/0/rejected", -1), True,
                             "power-format", "correctness.json", "power/candidates/0/rejected"),
    "power-boolean-count": ("cpu", _set("correctness/power/candidates/1/trials", True), True,
                            "power-format", "correctness.json", "power/candidates/1/trials"),
    "power-kind-not-text": ("cpu", _set("correctness/power/candidates/0/kind", 3), True,
                            "power-format", "correctness.json", "power/candidates/0/kind"),
    "power-expected-not-text": ("cpu", _set("correctness/power/candidates/0/expected", ["reject"]), True,
                                "power-format", "correctness.json", "power/candidates/0/expected"),
    "power-intended-checks-not-names": ("cpu", _set("correctness/power/candidates/0/intended_checks", [1]), True,
                                        "power-format", "correctness.json", "power/candidates/0/intended_checks"),
    "power-rejected-by-not-counts": ("cpu", _set("correctness/power/candidates/0/rejected_by", {"x": -2}), True,
                                     "power-format", "correctness.json", "power/candidates/0/rejected_by"),
    "power-rejections-exceed-trials": ("cpu", _set("correctness/power/candidates/0/rejected", 5), True,
                                       "power-derived", "correctness.json", "power/candidates/0/rejected"),
    "power-check-rejections-exceed-trials": ("cpu", _set("correctness/power/candidates/0/rejected_by",
                                                         {"causal-mask": 9}), True, "power-derived",
                                             "correctness.json", "power/candidates/0/rejected_by/causal-mask"),
    "power-total-not-derived": ("cpu", _set("correctness/power/missed_bad", 3), True, "power-derived",
                                "correctness.json", "power/missed_bad"),
    # Every case succeeded with a finite, positive median.
    "failed-case": ("cpu", _both(_set("benchmark/cases/3/status", "failed"), _set("benchmark/cases/3/error", "OOM")),
                    True, "benchmark-case", "benchmark.json", "cases/3/status"),
    "zero-median": ("cpu", _set("benchmark/cases/2/median_ms", 0.0), True, "median", "benchmark.json",
                    "cases/2/median_ms"),
    "negative-median": ("cpu", _set("benchmark/cases/2/median_ms", -1.0), True, "median", "benchmark.json",
                        "cases/2/median_ms"),
    "missing-median": ("cpu", _set("benchmark/cases/0/median_ms", None), True, "median", "benchmark.json",
                       "cases/0/median_ms"),
    "zero-median-in-a-summary": ("summary", _set("benchmark/cases/4/median_ms", 0), False, "median",
                                 "benchmark.json", "cases/4/median_ms"),
    "negative-median-in-a-summary": ("summary", _set("benchmark/cases/4/median_ms", -0.5), False, "median",
                                     "benchmark.json", "cases/4/median_ms"),
    "infinite-number": ("cpu", _set("benchmark/cases/1/compile_ms", math.inf), True, "non-finite", "benchmark.json",
                        "cases/1/compile_ms"),
    "nan-median": ("cpu", _set("benchmark/cases/1/median_ms", math.nan), True, "non-finite", "benchmark.json",
                   "cases/1/median_ms"),
    # Measured cases: every sample, positive and finite; the whole shape; evidence files present.
    "sample-count": ("cpu", _drop_sample, True, "samples", "benchmark.json", "cases/2/samples_ms"),
    "negative-sample": ("cpu", _set("benchmark/cases/2/samples_ms/0", -0.5), True, "samples", "benchmark.json",
                        "cases/2/samples_ms/0"),
    "zero-sample": ("cpu", _set("benchmark/cases/0/samples_ms/1", 0.0), True, "samples", "benchmark.json",
                    "cases/0/samples_ms/1"),
    "nan-sample": ("cpu", _set("benchmark/cases/0/samples_ms/2", math.nan), True, "samples", "benchmark.json",
                   "cases/0/samples_ms/2"),
    "shape-unknown": ("cpu", _set("benchmark/cases/0/shape/head_dim", None), True, "shape", "benchmark.json",
                      "cases/0/head_dim"),
    "causal-unknown": ("cpu", _set("benchmark/cases/1/causal", None), True, "shape", "benchmark.json",
                       "cases/1/causal"),
    "padded-unknown": ("cpu", _set("benchmark/cases/1/padded", None), True, "shape", "benchmark.json",
                       "cases/1/padded"),
    "missing-evidence-file": ("cpu", _missing_stablehlo, True, "missing-file", "benchmark.json", "cases/0/stablehlo"),
    "duplicate-case": ("cpu", _duplicate_case, True, "case-id", "benchmark.json", None),
    # A published summary carries medians only.
    "summary-with-samples": ("summary", _set("benchmark/cases/0/samples_ms", [0.17]), False, "published-summary",
                             "benchmark.json", "cases/0/samples_ms"),
    "summary-with-minimum": ("summary", _set("benchmark/cases/3/min_ms", 0.1), False, "published-summary",
                             "benchmark.json", "cases/3/min_ms"),
    "summary-with-quartile": ("summary", _set("benchmark/cases/3/q3_ms", 0.2), False, "published-summary",
                              "benchmark.json", "cases/3/q3_ms"),
    "summary-with-iqr": ("summary", _set("benchmark/cases/5/iqr_ms", 0.01), False, "published-summary",
                         "benchmark.json", "cases/5/iqr_ms"),
    "summary-with-confidence-interval": ("summary", _set("benchmark/pairs/0/ci_low", 2.0), False,
                                         "published-summary", "benchmark.json", "pairs/0/ci_low"),
    # Pairs name cases of the run, once, with a positive ratio.
    "pair-names-no-case": ("cpu", _set("benchmark/pairs/0/numerator", "no-such-case"), True, "pair",
                           "benchmark.json", "pairs/0/numerator"),
    "pair-denominator-names-no-case": ("summary", _set("benchmark/pairs/1/denominator", "no-such-case"), False,
                                       "pair", "benchmark.json", "pairs/1/denominator"),
    "pair-listed-twice": ("summary", _duplicate_pair, False, "pair", "benchmark.json", None),
    "pair-zero-ratio": ("summary", _set("benchmark/pairs/2/ratio", 0.0), False, "pair", "benchmark.json",
                        "pairs/2/ratio"),
    "pair-negative-ratio": ("summary", _set("benchmark/pairs/2/ratio", -2.38), False, "pair", "benchmark.json",
                            "pairs/2/ratio"),
    "pair-without-ratio": ("summary", _set("benchmark/pairs/2/ratio", None), False, "pair", "benchmark.json",
                           "pairs/2/ratio"),
    "pair-negative-ci": ("cpu", _set("benchmark/pairs/0/ci_low", -0.1), True, "pair", "benchmark.json",
                         "pairs/0/ci_low"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_rule_refuses_naming_rule_file_and_field(name):
    kind, damage, allow_interpret, rule, file, field = REFUSALS[name]
    run = _base(kind)
    damage(run)
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run, allow_interpret=allow_interpret)
    e = err.value
    if field is None:  # the rule names the item (its index is where the duplicate sits)
        assert (e.rule, e.file) == (rule, file), (name, str(e))
        assert e.field is not None
    else:
        assert (e.rule, e.file, e.field) == (rule, file, field), (name, str(e))
    message = str(e)
    assert message.startswith(f"[{rule}] {file}") and "\n" not in message


def test_a_duplicate_case_or_pair_is_named_where_it_repeats():
    run = _base("cpu")
    _duplicate_case(run)
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run, allow_interpret=True)
    last = len(run["benchmark"]["cases"]) - 1
    assert err.value.field == f"cases/{last}/case_id" and run["benchmark"]["cases"][0]["case_id"] in str(err.value)
    run = _base("summary")
    _duplicate_pair(run)
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run)
    assert err.value.field.startswith(f"pairs/{len(run['benchmark']['pairs']) - 1}") and "twice" in str(err.value)


# Devices JAX shows on each single-host slice (one per chip; v2/v3 chips show two TensorCores each,
# v4/v5p count two TensorCores per chip in the slice name): stated here independently of builder.rules.
SLICES = {"v2-8": 8, "v3-8": 8, "v4-8": 4, "v5p-8": 4, "v5litepod-1": 1, "v5litepod-4": 4, "v5litepod-8": 8,
          "v5e-1": 1, "v5e-4": 4, "v5e-8": 8, "v6e-1": 1, "v6e-4": 4, "v6e-8": 8}


def test_the_slice_table_states_the_device_counts():
    assert rules.SLICE_DEVICES_BY_ACCELERATOR == SLICES
    assert rules.SLICE_DEVICES_BY_DEVICE_KIND == {"TPU v5 lite": 8, "TPU v5e": 8, "TPU v3": 8, "TPU v2": 8}


def _power(run: dict, totals: dict) -> None:
    run["correctness"]["power"]["candidates"] = [
        {"candidate": "ignores-causal", "kind": "known-bad", "expected": "reject", "trials": 4, "rejected": 3,
         "rejected_by": {"causal-mask": 3}},
        {"candidate": "reference", "kind": "reference", "expected": "pass", "trials": 4, "rejected": 1,
         "rejected_by": {"causal-mask": 1}},
        {"candidate": "pallas", "kind": "kernel", "expected": "pass"},
    ]
    run["correctness"]["power"].update(totals)


POWER_TOTALS = {"false_rejects": 1, "correct_trials": 4, "missed_bad": 1, "bad_trials": 4}


def test_power_totals_that_follow_from_the_candidates_are_accepted():
    run = _base("cpu")
    _power(run, POWER_TOTALS)
    rules.accept(run, allow_interpret=True)


@pytest.mark.parametrize("key", sorted(POWER_TOTALS))
def test_power_totals_that_do_not_follow_are_refused(key):
    run = _base("cpu")
    _power(run, {**POWER_TOTALS, key: POWER_TOTALS[key] + 1})
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run, allow_interpret=True)
    assert (err.value.rule, err.value.file, err.value.field) == ("power-derived", "correctness.json", f"power/{key}")


def test_an_accepted_run_cannot_be_changed_afterwards():
    accepted = rules.accept(_base("tpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        accepted.interpret = True


@pytest.mark.parametrize("accelerator, devices", sorted(SLICES.items()))
def test_every_known_slice_needs_all_its_devices(accelerator, devices):
    env = {"platform": "tpu", "env_vars": {"TPU_ACCELERATOR_TYPE": accelerator}, "device_kind": "TPU v5 lite"}
    assert rules.expected_device_count(env) == devices
    run = _base("tpu")
    run["environment"]["env_vars"] = {"TPU_ACCELERATOR_TYPE": accelerator}
    run["environment"]["device_count"] = devices + 1
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run)
    assert (err.value.rule, err.value.field) == ("slice-devices", "device_count")
    assert f"slice has {devices}" in str(err.value)


def test_device_kind_fallback_and_platforms_without_a_slice():
    for kind, devices in rules.SLICE_DEVICES_BY_DEVICE_KIND.items():
        assert rules.expected_device_count({"platform": "tpu", "env_vars": {}, "device_kind": kind}) == devices
    for platform in ("cpu", "gpu"):
        assert rules.expected_device_count({"platform": platform, "env_vars": {}, "device_kind": "x"}) is None


def test_an_interpret_run_admitted_with_the_flag_is_marked_interpret():
    accepted = rules.accept(_base("cpu"), allow_interpret=True)
    assert accepted.interpret and accepted.record_id == "synthetic-cpu" and accepted.expected_device_count is None
    tpu = rules.accept(_base("tpu"), allow_interpret=True)
    assert not tpu.interpret and tpu.expected_device_count == 8


def _published_pair_slack(run: dict, i: int) -> tuple[float, float]:
    """(ratio of the pair's medians, the slack the card's rounding allows): ratios printed to 2 decimals,
    medians to 4 decimals (ms), each off by at most half a unit of its last digit."""
    bench = run["benchmark"]
    cases = {c["case_id"]: c["median_ms"] for c in bench["cases"]}
    pair = bench["pairs"][i]
    n, d = cases[pair["numerator"]], cases[pair["denominator"]]
    ratio = n / d
    return ratio, 0.005 + ratio * (0.00005 / n + 0.00005 / d)


@pytest.mark.parametrize("side", [+1, -1])
def test_a_published_ratio_must_follow_from_its_medians_up_to_the_cards_rounding(side):
    run = _base("summary")
    ratio, slack = _published_pair_slack(run, 0)
    run["benchmark"]["pairs"][0]["ratio"] = ratio + side * 0.98 * slack
    with pytest.raises(rawio.RunError) as err:  # within the rounding: past the ratio rule, to the pin
        rules.accept(run)
    assert (err.value.rule, err.value.file) == ("published-source", "benchmark.json")
    run["benchmark"]["pairs"][0]["ratio"] = ratio + side * 1.02 * slack
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run)
    assert (err.value.rule, err.value.file, err.value.field) == ("derived", "benchmark.json", "pairs/0/ratio")


def test_a_record_folder_must_carry_its_own_run_id(tmp_path):
    """``builder.derive.read_record`` re-accepts data/raw/<id>: a folder renamed to another id is refused,
    and the refusal names the file under data/raw."""
    from tpu_kernel_records_tools.builder import derive

    raw = tmp_path / "data" / derive.RAW
    testing.write(raw, "synthetic-cpu")
    assert derive.read_record(tmp_path / "data", "synthetic-cpu").record_id == "synthetic-cpu"
    (raw / "synthetic-cpu").rename(raw / "renamed-run")
    with pytest.raises(rawio.RunError) as err:
        derive.read_record(tmp_path / "data", "renamed-run")
    e = err.value
    assert (e.rule, e.file, e.field) == ("record-id", f"{derive.RAW}/renamed-run/manifest.json", "run_id")
    assert str(e) == (f"[record-id] {derive.RAW}/renamed-run/manifest.json at run_id: run id 'synthetic-cpu' "
                      "differs from its folder name")


def test_a_run_stamped_within_the_clock_skew_is_accepted():
    """A measuring machine's clock a few hours ahead of the builder's is not a lie; a day and more is."""
    import datetime as dt

    ahead = dt.datetime.now(dt.timezone.utc) + rules.CLOCK_SKEW - dt.timedelta(hours=1)
    run = _base("cpu")
    run["environment"]["created_utc"] = ahead.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert rules.accept(run, allow_interpret=True).record_id == run["environment"]["run_id"]
    assert rules.CLOCK_SKEW == dt.timedelta(days=1)


def test_a_published_summary_is_accepted_only_as_the_transcription_this_project_pins():
    """Nothing in a published summary can be recomputed: the committed transcription is accepted;
    the same documents under another id, or with one median and its ratio edited consistently (every
    other rule then holds), are refused."""
    assert rules.accept(_base("summary")).record_id == "published-tpu-v5e-8"
    renamed = _base("summary")
    for name in rawio.DOCUMENTS:
        renamed[name]["run_id"] = "published-elsewhere"
    renamed["manifest"]["run_id"] = "published-elsewhere"
    with pytest.raises(rawio.RunError) as err:
        rules.accept(renamed)
    assert (err.value.rule, err.value.file) == ("published-source", "environment.json")

    edited = _base("summary")
    bench = edited["benchmark"]
    pair = bench["pairs"][0]
    [case] = [c for c in bench["cases"] if c["case_id"] == pair["numerator"]]
    case["median_ms"] = round(case["median_ms"] * 0.5, 4)
    denominator = next(c["median_ms"] for c in bench["cases"] if c["case_id"] == pair["denominator"])
    pair["ratio"] = round(case["median_ms"] / denominator, 2)
    with pytest.raises(rawio.RunError) as err:
        rules.accept(edited)
    assert (err.value.rule, err.value.file) == ("published-source", "benchmark.json"), str(err.value)


@pytest.mark.parametrize("passed, points, says", [(False, 1.0, "for a check that failed (it earns 0.0)"),
                                                  (True, 0.0, "for a check that passed (it earns 1")])
def test_a_scorecard_refusal_says_what_the_check_earns(passed, points, says):
    run = _base("cpu")
    check = run["correctness"]["scorecards"][0]["checks"][0]
    check.update(passed=passed, points=points)
    with pytest.raises(rawio.RunError, match=r"\[scorecard\]") as err:
        rules.accept(run, allow_interpret=True)
    assert says in str(err.value), str(err.value)
