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
    assert model.num_tokens == q_lens.sum()
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
        q_bytes = 2 * model.num_tokens * model.num_q_heads * model.head_dim * 2
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
