"""Runs edited by hand, as an adversary would (manifest re-signed, so the checksums pass): each is refused
by the rule that owns it, naming rule, file and field, and nothing is written. Every derived number of a
measured run is recomputed from its samples and shapes; its profile's cases must all be there."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import BuildError, build
from release_fixtures import PUBLISHED, tree_hash


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("damaged"))
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


@pytest.fixture
def ws(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ws"))


def _edit(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        doc = json.loads((run / f"{name}.json").read_text())
        change(doc)
        testing.rewrite(run, name, doc)
    return damage


def _half_median(doc):
    doc["cases"][0]["median_ms"] /= 2


def _half_ratio(doc):
    doc["pairs"][0]["ratio"] /= 2


def _drop_case(doc):
    gone = doc["cases"].pop(3)["case_id"]
    doc["pairs"] = [p for p in doc["pairs"] if gone not in (p["numerator"], p["denominator"])]


def _extra_case(doc):
    doc["cases"].append(dict(doc["cases"][0], case_id="softmax-xla-s256", seq_len=256))


def _duplicate_case(doc):
    doc["cases"].append(dict(doc["cases"][0]))


def _pair_to_nowhere(doc):
    doc["pairs"][0]["denominator"] = "softmax-xla-s999"


def _edited_sample(doc):
    doc["cases"][1]["samples_ms"][0] *= 0.5  # the smallest sample: the median stays, min and q1 move


def _zero_sample(doc):
    doc["cases"][2]["samples_ms"][1] = 0.0


def _infinite_median(doc):
    doc["cases"][0]["median_ms"] = math.inf


def _flops(doc):
    doc["cases"][2]["flops"] *= 2


def _tflops(doc):
    doc["cases"][2]["tflops"] *= 1.000001


def _ci(doc):
    doc["pairs"][1]["ci_low"] = doc["pairs"][1]["ratio"] * 0.5


def _shape(doc):
    doc["cases"][2]["shape"]["head_dim"] = 128


def _unknown_profile(doc):
    doc["profile"] = "made-up"


def _devices(doc):
    doc["cases"][0]["devices_used"] = 2


def _interpret_on_tpu(doc):
    doc["cases"][1]["interpret"] = True


def _summary_statistics(doc):
    doc["cases"][0]["min_ms"] = 0.1


def _summary_ci(doc):
    doc["pairs"][0]["ci_low"] = 1.0


DAMAGES = {
    # name: (damage, rule, file, field) on a synthetic CPU run (tiny profile, 4 cases, 2 pairs)
    "median-not-of-samples": (_edit("benchmark", _half_median), "derived", "benchmark.json", "cases/0/median_ms"),
    "ratio-not-of-medians": (_edit("benchmark", _half_ratio), "derived", "benchmark.json", "pairs/0/ratio"),
    "ci-not-of-samples": (_edit("benchmark", _ci), "derived", "benchmark.json", "pairs/1/ci_low"),
    "missing-case": (_edit("benchmark", _drop_case), "missing-case", "benchmark.json", "cases"),
    "extra-case": (_edit("benchmark", _extra_case), "unexpected-case", "benchmark.json", "cases/4/case_id"),
    "duplicate-case": (_edit("benchmark", _duplicate_case), "case-id", "benchmark.json", "cases/4/case_id"),
    "pair-to-nowhere": (_edit("benchmark", _pair_to_nowhere), "pair", "benchmark.json", "pairs/0/denominator"),
    "edited-sample": (_edit("benchmark", _edited_sample), "derived", "benchmark.json", "cases/1/min_ms"),
    "zero-sample": (_edit("benchmark", _zero_sample), "samples", "benchmark.json", "cases/2/samples_ms/1"),
    "infinite-median": (_edit("benchmark", _infinite_median), "non-finite", "benchmark.json", "cases/0/median_ms"),
    "flops-not-of-shape": (_edit("benchmark", _flops), "derived", "benchmark.json", "cases/2/flops"),
    "tflops-not-of-median": (_edit("benchmark", _tflops), "derived", "benchmark.json", "cases/2/tflops"),
    "shape-not-of-profile": (_edit("benchmark", _shape), "case-shape", "benchmark.json", "cases/2/shape/head_dim"),
    "unknown-profile": (_edit("benchmark", _unknown_profile), "profile", "benchmark.json", "profile"),
    "case-devices": (_edit("benchmark", _devices), "devices", "benchmark.json", "cases/0/devices_used"),
    "env-devices-used": (_edit("environment", lambda d: d.update(devices_used=2, device_count=2)), "devices",
                         "environment.json", "devices_used"),
    "hf-token-env-var": (_edit("environment", lambda d: d["env_vars"].update(HF_TOKEN="x" * 12)),
                         "env-allow-list", "environment.json", "env_vars/HF_TOKEN"),
    "unlisted-env-var": (_edit("environment", lambda d: d["env_vars"].update(HOME="/root")),
                         "env-allow-list", "environment.json", "env_vars/HOME"),
    "token-in-notes": (_edit("environment", lambda d: d.update(notes="hf_" + "a1B2" * 9)), "secret",
                       "environment.json", None),
    "aws-key-in-detail": (_edit("correctness", lambda d: d["scorecards"][0]["checks"][0].update(
        detail="AKIA" + "ABCDEFGHIJKLMNOP")), "secret", "correctness.json", None),
    "record-id-mismatch": (_edit("benchmark", lambda d: d.update(run_id="someone-else")), "run-id",
                           "benchmark.json", "run_id"),
}


def _assert_untouched(ws: Path, before: str, listing: list[str]) -> None:
    assert tree_hash(ws / "data", ws / "dataset_card.md") == before
    assert sorted(os.listdir(ws)) == listing


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_damaged_measured_run_is_refused(ws, name):
    damage, rule, file, field = DAMAGES[name]
    run = testing.write(ws / "runs", "synthetic-cpu")
    damage(run)
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True)
    assert (err.value.rule, err.value.file, err.value.field) == (rule, str(run / file), field), str(err.value)
    _assert_untouched(ws, before, listing)


def test_the_undamaged_run_is_accepted(ws):
    """The damages above are the only reason for each refusal: the same run unedited builds."""
    assert build([testing.write(ws / "runs", "synthetic-cpu")], ws / "data", allow_interpret=True) == ["synthetic-cpu"]


def test_bootstrap_interval_follows_from_the_recorded_seed(ws):
    """With 20 samples the interval depends on the seed: a run whose seed was edited is refused."""
    run = testing.write(ws / "runs", "synthetic-cpu", samples=20)
    _edit("correctness", lambda d: d.update(seed=7))(run)
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True)
    assert (err.value.rule, err.value.field) == ("derived", "pairs/0/ci_low") and "seed 7" in str(err.value)


@pytest.mark.parametrize("damage, rule, field", [
    (_interpret_on_tpu, "interpret", "cases/1/interpret"),
    (_devices, "devices", "cases/0/devices_used"),
])
def test_damaged_tpu_run_is_refused(ws, damage, rule, field):
    run = testing.tpu(ws / "runs")
    _edit("benchmark", damage)(run)
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True)
    assert (err.value.rule, err.value.field) == (rule, field)


@pytest.mark.parametrize("damage, rule, field", [
    (_summary_statistics, "published-summary", "cases/0/min_ms"),
    (_summary_ci, "published-summary", "pairs/0/ci_low"),
    (_half_ratio, "derived", "pairs/0/ratio"),
    (lambda doc: doc["pairs"][9].update(ratio=2.40), "derived", "pairs/9/ratio"),  # printed 2.38, medians 2.3843
])
def test_published_summary_carrying_statistics_or_wrong_ratios_is_refused(ws, damage, rule, field):
    run = Path(shutil.copytree(ws / "runs" / PUBLISHED, ws / "runs" / "damaged"))
    _edit("benchmark", damage)(run)
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", replace=True)
    assert (err.value.rule, err.value.field) == (rule, field)


def test_measure_captures_with_the_allow_list_the_builder_applies():
    """One allow-list: what the measure job records is what the builder accepts (records.secrets)."""
    from tpu_kernel_records_tools.measure import environment
    from tpu_kernel_records_tools.records import secrets

    assert environment.ALLOWED_NAMES == secrets.ALLOWED_NAMES
    assert environment.ALLOWED_PREFIXES == secrets.ALLOWED_PREFIXES
    assert environment.SECRET_MARKERS == secrets.SECRET_MARKERS
    captured = environment.allowed_env_vars({"XLA_FLAGS": "--x", "HF_TOKEN": "hf_" + "a" * 34, "HOME": "/root",
                                             "TPU_ACCELERATOR_TYPE": "v5litepod-8", "JAX_API_KEY": "k" * 10})
    assert all(secrets.env_var_allowed(name) for name in captured)
    assert set(captured) == {"XLA_FLAGS", "TPU_ACCELERATOR_TYPE"}
