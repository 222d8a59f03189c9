"""Ragged serving steps as records (issue 54): the ``ragged`` cases' columns (``num_seqs``, ``q_rows``,
``kv_dtype``, ``quantized_kv`` and the cache's ``page_size``, ``pages``, ``pool_pages``; null elsewhere and in older
records), the builder's refusal of a ragged case whose step, cache or bytes disagree with its profile, the timed
ragged kernel answering on the ragged contract (on ``quantized_kv`` too, where its rows are quantized), and the card's
ragged section. Slow: ``measure`` on the cpu profile's ragged cases, ``build``, ``verify`` and ``datasets``."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench.cases import build_cases, get_profile
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.records.schema import FEATURES

RAGGED_COLUMNS = ("num_seqs", "q_rows", "kv_dtype", "quantized_kv")
KERNEL_FP8 = "ragged-ragged-pallas-llama-3-8b-tiny-p16-float8_e4m3fn"
CHECKS = ("ragged-output", "ragged-accuracy", "ragged-garbage", "ragged-quantized_kv")


def _card(features: list[str]) -> dict:
    return {"candidate": "ragged-pallas", "kind": "kernel", "passed": True, "score": 4.0, "max_score": 4.0,
            "error": None, "contract": "ragged", "features": features,
            "checks": [{"name": name, "passed": True, "points": 1.0, "max_points": 1, "detail": testing.SYNTHETIC,
                        "error": 1e-3, "tolerance": 1e-2, "baseline_error": 5e-4} for name in CHECKS]}


def _with_ragged(docs: dict, features: tuple[str, ...] = ("quantized_kv",)) -> None:
    """Give a synthetic ragged run's cases the fields ``run_case`` writes, and the ragged kernel a ragged scorecard."""
    cases, _ = build_cases(get_profile(testing.PROFILE), ("ragged",), platform="cpu")
    fields = {c.case_id: c.mask_fields() for c in cases}
    for case in docs["benchmark"]["cases"]:
        case.update(fields[case["case_id"]])
    cards = docs["correctness"]["scorecards"]
    cards[:] = [c for c in cards if c["candidate"] != "ragged-pallas"] + [copy.deepcopy(_card(list(features)))]


@pytest.fixture(scope="module")
def ragged(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("ragged"))
    testing.write(ws / "runs", "synthetic-ragged", scopes=("ragged",), edit=_with_ragged)
    build([ws / "runs" / "synthetic-ragged"], ws / "data", allow_interpret=True)
    return ws


def test_the_step_columns_round_trip_and_older_records_keep_them_null(ragged):
    table = pq.read_table(ragged / "data" / "benchmark" / "synthetic-ragged.parquet")
    assert table.schema.equals(FEATURES["benchmark"])
    rows = {r["case_id"]: r for r in table.to_pylist()}
    fp8, bf16 = rows[KERNEL_FP8], rows[KERNEL_FP8.replace("float8_e4m3fn", "bfloat16")]
    want = dict(model="llama-3-8b-tiny", num_seqs=4, q_rows=34, kv_dtype="float8_e4m3fn", quantized_kv=True,
                page_size=16, pages=4, pool_pages=13, batch=4, q_len=48, kv_len=64, seq_len=64)
    assert {k: fp8[k] for k in want} == want
    assert (bf16["kv_dtype"], bf16["quantized_kv"]) == ("bfloat16", False)
    assert fp8["bytes_moved"] < bf16["bytes_moved"] and fp8["flops"] == bf16["flops"]  # the cache at 1 byte
    assert fp8["baseline_case_id"] == "ragged-ragged-xla-llama-3-8b-tiny-p16-float8_e4m3fn"
    assert fp8["graded_verdict"] == "passed"
    published = pq.read_table(testing.REPO / "data" / "benchmark" / f"{testing.PUBLISHED}.parquet").to_pylist()
    assert published and all(r[k] is None for r in published for k in RAGGED_COLUMNS)


def test_the_card_lists_the_declared_steps_and_the_recorded_cases(ragged):
    card = (ragged / "dataset_card.md").read_text().split("<!-- BEGIN GENERATED: ragged -->")[1]
    card = card.split("<!-- END GENERATED: ragged -->")[0]
    assert "`synthetic-ragged`" in card and "yes (not kernel speed)" in card
    assert ("| tpu-v5e, gpu, h100 | `llama-3-8b` | 32 / 8 | 128 | 64 x 1 (4365-8192) | 512 of 2048, 512 of 4096 | "
            "1000 | 2088 (2096) | `float8_e4m3fn` | 16 | 512 | 25403 | no | 865.6 |") in card
    assert "| cpu, tiny | `llama-3-8b-tiny` | 4 / 2 | 128 | 2 x 1 (49-64) | 8 of 40 | 24 | 34 (48) | `bfloat16` |" in card


def test_the_ragged_kernels_rows_answer_on_the_ragged_contract(ragged):
    rows = pq.read_table(ragged / "data" / "correctness" / "synthetic-ragged.parquet").to_pylist()
    assert {r["contract"] for r in rows if r["candidate"] == "ragged-pallas"} == {"ragged"}


@pytest.mark.parametrize("field,value,rule", [
    ("bytes_moved", None, r"\[derived\].*bytes_moved"),  # replaced below by the cache's bytes at bfloat16
    ("num_seqs", 5, r"\[case-shape\].*num_seqs"),
    ("q_rows", 48, r"\[case-shape\].*q_rows"),
    ("kv_dtype", "bfloat16", r"\[case-shape\].*kv_dtype"),
    ("quantized_kv", False, r"\[case-shape\].*quantized_kv"),
    ("pool_pages", 16, r"\[case-shape\].*pool_pages"),
])
def test_a_ragged_case_whose_step_cache_or_bytes_disagree_is_refused(ragged, tmp_path, field, value, rule):
    def edit(docs):
        _with_ragged(docs)
        case = next(c for c in docs["benchmark"]["cases"] if c["case_id"] == KERNEL_FP8)
        bf16 = next(c for c in docs["benchmark"]["cases"] if c["case_id"] == KERNEL_FP8.replace("float8_e4m3fn",
                                                                                                 "bfloat16"))
        case[field] = bf16["bytes_moved"] if field == "bytes_moved" else value
    ws = Path(shutil.copytree(ragged, tmp_path / "ws", symlinks=True))
    run = testing.write(ws / "runs", "synthetic-bad", scopes=("ragged",), edit=edit)
    with pytest.raises(BuildError, match=rule):
        build([run], ws / "data", allow_interpret=True)


def test_a_quantized_row_needs_a_scorecard_graded_on_quantized_kv(ragged, tmp_path):
    """The fp8 rows use the contract's ``quantized_kv``: a passing card that did not grade it does not stand for them."""
    ws = Path(shutil.copytree(ragged, tmp_path / "ws", symlinks=True))
    run = testing.write(ws / "runs", "synthetic-bad", scopes=("ragged",), edit=lambda docs: _with_ragged(docs, ()),
                        graded_on_rows=False)
    with pytest.raises(BuildError, match="quantized_kv"):
        build([run], ws / "data", allow_interpret=True)


def test_the_raw_schema_refuses_a_cache_dtype_it_does_not_name():
    from tpu_kernel_records_tools.records.rawio import RunError

    with pytest.raises(RunError, match=r"\[schema\].*kv_dtype.*'int4'"):
        testing.write(Path("/nonexistent"), "synthetic-bad", scopes=("ragged",), edit=lambda docs: [
            _with_ragged(docs), docs["benchmark"]["cases"][0].update(kv_dtype="int4")])


@pytest.mark.slow
def test_measure_on_the_cpu_profiles_ragged_cases_builds_verifies_and_loads(tmp_path, monkeypatch):
    """The real benchmark (the ragged kernel in interpret mode, the XLA reference) at every ragged case of the cpu
    profile, graded on the cheap ragged reference at the quick level (the kernel's own grade is what ``measure``
    runs: the choice is tested in test_measure_run); build, verify, ``datasets``."""
    from tpu_kernel_records_tools.builder.verify import verify
    from tpu_kernel_records_tools.measure import run as run_module

    grade = run_module.grade
    monkeypatch.setattr(run_module, "grade", lambda kernels, *, seed, progress, known_bad=None, kernel_level=None, **_: grade(
        ["ragged-reference"], seed=seed, progress=progress, known_bad=[], kernel_level="quick"))
    monkeypatch.setattr(run_module, "measured_candidates",
                        lambda profile, scopes: ("ragged-reference", ["ragged-reference"]))
    run = testing.stand_in_kernel_cards(run_module.run_measure(tmp_path / "run", profile="cpu", warmups=0,
                                                               samples=2, scopes=["ragged"], progress=False))
    bench = json.loads((run / "benchmark.json").read_text())
    assert all(c["status"] == "ok" for c in bench["cases"]) and len(bench["cases"]) == 4
    assert all(c["compiled_tpu"] is not None for c in bench["cases"] if c["implementation"] == "ragged-pallas")
    ws = testing.workspace(tmp_path / "ws")
    (record,) = build([run], ws / "data", allow_interpret=True)
    assert verify(ws / "data", ws / "dataset_card.md") == []
    import datasets

    loaded = datasets.load_dataset("parquet", data_files=str(ws / "data" / "benchmark" / f"{record}.parquet"),
                                   split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert loaded.features == datasets.Features.from_arrow_schema(FEATURES["benchmark"])
    assert {(r["kv_dtype"], r["quantized_kv"], r["num_seqs"], r["q_rows"]) for r in loaded} == {
        ("bfloat16", False, 4, 34), ("float8_e4m3fn", True, 4, 34)}
