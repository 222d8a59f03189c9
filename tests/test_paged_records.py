"""Paged KV caches as benchmark cases and records (issue 36): the ``paged-decode`` cases each profile declares,
their useful bytes (the K/V actually read: checked against a brute-force count of the paged contract's mask,
key by key), the records' cache columns (null elsewhere and in older records), the builder's refusal of a
paged case whose bytes or cache disagree, the correctness rows' ``contract``, the card's paged section and
the leaderboard's paged table. Slow: ``measure`` on the cpu profile's paged cases, ``build``, ``verify`` and
``datasets``."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from kernel_src.contract import visible
from tpu_kernel_records_tools.bench import roofline
from tpu_kernel_records_tools.bench.cases import build_cases, get_profile
from tpu_kernel_records_tools.bench.profiles import MODEL_PAGED, TINY_PAGED
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.records.schema import FEATURES

PAGED_COLUMNS = ("page_size", "pages", "pool_pages")


def _brute(q_len: int, lengths, causal: bool, window) -> tuple[int, int]:
    """(visible pairs, keys some row sees) over the sequences, from the contract's mask on NumPy grids: each
    sequence's rows are its last ``q_len`` positions (``kv_len`` = its length, bottom-right)."""
    pairs = keys = 0
    for length in lengths:
        if length <= 0:
            continue
        mask = np.broadcast_to(visible(np.arange(q_len)[:, None], np.arange(length)[None, :], q_len, int(length),
                                       causal, int(length), window), (q_len, int(length)))
        pairs, keys = pairs + int(mask.sum()), keys + int(mask.any(axis=0).sum())
    return pairs, keys


def test_paged_work_equals_a_brute_force_count_of_the_contract_mask():
    """Random sequences: lengths 0 to 40 (shorter than q_len too), q_len 1-8, causal or not, windows with
    either side unbounded."""
    rng = np.random.default_rng(36)
    for _ in range(120):
        q_len, hq, hk, d = int(rng.integers(1, 9)), 4, 2, 8
        lengths = rng.integers(0, 41, int(rng.integers(1, 5)))
        causal = bool(rng.integers(2))
        window = None if rng.integers(3) == 0 else tuple(
            None if rng.integers(3) == 0 else int(rng.integers(0, 12)) for _ in range(2))
        flops, nbytes = roofline.paged_work(lengths, q_len, hq, hk, d, 2, causal, window)
        pairs, keys = _brute(q_len, lengths, causal, window)
        assert flops == 4.0 * hq * d * pairs, (q_len, lengths, causal, window)
        assert nbytes == (2 * keys * hk + 2 * len(lengths) * q_len * hq) * d * 2, (q_len, lengths, window)


@pytest.mark.parametrize("profile, platform, kernels", [
    ("tpu-v5e", "tpu", {"paged-xla", "paged-pallas", "jax-paged"}), ("gpu", "gpu", {"paged-xla", "paged-triton"}),
    ("cpu", "cpu", {"paged-xla", "paged-pallas"})])
def test_every_profile_declares_its_decode_cases_and_counts_the_keys_they_read(profile, platform, kernels):
    """The issue's cases (batch 8-64, 1k-32k keys, pages of 16 and 128, Llama-3-8B's and Mistral-7B's heads on
    the device profiles); every case's bytes the K/V of the keys its new row sees (a window: the last 4,096)."""
    cases, pairs = build_cases(get_profile(profile), ("paged-decode",), platform=platform)
    assert {c.implementation for c in cases} == kernels
    for c in cases:
        model = next(m for m in get_profile(profile).paged if m.name == c.model)
        lengths = model.lengths(c.seq_len)
        table, pool = model.page_table(c.seq_len, c.page_size)
        _, keys = _brute(1, lengths, True, model.window)
        assert c.bytes_moved == 2 * (keys * model.num_kv_heads + len(lengths) * model.num_q_heads) * model.head_dim * 2
        assert (c.pages, c.pool_pages, c.window, c.shape["q_len"]) == (c.seq_len // c.page_size, pool, model.window, 1)
        assert sorted(table.ravel()) == list(range(pool)) and lengths.max() == c.seq_len and lengths.min() > 0
        assert c.interpret == (platform == "cpu" and c.implementation == "paged-pallas")
        if c.implementation == "jax-paged":  # on its own heads-first pools, and only where it applies
            assert c.window is None and c.abstract_args[1].shape == (model.num_kv_heads, pool, c.page_size, 128)
    assert all(p.denominator.startswith("paged-decode-paged-xla") or "jax-paged" in p.denominator for p in pairs)
    if profile != "cpu":
        assert {(m.name, m.num_q_heads, m.num_kv_heads, m.head_dim) for m in MODEL_PAGED} == {
            ("llama-3-8b", 32, 8, 128), ("mistral-7b", 32, 8, 128)}
        batches = {c.shape["batch"] for c in cases}
        assert min(batches) == 8 and max(batches) == 64 and {c.page_size for c in cases} == {16, 128}
        assert min(c.seq_len for c in cases) == 1024 and max(c.seq_len for c in cases) == 32768


def test_every_other_case_has_no_cache_fields():
    cases, _ = build_cases(get_profile("tiny"), ("softmax", "attention", "masks-fwd"), platform="cpu")
    assert cases and all(c.mask_fields()[k] is None for c in cases for k in PAGED_COLUMNS)


def test_a_decode_program_runs_the_reference_and_jax_layouts_alike():
    """The XLA reference's program at the tiny windowed case against a NumPy gather-then-attend (float64)."""
    (case,) = [c for c in build_cases(get_profile("tiny"), ("paged-decode",), platform="cpu")[0]
               if c.implementation == "paged-xla"]
    q, k, v, lengths, table = case.make_inputs()
    out = np.asarray(case.fn(q, k, v, lengths, table), np.float64)
    model = TINY_PAGED[1]
    for b, length in enumerate(lengths):
        keys = np.concatenate([k[p] for p in table[b]])[:length].astype(np.float64)  # [len, hk, d]
        vals = np.concatenate([v[p] for p in table[b]])[:length].astype(np.float64)
        first = max(0, length - 1 - model.window[0])
        for h in range(model.num_q_heads):
            g = h // (model.num_q_heads // model.num_kv_heads)
            s = keys[first:, g] @ q[b, 0, h].astype(np.float64) * model.head_dim ** -0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, 0, h], p @ vals[first:, g] / p.sum(), atol=3e-2)


# --- records ---------------------------------------------------------------------------------------------------

PAGED_CARD = {"candidate": "paged-reference", "kind": "reference", "passed": True, "score": 3.0, "max_score": 3.0,
              "error": None, "contract": "paged", "features": ["window"],
              "checks": [{"name": name, "passed": True, "points": 1.0, "max_points": 1, "detail": testing.SYNTHETIC,
                          "error": 1e-3, "tolerance": 1e-2, "baseline_error": 5e-4}
                         for name in ("paged-output", "paged-accuracy", "paged-window")]}


def _with_paged(docs: dict) -> None:
    """Give a synthetic paged-decode run's cases the fields ``run_case`` writes, and a paged scorecard."""
    cases, _ = build_cases(get_profile(testing.PROFILE), ("paged-decode",), platform="cpu")
    fields = {c.case_id: c.mask_fields() for c in cases}
    for case in docs["benchmark"]["cases"]:
        case.update(fields[case["case_id"]])
    docs["correctness"]["scorecards"].append(copy.deepcopy(PAGED_CARD))


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("paged"))
    testing.write(ws / "runs", "synthetic-paged", scopes=("paged-decode",), edit=_with_paged)
    build([ws / "runs" / "synthetic-paged"], ws / "data", allow_interpret=True)
    return ws


def test_the_cache_columns_round_trip_and_older_records_keep_them_null(paged):
    table = pq.read_table(paged / "data" / "benchmark" / "synthetic-paged.parquet")
    assert table.schema.equals(FEATURES["benchmark"])
    rows = {r["case_id"]: r for r in table.to_pylist()}
    kernel = rows["paged-decode-paged-pallas-mistral-7b-tiny-p16-s256"]
    assert (kernel["model"], kernel["window"], kernel["page_size"], kernel["pages"], kernel["pool_pages"]) == (
        "mistral-7b-tiny", {"left": 63, "right": 0}, 16, 16, 32)
    assert kernel["baseline_case_id"] == "paged-decode-paged-xla-mistral-7b-tiny-p16-s256"
    published = pq.read_table(testing.REPO / "data" / "benchmark" / f"{testing.PUBLISHED}.parquet").to_pylist()
    assert published and all(r[k] is None for r in published for k in PAGED_COLUMNS)
    card = (paged / "dataset_card.md").read_text().split("<!-- BEGIN GENERATED: paged -->")[1]
    card = card.split("<!-- END GENERATED: paged -->")[0]
    assert "`synthetic-paged`" in card and "yes (not kernel speed)" in card
    assert "| tpu-v5e, gpu, h100 | `llama-3-8b` | 32 / 8 | 128 | — | 16 | 1024 | 64 | 64 | 4096 |" in card
    assert "| tpu-v5e, gpu, h100 | `mistral-7b` | 32 / 8 | 128 | (4095, 0) | 128 | 32768 | 8 | 256 | 2048 |" in card


def test_correctness_rows_name_the_contract_they_were_graded_on(paged):
    rows = pq.read_table(paged / "data" / "correctness" / "synthetic-paged.parquet").to_pylist()
    contracts = {(r["row_kind"], r["candidate"], r["contract"]) for r in rows}
    assert ("check", "paged-reference", "paged") in contracts and ("check", "pallas", "attention") in contracts
    assert all(r["contract"] == "attention" for r in rows if r["row_kind"] == "power")  # a sweep before paged ones
    published = pq.read_table(testing.REPO / "data" / "correctness" / f"{testing.PUBLISHED}.parquet").to_pylist()
    assert all(r["contract"] in ("attention", None) for r in published)


@pytest.mark.parametrize("field,value,rule", [
    ("bytes_moved", None, r"\[derived\].*bytes_moved"),  # replaced below by the whole cache's bytes
    ("page_size", 128, r"\[case-shape\].*page_size"),
    ("pages", 8, r"\[case-shape\].*pages"),
    ("pool_pages", 64, r"\[case-shape\].*pool_pages"),
    ("window", None, r"\[case-shape\].*window"),
])
def test_a_paged_case_whose_bytes_or_cache_disagree_is_refused(paged, tmp_path, field, value, rule):
    def edit(docs):
        _with_paged(docs)
        case = next(c for c in docs["benchmark"]["cases"]
                    if c["case_id"] == "paged-decode-paged-pallas-mistral-7b-tiny-p16-s256")
        # bytes: every key of the pools read, not the window's (what a kernel that reads all pages moves)
        case[field] = float(2 * 32 * 16 * 2 * 128 * 2 + 2 * 2 * 4 * 128 * 2) if field == "bytes_moved" else value
    ws = Path(shutil.copytree(paged, tmp_path / "ws", symlinks=True))
    run = testing.write(ws / "runs", "synthetic-bad", scopes=("paged-decode",), edit=edit)
    with pytest.raises(BuildError, match=rule):
        build([run], ws / "data", allow_interpret=True)


def test_a_paged_scorecard_grades_its_features_by_their_paged_checks(paged, tmp_path):
    """A paged card declaring ``window`` needs ``paged-window``; a dense ``window`` check does not count."""
    def edit(docs):
        _with_paged(docs)
        docs["correctness"]["scorecards"][-1]["checks"][-1]["name"] = "window"
    ws = Path(shutil.copytree(paged, tmp_path / "ws", symlinks=True))
    run = testing.write(ws / "runs", "synthetic-bad", scopes=("paged-decode",), edit=edit)
    with pytest.raises(BuildError, match=r"\[scorecard\].*no check of that name"):
        build([run], ws / "data", allow_interpret=True)


def test_the_leaderboard_ranks_paged_kernels_apart():
    from tpu_kernel_records_tools.builder.leaderboard import leaderboard

    def bench(record, scope, page_size):
        base = dict.fromkeys(FEATURES["benchmark"].names)
        return {**base, "record_id": record, "source": "submitted", "implementation": "submitted", "scope": scope,
                "interpret": False, "device_kind": "TPU v5 lite", "seq_len": 1024, "batch": 8, "num_q_heads": 32,
                "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "median_ms": 1.0, "samples_ms": [1.0] * 9,
                "page_size": page_size, "pairs": [{"baseline_case_id": f"{scope}-paged-xla-x-s1024", "ratio": 0.5,
                                                   "ci_low": None, "ci_high": None}]}

    def check(record, contract):
        base = dict.fromkeys(FEATURES["correctness"].names)
        return {**base, "record_id": record, "source": "submitted", "measured": True, "row_kind": "check",
                "candidate": record, "candidate_passed": True, "features": [], "contract": contract}

    text = leaderboard(pa.Table.from_pylist([bench("dense", "flash", None), bench("pagey", "paged-decode", 16)]),
                       pa.Table.from_pylist([check("dense", "attention"), check("pagey", "paged")]))
    dense, paged_table = text.split("graded on the paged contract")
    assert "`dense`" in dense and "`pagey`" not in dense
    assert "`pagey`" in paged_table and "paged: base" in paged_table and "vs paged-xla" in paged_table
    assert "0.50x" in paged_table and "8, 1024, 32/8, 128, bfloat16, 16" in paged_table


# --- a real run ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_measure_on_the_cpu_profiles_paged_cases_builds_verifies_and_loads(tmp_path, monkeypatch):
    """The real benchmark (the paged kernel in interpret mode, the XLA reference) at every paged case of the cpu
    profile, graded on the cheap paged reference at the quick level (the paged kernel's full grade, about 1.5
    minutes, is what ``measure`` runs: the choice is tested in test_measure_run); build, verify, ``datasets``."""
    from test_build import paged_rows_carry_their_cache
    from tpu_kernel_records_tools.builder.verify import verify
    from tpu_kernel_records_tools.measure import run as run_module

    grade = run_module.grade
    monkeypatch.setattr(run_module, "grade", lambda kernels, *, seed, progress, known_bad=None, kernel_level=None, **_: grade(
        ["paged-reference"], seed=seed, progress=progress, known_bad=[], kernel_level="quick"))
    monkeypatch.setattr(run_module, "measured_candidates",
                        lambda profile, scopes: ("paged-reference", ["paged-reference"]))
    run = testing.stand_in_kernel_cards(run_module.run_measure(tmp_path / "run", profile="cpu", warmups=0,
                                                               samples=2, scopes=["paged-decode"], progress=False))
    bench = json.loads((run / "benchmark.json").read_text())
    assert all(c["status"] == "ok" for c in bench["cases"])
    assert all(c["compiled_tpu"] is not None for c in bench["cases"] if c["implementation"] == "paged-pallas")
    ws = testing.workspace(tmp_path / "ws")
    (record,) = build([run], ws / "data", allow_interpret=True)
    assert verify(ws / "data", ws / "dataset_card.md") == []
    rows = pq.read_table(ws / "data" / "benchmark" / f"{record}.parquet").to_pylist()
    paged_rows_carry_their_cache(ws / "data", record, rows, "cpu")
    checks = pq.read_table(ws / "data" / "correctness" / f"{record}.parquet").to_pylist()
    assert {r["contract"] for r in checks} == {"paged"}
    assert {r["candidate"] for r in checks if r["measured"]} == {"paged-reference"}


def test_measure_grades_the_timed_paged_kernel_on_the_paged_contract_with_the_paged_known_bad(monkeypatch):
    """The kernel graded is the one timed (the registry's grading name per platform), at the full level; the
    paged known-bad join the dense ones only where a paged kernel is graded."""
    from tpu_kernel_records_tools.grading import candidates, rubric
    from tpu_kernel_records_tools.measure import run as run_module

    asked = {}

    def fake_grade(name, *, seed, level, features=None):
        asked[name] = level
        return rubric.Scorecard(name, "kernel", [], seed=seed, level=level)

    monkeypatch.setattr(rubric, "grade", fake_grade)
    _, kernels = run_module.measured_candidates(get_profile("cpu"), ["paged-decode"], "cpu")
    timed = {c.implementation for c in build_cases(get_profile("cpu"), ("paged-decode",), platform="cpu")[0]}
    assert kernels == ["paged-pallas"] and set(kernels) <= timed
    run_module.grade(kernels, seed=0, progress=False)
    paged_bad = {n for n, c in candidates.PAGED_BUILTIN.items() if c.kind == "known-bad"}
    assert asked["paged-pallas"] == "full" and paged_bad <= set(asked)
    assert all(asked[n] == "quick" for n in paged_bad)
    asked.clear()
    run_module.grade(["flash"], seed=0, progress=False)
    assert not paged_bad & set(asked)
