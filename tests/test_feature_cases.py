"""The masks models run, as benchmark cases (scopes ``masks-fwd`` / ``masks-fwd-bwd``): which models and
features each profile declares, the useful FLOPs their masks leave (counted exactly: checked against a
brute-force count of the contract's own mask and against closed forms), the programs' wiring of the
feature arguments (on the XLA reference: nothing in interpret mode), the records' mask columns and the
builder's refusal of a case whose FLOPs or mask disagree. Slow: ``measure`` on the tiny profile writes the
windowed, capped, packed and sink cases, and ``build``, ``verify`` and ``load`` carry them."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import release_fixtures as testing
from kernel_src.contract import visible
from tpu_kernel_records_tools.bench import roofline
from tpu_kernel_records_tools.bench.cases import MASK_SCOPES, SCOPES, build_cases, get_profile
from tpu_kernel_records_tools.bench.profiles import MODEL_MASKS, TINY_MASKS
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.records.schema import FEATURES


def _brute_pairs(q_len, kv_len, causal, lengths, batch, window, q_ids, kv_ids) -> int:
    """Every (row, key) pair of the contract's mask (``kernel_src.contract.visible`` on NumPy grids)."""
    total = 0
    for b in range(batch):
        q_pos, k_pos = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        length = None if lengths is None else lengths[b]
        q_seg = None if q_ids is None else q_ids[b][:, None]
        kv_seg = None if kv_ids is None else kv_ids[b][None, :]
        mask = visible(q_pos, k_pos, q_len, kv_len, causal, length, window, q_seg, kv_seg)
        total += int(np.sum(np.broadcast_to(mask, (q_len, kv_len))))
    return total


def test_visible_pairs_equal_a_brute_force_count_of_the_contract_mask():
    """Random small problems: causal or not, q_len above and below kv_len, kv_lengths past both ends,
    windows with either side unbounded, segment ids that repeat (A B A) and differ between q and k."""
    rng = np.random.default_rng(35)
    for _ in range(150):
        batch, q_len, kv_len = int(rng.integers(1, 3)), int(rng.integers(1, 24)), int(rng.integers(1, 24))
        causal = bool(rng.integers(2))
        lengths = None if rng.integers(2) else rng.integers(-1, kv_len + 3, batch)
        window = None if rng.integers(4) == 0 else tuple(
            None if rng.integers(3) == 0 else int(rng.integers(0, 9)) for _ in range(2))
        segments = bool(rng.integers(2))
        q_ids = rng.integers(0, 3, (batch, q_len)) if segments else None
        kv_ids = rng.integers(0, 3, (batch, kv_len)) if segments else None
        got = roofline.visible_pairs(q_len, kv_len, causal, lengths, batch, window, q_ids, kv_ids)
        want = _brute_pairs(q_len, kv_len, causal, lengths, batch, window, q_ids, kv_ids)
        assert got == want, (batch, q_len, kv_len, causal, lengths, window, q_ids, kv_ids)
    with pytest.raises(ValueError, match="both or neither"):
        roofline.visible_pairs(4, 4, True, None, 1, None, np.zeros((1, 4)), None)


def _window_causal_closed_form(seq: int, left: int) -> int:
    """Row i sees min(i, left) + 1 keys: the first left + 1 rows a triangle, the rest left + 1 each."""
    if seq <= left + 1:
        return seq * (seq + 1) // 2
    return (left + 1) * (left + 2) // 2 + (seq - left - 1) * (left + 1)


@pytest.mark.parametrize("seq,left", [(1, 0), (7, 0), (7, 3), (7, 6), (7, 50), (8192, 4095), (32768, 4095),
                                      (32768, 127)])
def test_a_causal_window_counts_its_closed_form(seq, left):
    assert roofline.visible_pairs(seq, seq, True, None, 3, (left, 0)) == 3 * _window_causal_closed_form(seq, left)


def test_the_models_cases_are_the_issues_and_count_their_windows_in_closed_form():
    models = {m.name: m for m in MODEL_MASKS}
    mistral, gemma, oss, packed = (models[n] for n in ("mistral-7b", "gemma-2-9b", "gpt-oss-20b", "packed"))
    assert (mistral.num_q_heads, mistral.num_kv_heads, mistral.head_dim, mistral.window) == (32, 8, 128, (4095, 0))
    assert mistral.seq_lens[0] == 8192 and mistral.seq_lens[-1] == 32768 and mistral.plan_seq_lens == (32768,)
    assert (gemma.num_q_heads, gemma.num_kv_heads, gemma.head_dim, gemma.window, gemma.softcap) == (
        16, 8, 256, (4095, 0), 50.0)
    assert gemma.scale == 256 ** -0.5
    assert (oss.num_q_heads, oss.num_kv_heads, oss.head_dim, oss.window, oss.sinks) == (64, 8, 64, (127, 0), True)
    assert packed.documents == (4, 16) and packed.seq_lens == (8192,) and packed.window is None
    assert [m.features for m in (mistral, gemma, oss, packed)] == [
        ("window",), ("window", "softcap"), ("window", "sinks"), ("segments",)]
    for profile in ("tpu-v5e", "gpu"):
        assert get_profile(profile).masks == MODEL_MASKS and set(MASK_SCOPES) <= set(get_profile(profile).scopes)
    cases, _ = build_cases(get_profile("tpu-v5e"), MASK_SCOPES, platform="tpu")
    by_id = {c.case_id: c for c in cases}
    fwd = by_id["masks-fwd-flash-mistral-7b-s32768"]
    assert fwd.shape == dict(batch=2, q_len=32768, kv_len=32768, num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert fwd.flops == 4 * 32 * 128 * 2 * _window_causal_closed_form(32768, 4095)
    assert fwd.flops / (4 * 32 * 128 * 2 * 32768 * 32769 / 2) < 0.25  # a 4,096-key window: under a quarter
    assert by_id["masks-fwd-bwd-flash-mistral-7b-s32768"].flops == 3.5 * fwd.flops
    oss_case = by_id["masks-fwd-flash-gpt-oss-20b-s8192"]
    assert oss_case.flops == 4 * 64 * 64 * 8 * _window_causal_closed_form(8192, 127)
    # sinks and (fwd+bwd) their gradient add 4 bytes per query head each
    _, plain = roofline.attention_work(8, 8192, 8192, 64, 8, 64, 2, True, None)
    assert oss_case.bytes_moved == plain + 4 * 64
    assert (fwd.model, fwd.window, fwd.softcap, fwd.segments, fwd.sinks) == ("mistral-7b", (4095, 0), None, None,
                                                                           None)
    cap = by_id["masks-fwd-flash-gemma-2-9b-s8192"]
    assert (cap.softcap, cap.window, oss_case.sinks) == (50.0, (4095, 0), True)


def test_packed_rows_count_each_documents_triangle():
    """Sorted ids: a document of L tokens is a causal triangle of L (L + 1) / 2 pairs, nothing across
    documents; every row holds exactly its count of documents, the same in every run (no seed)."""
    packed = next(m for m in MODEL_MASKS if m.name == "packed")
    cases, _ = build_cases(get_profile("tpu-v5e"), ("masks-fwd",), platform="tpu")
    for documents in packed.documents:
        ids = packed.segment_ids(8192, documents)
        assert ids.shape == (8, 8192) and ids.dtype == np.int32
        assert np.array_equal(ids, packed.segment_ids(8192, documents))
        triangles = 0
        for row in ids:
            assert np.all(np.diff(row) >= 0) and set(np.unique(row)) == set(range(documents))
            sizes = np.bincount(row)
            triangles += int(np.sum(sizes * (sizes + 1) // 2))
        case = next(c for c in cases if c.model == "packed" and c.segments == documents)
        assert case.flops == 4 * 32 * 128 * triangles
        assert case.bytes_moved == roofline.attention_work(8, 8192, 8192, 32, 8, 128, 2, True, None)[1] + 4 * 8 * 2 * 8192
    assert not np.array_equal(packed.segment_ids(8192, 4)[0], packed.segment_ids(8192, 4)[1])  # rows differ


def test_every_profile_times_the_kernels_that_declare_the_features():
    """cpu: flash over the XLA reference at tiny sizes (interpret mode, the four features, by default); tpu:
    flash alone (the reference's fp32 logits do not fit at the models' sizes); gpu: cuDNN declares no
    feature, so it is not timed on a mask."""
    cpu = get_profile("cpu")
    assert cpu.masks == get_profile("tiny").masks == TINY_MASKS and set(MASK_SCOPES) <= set(cpu.scopes)
    assert not set(MASK_SCOPES) & set(get_profile("tiny").scopes)  # tiny: only when asked (--scopes)
    cases, pairs = build_cases(cpu, MASK_SCOPES, platform="cpu")
    assert {c.implementation for c in cases} == {"flash", "xla"}
    assert all(c.interpret == (c.implementation == "flash") for c in cases)
    assert {c.window is not None for c in cases} == {True, False} and any(c.softcap for c in cases)
    assert any(c.segments for c in cases) and any(c.sinks for c in cases)
    assert len(pairs) == len(cases) // 2 and all("-flash-" in p.numerator and "-xla-" in p.denominator for p in pairs)
    tpu, tpu_pairs = build_cases(get_profile("tpu-v5e"), MASK_SCOPES, platform="tpu")
    assert {c.implementation for c in tpu} == {"flash"} and not tpu_pairs
    gpu, _ = build_cases(get_profile("gpu"), MASK_SCOPES, platform="gpu")
    assert {c.implementation for c in gpu} == {"flash"} and len(gpu) == len(tpu)
    assert len({c.case_id for c in tpu}) == len(tpu) == 2 * sum(len(m.variants()) for m in MODEL_MASKS)


def test_timing_a_mask_grades_the_flash_kernel_on_its_features():
    from tpu_kernel_records_tools.measure.run import measured_candidates

    cpu = get_profile("cpu")
    assert measured_candidates(cpu, list(cpu.scopes), "cpu") == ("pallas", ["pallas", "flash", "paged-pallas",
                                                                          "ragged-pallas"])
    assert measured_candidates(cpu, ["masks-fwd"]) == ("flash", ["flash"])


def _check_program(case) -> None:
    """``case.fn`` (an XLA reference case) equals the reference called with the case's mask by hand,
    forward or VJP (dsinks included)."""
    import jax
    import jax.numpy as jnp

    from kernel_src import reference_attention

    inputs = case.make_inputs()
    assert [(x.shape, x.dtype.name) for x in inputs] == [(a.shape, a.dtype.name) for a in case.abstract_args]
    q, k, v, *rest = inputs
    d_out = rest.pop(0) if case.scope == "masks-fwd-bwd" else None
    features = {}
    if case.segments:
        features.update(q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
        assert len(set(np.asarray(features["q_segment_ids"])[0])) == case.segments
    sinks = rest.pop(0) if case.sinks else None
    if case.window:
        features["window_size"] = case.window
    if case.softcap:
        features["softcap"] = case.softcap

    def want(q, k, v, s, ids):
        return reference_attention(q, k, v, causal=True, scale=8 ** -0.5, sinks=s, **ids, **features)
    ids = {key: features.pop(key) for key in ("q_segment_ids", "kv_segment_ids") if key in features}
    got = jax.jit(case.fn)(*inputs)
    if d_out is None:
        np.testing.assert_allclose(got, jax.jit(want)(q, k, v, sinks, ids), rtol=1e-6, atol=1e-6)
        return

    @jax.jit
    def want_vjp(q, k, v, s, ids, d_out):
        return jax.vjp(lambda q, k, v, s: want(q, k, v, s, ids), q, k, v, s)[1](d_out)
    expected = want_vjp(q, k, v, jnp.asarray(sinks) if case.sinks else None, ids, d_out)
    assert len(got) == (4 if case.sinks else 3), case.case_id
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    if case.sinks:
        assert np.abs(np.asarray(got[3])).sum() > 0


def _small_cases(scope: str, names: tuple[str, ...]) -> list:
    small = tuple(dataclasses.replace(m, seq_lens=(16,), tokens=32, num_q_heads=4, num_kv_heads=2, head_dim=8,
                                      window=None if m.window is None else (5, 0), documents=m.documents[:1])
                  for m in TINY_MASKS if m.name in names)
    profile = dataclasses.replace(get_profile("tiny"), masks=small, dtype="float32")
    cases, _ = build_cases(profile, (scope,), platform="tpu")
    return [c for c in cases if c.implementation == "xla"]


def test_the_backward_program_passes_window_and_sinks_and_returns_dsinks():
    """On a shrunken float32 copy of the sink model (window and sinks), through the XLA reference."""
    (case,) = _small_cases("masks-fwd-bwd", ("gpt-oss-20b-tiny",))
    _check_program(case)


@pytest.mark.slow
@pytest.mark.parametrize("scope", MASK_SCOPES)
def test_every_program_passes_its_features(scope):
    """Every tiny mask, forward and VJP, on shrunken float32 copies through the XLA reference."""
    cases = _small_cases(scope, tuple(m.name for m in TINY_MASKS))
    assert len(cases) == len(TINY_MASKS)
    for case in cases:
        _check_program(case)


def _with_masks(docs: dict) -> None:
    """Give a synthetic masks-* run's cases the mask fields ``run_case`` writes."""
    cases, _ = build_cases(get_profile(testing.PROFILE), ("masks-fwd",), platform="cpu")
    fields = {c.case_id: c.mask_fields() for c in cases}
    for case in docs["benchmark"]["cases"]:
        case.update(fields[case["case_id"]])


@pytest.fixture(scope="module")
def masked(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("masks"))
    testing.write(ws / "runs", "synthetic-masks", scopes=("masks-fwd",), edit=_with_masks)
    build([ws / "runs" / "synthetic-masks"], ws / "data", allow_interpret=True)
    return ws


def test_the_mask_columns_round_trip_and_older_records_keep_them_null(masked):
    """A synthetic masks-fwd run's rows; the repository's published record (built before masks existed)
    loads with the columns, all null."""
    import pyarrow.parquet as pq

    table = pq.read_table(masked / "data" / "benchmark" / "synthetic-masks.parquet")
    assert table.schema.equals(FEATURES["benchmark"])
    rows = {r["case_id"]: r for r in table.to_pylist()}
    flash = rows["masks-fwd-flash-mistral-7b-tiny-s256"]
    assert (flash["model"], flash["window"], flash["softcap"], flash["segments"], flash["sinks"]) == (
        "mistral-7b-tiny", {"left": 63, "right": 0}, None, None, None)
    assert rows["masks-fwd-xla-gemma-2-9b-tiny-s256"]["softcap"] == 50.0
    assert rows["masks-fwd-flash-gpt-oss-20b-tiny-s256"]["sinks"] is True
    assert rows["masks-fwd-flash-packed-tiny-d4-s256"]["segments"] == 4
    assert rows["masks-fwd-flash-packed-tiny-d4-s256"]["window"] is None
    published = pq.read_table(testing.REPO / "data" / "benchmark" / f"{testing.PUBLISHED}.parquet").to_pylist()
    assert published and all(r[k] is None for r in published for k in ("model", "window", "softcap", "segments",
                                                                          "sinks"))
    card = (masked / "dataset_card.md").read_text().split("<!-- BEGIN GENERATED: masks -->")[1]
    card = card.split("<!-- END GENERATED: masks -->")[0]
    assert "`synthetic-masks`" in card and "mistral-7b-tiny" in card and "yes (not kernel speed)" in card
    assert "| tpu-v5e, gpu | `mistral-7b` | 32 / 8 | 128 | (4095, 0) |" in card


@pytest.mark.parametrize("field,value,rule", [
    ("flops", 4 * 4 * 64 * 256 * 256 * 1.0, r"\[derived\].*flops"),  # causal-dense: the window ignored
    ("window", [64, 0], r"\[case-shape\].*window"),
    ("window", None, r"\[case-shape\].*window"),
    ("sinks", True, r"\[case-shape\].*sinks"),
    ("model", "mistral-7b", r"\[case-shape\].*model"),
])
def test_a_case_whose_flops_or_mask_disagree_is_refused(masked, tmp_path, field, value, rule):
    def edit(docs):
        _with_masks(docs)
        case = next(c for c in docs["benchmark"]["cases"] if c["case_id"] == "masks-fwd-flash-mistral-7b-tiny-s256")
        case[field] = value
    ws = Path(shutil.copytree(masked, tmp_path / "ws", symlinks=True))
    run = testing.write(ws / "runs", "synthetic-bad", scopes=("masks-fwd",), edit=edit)
    with pytest.raises(BuildError, match=rule):
        build([run], ws / "data", allow_interpret=True)


def test_run_case_writes_the_mask_fields():
    from tpu_kernel_records_tools.bench.benchmark import run_case

    (case,) = _small_cases("masks-fwd", ("gpt-oss-20b-tiny",))
    record, _, _ = run_case(case, warmups=0, samples=1, device_kind="cpu", platform="cpu")
    assert record["status"] == "ok", record["error"]
    assert {k: record[k] for k in ("model", "window", "softcap", "segments", "sinks")} == dict(
        model="gpt-oss-20b-tiny", window=[5, 0], softcap=None, segments=None, sinks=True)


@pytest.mark.slow
def test_measure_on_the_tiny_profile_writes_the_mask_cases_and_build_verify_load_carry_them(tmp_path, monkeypatch):
    """The real benchmark (flash in interpret mode, the XLA reference) at the tiny masks, forward: the
    windowed, capped, packed and sink cases; graded on the cheap reference at the quick level (grading
    flash in interpret mode takes many minutes: the measured-kernel choice is tested apart)."""
    import tpu_kernel_records as tkr
    from tpu_kernel_records_tools.builder.verify import verify
    from tpu_kernel_records_tools.measure import run as run_module

    grade = run_module.grade
    monkeypatch.setattr(run_module, "grade", lambda kernels, *, seed, progress, known_bad=None, kernel_level=None, **_: grade(
        ["reference"], seed=seed, progress=progress, known_bad=[], kernel_level="quick"))
    monkeypatch.setattr(run_module, "measured_candidates", lambda profile, scopes: ("reference", ["reference"]))
    run = testing.stand_in_kernel_cards(run_module.run_measure(tmp_path / "run", profile="tiny", warmups=0,
                                                               samples=2, scopes=["masks-fwd"], progress=False))
    bench = json.loads((run / "benchmark.json").read_text())
    by_model = {(c["model"], c["implementation"]): c for c in bench["cases"]}
    assert {m for m, _ in by_model} == {m.name for m in TINY_MASKS}
    assert all(c["status"] == "ok" and c["interpret"] == (c["implementation"] == "flash") for c in bench["cases"])
    assert by_model[("mistral-7b-tiny", "flash")]["window"] == [63, 0]
    assert by_model[("gemma-2-9b-tiny", "flash")]["softcap"] == 50.0
    assert by_model[("packed-tiny", "flash")]["segments"] == 4
    assert by_model[("gpt-oss-20b-tiny", "flash")]["sinks"] is True
    assert by_model[("mistral-7b-tiny", "flash")]["compiled_tpu"] is not None  # compiled for v5e with its window
    ws = testing.workspace(tmp_path / "ws")
    (record,) = build([run], ws / "data", allow_interpret=True)
    assert verify(ws / "data", ws / "dataset_card.md") == []
    rows = tkr.load("benchmark", data_dir=ws / "data", cache_dir=str(tmp_path / "cache"))
    mine = [r for r in rows if r["record_id"] == record]
    assert len(mine) == len(bench["cases"]) and all(r["interpret"] for r in mine)
    loaded = {(r["model"], r["implementation"]): r for r in mine}
    assert loaded[("mistral-7b-tiny", "flash")]["window"] == {"left": 63, "right": 0}
    assert loaded[("packed-tiny", "xla")]["segments"] == 4 and loaded[("gpt-oss-20b-tiny", "xla")]["sinks"]
    assert loaded[("gemma-2-9b-tiny", "xla")]["softcap"] == 50.0
    assert loaded[("mistral-7b-tiny", "flash")]["flops"] == by_model[("mistral-7b-tiny", "flash")]["flops"]
