"""The ``ragged`` benchmark scope (issue 54): the serving steps each profile declares (``RaggedModel``: the mix of
decode rows, prefill chunks and whole prompts, the page table, the cache dtypes), their useful work
(``roofline.ragged_work``: checked against a brute-force count of the ragged contract's mask, key by key), the
cases and pairs the scope expands to on each platform, and (slow) their values against the float64 truth."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_src.contract import visible
from tpu_kernel_records_tools.bench import roofline
from tpu_kernel_records_tools.bench.profiles import PROFILES, RAGGED_SCOPES, SCOPES
from tpu_kernel_records_tools.bench.ragged_profiles import KV_DTYPES, MODEL_RAGGED, TINY_RAGGED, RaggedModel


def _brute(q_lens, kv_lens, causal: bool, window) -> tuple[int, int]:
    """(visible pairs, keys some row sees) over the sequences, from the contract's mask on NumPy grids: sequence
    ``i``'s rows are its last ``q_lens[i]`` positions (bottom-right)."""
    pairs = keys = 0
    for q_len, length in zip(q_lens, kv_lens):
        if length <= 0 or q_len <= 0:
            continue
        mask = np.broadcast_to(visible(np.arange(q_len)[:, None], np.arange(length)[None, :], int(q_len),
                                       int(length), causal, int(length), window), (int(q_len), int(length)))
        pairs, keys = pairs + int(mask.sum()), keys + int(mask.any(axis=0).sum())
    return pairs, keys


def test_ragged_work_equals_a_brute_force_count_of_the_contract_mask():
    """Random steps: q_len 0 to kv_len per sequence (decode rows, chunks, whole prompts, empty), causal or not,
    windows with either side unbounded, the cache at 1 or 2 bytes and q at 2 or 4."""
    rng = np.random.default_rng(54)
    for _ in range(100):
        kv_lens = rng.integers(0, 41, int(rng.integers(1, 6)))
        q_lens = np.array([int(rng.integers(0, n + 1)) for n in kv_lens])
        hq, hk, d = 4, 2, 8
        kv_size, q_size = int(rng.choice([1, 2])), int(rng.choice([2, 4]))
        causal = bool(rng.integers(2))
        window = None if rng.integers(3) == 0 else tuple(
            None if rng.integers(3) == 0 else int(rng.integers(0, 12)) for _ in range(2))
        flops, nbytes = roofline.ragged_work(q_lens, kv_lens, hq, hk, d, kv_size, q_size, causal, window)
        pairs, keys = _brute(q_lens, kv_lens, causal, window)
        assert flops == 4.0 * hq * d * pairs, (q_lens, kv_lens, causal, window)
        assert nbytes == 2 * keys * hk * d * kv_size + 2 * q_lens.sum() * hq * d * q_size, (q_lens, kv_lens, window)


def test_paged_work_is_ragged_work_with_equal_rows_and_one_dtype():
    lengths = np.array([5, 17, 33])
    assert roofline.paged_work(lengths, 3, 4, 2, 8, 2) == roofline.ragged_work(
        np.full(3, 3), lengths, 4, 2, 8, 2, 2)


@pytest.mark.parametrize("model", MODEL_RAGGED + TINY_RAGGED, ids=lambda m: m.name)
def test_a_step_mixes_decode_rows_chunks_and_a_whole_prompt(model: RaggedModel):
    q_lens, kv_lens = model.mix()
    assert q_lens.dtype == kv_lens.dtype == np.int32 and len(q_lens) == len(kv_lens) == model.num_seqs
    assert (q_lens[:model.decode_rows] == 1).all() and kv_lens[0] == model.decode_context
    assert len(set(kv_lens[:model.decode_rows].tolist())) == model.decode_rows  # distinct, ragged lengths
    assert ((1 < q_lens) & (q_lens < kv_lens)).sum() == len(model.chunks) >= 1  # prefill chunks
    assert ((1 < q_lens) & (q_lens == kv_lens)).sum() == len(model.prompts) >= 1  # whole prompts
    assert model.rows == q_lens.sum() and model.num_tokens % 16 == 0 and 0 <= model.num_tokens - model.rows < 16
    assert set(model.kv_dtypes) == set(KV_DTYPES)  # bf16 and fp8 caches
    assert model.variants() == [(p, t) for p in model.page_sizes for t in model.kv_dtypes]


@pytest.mark.parametrize("model", MODEL_RAGGED + TINY_RAGGED, ids=lambda m: m.name)
def test_the_page_table_gives_each_sequence_its_own_pages_permuted_over_the_pool(model: RaggedModel):
    _, kv_lens = model.mix()
    for page_size in model.page_sizes:
        table, pool = model.page_table(page_size)
        pages = -(-kv_lens // page_size)
        assert table.dtype == np.int32 and table.shape == (model.num_seqs, pages.max())
        used = np.concatenate([table[i, :n] for i, n in enumerate(pages)])
        assert sorted(used.tolist()) == list(range(pool))  # every pool page once: distinct, none idle
        assert (used != np.arange(pool)).any()  # permuted, as an allocator leaves them
        assert ((table >= 0) & (table < pool)).all()
        again, _ = model.page_table(page_size)
        assert (again == table).all()  # a function of the case alone


def test_the_models_heads_and_the_work_at_each_cache_dtype():
    heads = {m.name: (m.num_q_heads, m.num_kv_heads, m.head_dim) for m in MODEL_RAGGED}
    assert heads == {"llama-3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
    assert all(m.plan for m in MODEL_RAGGED)
    for model in MODEL_RAGGED + TINY_RAGGED:
        q_lens, kv_lens = model.mix()
        (f2, b2), (f1, b1) = model.work(2), model.work(1)
        pairs, keys = _brute(q_lens, kv_lens, True, None)
        assert f1 == f2 == 4.0 * model.num_q_heads * model.head_dim * pairs
        q_bytes = 2 * model.rows * model.num_q_heads * model.head_dim * 2
        assert (b2, b1) == tuple(q_bytes + 2 * keys * model.num_kv_heads * model.head_dim * s for s in (2, 1))


def test_the_xla_reference_joins_only_where_its_gathered_rows_fit():
    fits = {m.name: m.xla_fits() for m in MODEL_RAGGED + TINY_RAGGED}
    assert fits == {"llama-3-8b": False, "qwen2.5-7b": True, "llama-3-8b-tiny": True}
    qwen = MODEL_RAGGED[1]
    assert qwen.xla_bytes() == qwen.num_tokens * 2048 * (2 * 4 * 4 * 128 + 2 * 4 * 28)


def test_every_profile_has_ragged_steps_and_the_scope():
    assert RAGGED_SCOPES == ("ragged",) and "ragged" in SCOPES
    for profile in PROFILES.values():
        assert profile.ragged, profile.name
    for name in ("cpu", "tpu-v5e", "gpu", "h100"):
        assert "ragged" in PROFILES[name].scopes, name
    assert PROFILES["tpu-v5e"].ragged == PROFILES["gpu"].ragged == MODEL_RAGGED
    assert PROFILES["cpu"].ragged == TINY_RAGGED and len(TINY_RAGGED) == 1  # interpret mode: one tiny step


def test_a_bad_model_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no multiple"):
        RaggedModel("m", 6, 4, 64, 1, 16, ((2, 8),), (4,))
    with pytest.raises(ValueError, match="1 < q_len < kv_len"):
        RaggedModel("m", 4, 2, 64, 1, 16, ((8, 8),), (4,))
    with pytest.raises(ValueError, match="cache dtypes"):
        RaggedModel("m", 4, 2, 64, 1, 16, ((2, 8),), (4,), kv_dtypes=("int4",))


# --- the scope's cases ------------------------------------------------------------------------------------------

def _ragged(profile: str, platform: str):
    from tpu_kernel_records_tools.bench.cases import build_cases, get_profile

    return build_cases(get_profile(profile), ("ragged",), platform=platform)


@pytest.mark.parametrize("platform, kernel, vendor", [("cpu", "ragged-pallas", None), ("tpu", "ragged-pallas", "jax-ragged"),
                                                      ("gpu", "ragged-triton", None)])
def test_the_scope_times_the_kernel_the_reference_where_it_fits_and_jax_on_a_tpu(platform, kernel, vendor):
    cases, pairs = _ragged("cpu" if platform == "cpu" else "tpu-v5e", platform)
    models = TINY_RAGGED if platform == "cpu" else MODEL_RAGGED
    want = [(f"ragged-{impl}-{m.name}-p{p}-{t}", impl) for m in models for p, t in m.variants()
            for impl in ("ragged-xla", kernel, vendor) if impl and (impl != "ragged-xla" or m.xla_fits())]
    assert sorted((c.case_id, c.implementation) for c in cases) == sorted(want)
    by_id = {c.case_id: c for c in cases}
    for pair in pairs:
        top, bottom = by_id[pair.numerator], by_id[pair.denominator]
        assert (top.model, top.page_size, top.kv_dtype) == (bottom.model, bottom.page_size, bottom.kv_dtype)
    assert {(by_id[p.numerator].implementation, by_id[p.denominator].implementation) for p in pairs} == (
        {(kernel, "ragged-xla")} | ({(vendor, "ragged-xla"), (kernel, vendor)} if vendor else set()))
    assert all(c.interpret == (platform == "cpu" and c.implementation == kernel) for c in cases)


def test_a_case_carries_its_step_and_its_work():
    cases, _ = _ragged("tpu-v5e", "tpu")
    model = MODEL_RAGGED[0]
    for case in (c for c in cases if c.model == model.name):
        table, pool = model.page_table(case.page_size)
        fp8 = case.kv_dtype == "float8_e4m3fn"
        assert case.mask_fields() == dict(model=model.name, window=None, softcap=None, segments=None, sinks=None,
                                          page_size=case.page_size, pages=table.shape[1], pool_pages=pool,
                                          num_seqs=67, q_rows=2088, kv_dtype=case.kv_dtype, quantized_kv=fp8)
        assert case.shape == dict(batch=67, q_len=2096, kv_len=8192, num_q_heads=32, num_kv_heads=8, head_dim=128)
        assert (case.flops, case.bytes_moved) == model.work(1 if fp8 else 2, 2) and case.seq_len == 8192
        pools = [a.shape for a in case.abstract_args[1:-4]]
        heads = [(pool, case.page_size, 16, 128)] if case.implementation == "jax-ragged" else [
            (pool, case.page_size, 8, 128)] * 2
        assert pools == heads and case.abstract_args[1].dtype == np.dtype(case.kv_dtype)


def test_every_implementation_gets_the_same_values_jax_its_pool_interleaved():
    from tpu_kernel_records_tools.bench import ragged_cases

    cases, _ = _ragged("cpu", "tpu")  # the tiny step as a TPU would time it
    fp8 = [c for c in cases if c.kv_dtype == "float8_e4m3fn"]
    inputs = {c.implementation: c.make_inputs() for c in fp8}
    ours, xla, jax_kv = inputs["ragged-pallas"], inputs["ragged-xla"], inputs["jax-ragged"]
    for a, b in zip(ours, xla):
        assert a.dtype == b.dtype and (a.view(np.uint8) == b.view(np.uint8)).all()
    k, v = ours[1], ours[2]
    assert (jax_kv[1][:, :, 0::2].view(np.uint8) == k.view(np.uint8)).all()  # K at even heads
    assert (jax_kv[1][:, :, 1::2].view(np.uint8) == v.view(np.uint8)).all()  # V at odd
    assert all((a == b).all() for a, b in zip(jax_kv[2:], ours[3:]))
    assert ragged_cases.QUANTIZED_SCALES == (0.5, 0.25)
    assert abs(float(np.std(k.astype(np.float32))) * 0.5 - 1) < 0.05  # stored = N(0, 1) / k_scale


def _truth(inputs, model: RaggedModel, scales) -> np.ndarray:
    """Float64 attention of every graded row, from the contract's definitions (keys through the table, bottom-right
    causal, a quantized key ``float32(stored) * k_scale``)."""
    q, k, v, kv_lens, table, cu, _ = inputs
    page_size, group = k.shape[1], model.num_q_heads // model.num_kv_heads
    out = np.zeros(q.shape)
    for i, length in enumerate(kv_lens):
        keys = np.concatenate([k[p] for p in table[i]])[:length].astype(np.float64) * scales[0]
        vals = np.concatenate([v[p] for p in table[i]])[:length].astype(np.float64) * scales[1]
        for r in range(cu[i], cu[i + 1]):
            seen = length - (cu[i + 1] - cu[i]) + (r - cu[i]) + 1
            for h in range(model.num_q_heads):
                s = keys[:seen, h // group] @ q[r, h].astype(np.float64) * model.head_dim ** -0.5
                p = np.exp(s - s.max())
                out[r, h] = p @ vals[:seen, h // group] / p.sum()
    assert page_size == 16
    return out


def test_the_xla_cases_compute_the_step_the_records_describe():
    """The timed XLA programs (cheap here) against a float64 truth of the step: the mix, the table, the scales."""
    import jax

    cases, _ = _ragged("cpu", "cpu")
    model = TINY_RAGGED[0]
    for case in (c for c in cases if c.implementation == "ragged-xla"):
        inputs = case.make_inputs()
        out = np.asarray(jax.jit(case.fn)(*inputs).astype(np.float32))
        scales = (0.5, 0.25) if case.quantized_kv else (1.0, 1.0)
        np.testing.assert_allclose(out[:model.rows], _truth(inputs, model, scales)[:model.rows], atol=4e-2)


def test_jax_ragged_gets_its_own_pool_scale_and_python_float_scales(monkeypatch):
    """JAX's kernel cannot run on a CPU (its interpret mode fails): a stand-in in its place records the call."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module
    from kernel_src.vendor import jax_ragged_paged_attention

    seen = {}

    def stand_in(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        seen.update(options, kv_pages=kv_pages, dtypes={x.dtype for x in (kv_lens, page_indices, cu_q_lens, num_seqs)})
        return q.astype(jnp.float32)

    monkeypatch.setattr(module, "ragged_paged_attention", stand_in)
    q, kv = jnp.ones((16, 4, 128), jnp.bfloat16), jnp.zeros((3, 16, 4, 128), jnp.float8_e4m3fn)
    ints = [jnp.array([5], jnp.int16), jnp.zeros((1, 1), jnp.int16), jnp.array([0, 5], jnp.int16),
            jnp.array([1], jnp.int16)]
    out = jax_ragged_paged_attention(q, kv, kv_lengths=ints[0], page_indices=ints[1], cu_q_lens=ints[2],
                                     num_seqs=ints[3], k_scale=0.5, v_scale=np.float32(0.25))
    assert out.dtype == jnp.bfloat16 and seen["kv_pages"] is kv and seen["dtypes"] == {jnp.dtype(jnp.int32)}
    assert seen["sm_scale"] == 128 ** -0.5 and type(seen["k_scale"]) is type(seen["v_scale"]) is float
    assert (seen["k_scale"], seen["v_scale"]) == (0.5, 0.25)
    with pytest.raises(ValueError, match="causal only"):
        jax_ragged_paged_attention(q, kv, kv_lengths=ints[0], page_indices=ints[1], cu_q_lens=ints[2],
                                   num_seqs=ints[3], causal=False)


def test_a_profile_without_ragged_steps_is_refused_in_one_line():
    import dataclasses
    from tpu_kernel_records_tools.bench.cases import build_cases

    bare = dataclasses.replace(PROFILES["cpu"], ragged=())
    with pytest.raises(ValueError, match="has no ragged serving steps"):
        build_cases(bare, ("ragged",), platform="cpu")
