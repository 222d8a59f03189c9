"""The ragged paged contract's float64 truth, its pure-JAX reference, the dequantize rule and the argument checks
(issue 53).

The truth (``grading.ragged.truth``) is checked against the contract read literally (one row, head and key at a
time) on tiny ragged batches: decode rows, chunks and whole prompts mixed, q_len = 0 sequences between others,
padding rows and every slot no key is on holding NaN, garbage after ``num_seqs``, a permuted pool, fp8 and int8
pools; the reference is checked against the truth on the same batches."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.ragged import truth as ragged_oracle
from kernel_src.contract import RAGGED_FEATURES, check_ragged_inputs, dequantize, supports
from kernel_src.reference import reference_ragged_paged_attention, row_owners

PS, PPS, HQ, HK, D = 4, 4, 4, 2, 8


def batch(rng, q_lens, kv_lens, *, max_seqs=None, tokens=None, kv_dtype=np.float32, pool=24):
    """A ragged call: sequences with ``q_lens``/``kv_lens`` on distinct random pages of a NaN-filled pool,
    ``max_seqs`` table rows (garbage after the real ones), ``tokens`` rows (NaN padding after the last)."""
    n, max_seqs = len(q_lens), max_seqs or len(q_lens) + 2
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = tokens or int(cu[-1]) + 3
    q = rng.standard_normal((tokens, HQ, D)).astype(np.float32)
    q[cu[-1]:] = np.nan
    fill = np.nan if np.dtype(kv_dtype).kind == "f" else 127
    k, v = (np.full((pool, PS, HK, D), fill, np.float32) for _ in range(2))
    table = rng.integers(0, pool, (max_seqs, PPS)).astype(np.int32)  # garbage rows and trailing entries
    free = list(rng.permutation(pool))
    for i, length in enumerate(kv_lens):
        for c in range(-(-length // PS)):
            table[i, c] = free.pop()
            for s in range(min(PS, length - c * PS)):
                k[table[i, c], s], v[table[i, c], s] = rng.standard_normal((2, HK, D)) * (30 if kv_dtype != np.float32
                                                                                          else 1)
    lengths = rng.integers(0, PPS * PS + 1, max_seqs).astype(np.int32)
    lengths[:n] = kv_lens
    cu_full = rng.integers(0, tokens + 1, max_seqs + 1).astype(np.int32)  # unsorted garbage after num_seqs
    cu_full[:n + 1] = cu
    return dict(q=q, k_pages=k.astype(kv_dtype), v_pages=v.astype(kv_dtype), kv_lengths=lengths, page_indices=table,
                cu_q_lens=cu_full, num_seqs=np.array([n], np.int32))


def literal(c, *, causal=True, window=None, softcap=None, sinks=None, k_scale=None, v_scale=None) -> np.ndarray:
    """The contract read literally, in float64: each graded row, head and key on its own."""
    q = c["q"].astype(np.float64)
    kp, vp = (c[n].astype(np.float64) * (1.0 if s is None else s) for n, s in (("k_pages", k_scale),
                                                                                ("v_pages", v_scale)))
    out = np.zeros(q.shape)
    cu, n = c["cu_q_lens"], int(c["num_seqs"][0])
    for r in range(q.shape[0]):
        owners = [i for i in range(n) if cu[i] <= r < cu[i + 1]]
        if not owners:
            continue
        i = owners[0]
        length = int(c["kv_lengths"][i])
        pos = length - int(cu[i + 1] - cu[i]) + r - int(cu[i])
        for h in range(HQ):
            logits, values = [], []
            for t in range(length):
                if (causal and t > pos) or (window and ((window[0] is not None and t < pos - window[0]) or
                                                        (window[1] is not None and t > pos + window[1]))):
                    continue
                page, slot = c["page_indices"][i, t // PS], t % PS
                s = D ** -0.5 * q[r, h] @ kp[page, slot, h // (HQ // HK)]
                logits.append(softcap * np.tanh(s / softcap) if softcap else s)
                values.append(vp[page, slot, h // (HQ // HK)])
            top = max(logits + ([sinks[h]] if sinks is not None else []))
            e = np.exp(np.array(logits) - top)
            out[r, h] = (e[:, None] * np.array(values)).sum(0) / (e.sum() + (np.exp(sinks[h] - top) if sinks is not
                                                                               None else 0.0))
    return out


# decode rows, a chunk, a whole prompt, q_len = 0 sequences first, between others and last
MIX = ([1, 0, 3, 5, 0, 1, 0], [9, 0, 7, 5, 16, 1, 3])
CASES = [dict(), dict(causal=False), dict(window=(2, 0)), dict(causal=False, window=(3, 2)), dict(softcap=1.5),
         dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
         dict(window=(5, 0), softcap=2.0, sinks=np.array([1.0, 0.0, -2.0, 3.0], np.float32))]


def _truth(c, **kw):
    window = kw.pop("window", None)
    return ragged_oracle.ragged_paged_attention(**c, window=window, **kw)


def _reference(c, **kw):
    window = kw.pop("window", None)
    arrays = {n: jnp.asarray(x) for n, x in c.items()}
    return np.asarray(reference_ragged_paged_attention(**arrays, window_size=window, **{
        n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}))


@pytest.mark.parametrize("flags", CASES, ids=lambda f: "+".join(f) or "causal")
def test_truth_is_the_contract_read_literally_and_the_reference_agrees(flags):
    c = batch(np.random.default_rng(0), *MIX)
    t = _truth(c, **flags)
    graded = t.graded
    cu = c["cu_q_lens"]
    assert graded.sum() == cu[c["num_seqs"][0]] and not graded[cu[7]:].any()
    np.testing.assert_allclose(t.out[graded], literal(c, **flags)[graded], rtol=1e-12, atol=1e-12)
    ref = _reference(c, **flags)
    assert np.isfinite(ref[graded]).all()
    np.testing.assert_allclose(ref[graded], t.out[graded], rtol=2e-5, atol=2e-5)
    assert (ref[~graded] == 0).all()  # padding rows: zeros, though their q is NaN


def test_nothing_after_num_seqs_and_no_padding_row_changes_a_bit_of_the_reference():
    rng = np.random.default_rng(1)
    c = batch(rng, *MIX, max_seqs=10)
    base = _reference(c)
    graded = _truth(c).graded
    other = dict(c)
    n = int(c["num_seqs"][0])
    other["kv_lengths"] = c["kv_lengths"].copy()
    other["kv_lengths"][n:] = rng.integers(0, PS * PPS + 1, 10 - n)
    other["page_indices"] = c["page_indices"].copy()
    other["page_indices"][n:] = rng.integers(0, 24, (10 - n, PPS))
    other["cu_q_lens"] = c["cu_q_lens"].copy()
    other["cu_q_lens"][n + 1:] = rng.permutation(np.arange(11 - n - 1)) % (c["q"].shape[0] + 1)
    other["q"] = c["q"].copy()
    other["q"][~graded] = np.inf
    assert np.array_equal(_reference(other)[graded].view(np.uint32), base[graded].view(np.uint32))
    owner, ok = row_owners(jnp.asarray(other["cu_q_lens"]), jnp.asarray(other["num_seqs"]), other["q"].shape[0])
    assert (np.asarray(ok) == graded).all() and (np.asarray(owner)[graded] == _truth(c).owner[graded]).all()


def test_a_permuted_pool_changes_no_bit_of_the_truth_or_the_reference():
    rng = np.random.default_rng(2)
    c = batch(rng, *MIX)
    perm = rng.permutation(c["k_pages"].shape[0])
    moved = dict(c, page_indices=perm[c["page_indices"]].astype(np.int32))
    for name in ("k_pages", "v_pages"):
        moved[name] = np.empty_like(c[name])
        moved[name][perm] = c[name]
    graded = _truth(c).graded
    assert np.array_equal(_truth(moved).out, _truth(c).out)
    assert np.array_equal(_reference(moved)[graded], _reference(c)[graded])


@pytest.mark.parametrize("kv_dtype", [ml_dtypes.float8_e4m3fn, np.int8], ids=["fp8", "int8"])
def test_quantized_pools_are_dequantized_as_stored(kv_dtype):
    c = batch(np.random.default_rng(3), *MIX, kv_dtype=kv_dtype)
    scales = dict(k_scale=float(np.float32(0.0123)), v_scale=float(np.float32(37.5)))
    t = _truth(c, **scales)
    np.testing.assert_allclose(t.out[t.graded], literal(c, **scales)[t.graded], rtol=1e-12, atol=1e-12)
    ref = _reference(c, k_scale=jnp.float32(scales["k_scale"]), v_scale=scales["v_scale"])
    np.testing.assert_allclose(ref[t.graded], t.out[t.graded], rtol=2e-5, atol=2e-5 * scales["v_scale"])
    unscaled = _truth(c)  # the stored numbers alone: a kernel that forgets the scales is far off
    assert not np.allclose(unscaled.out[t.graded], t.out[t.graded], rtol=0.1)


def test_dequantize_is_float32_stored_times_scale():
    stored = jnp.asarray(np.array([-128, -1, 0, 3, 127], np.int8))
    got = np.asarray(dequantize(stored, 0.1))
    assert got.dtype == np.float32 and (got == np.float32([-128, -1, 0, 3, 127]) * np.float32(0.1)).all()


def test_bf16_q_rounds_the_dequantized_pool_in_the_reference_only():
    c = batch(np.random.default_rng(4), *MIX, kv_dtype=ml_dtypes.float8_e4m3fn)
    c["q"] = c["q"].astype(ml_dtypes.bfloat16)
    t = _truth(c, k_scale=0.37, v_scale=3.3)
    ref = _reference(c, k_scale=0.37, v_scale=3.3)
    assert ref.dtype == ml_dtypes.bfloat16
    err = np.abs(ref[t.graded].astype(np.float64) - t.out[t.graded]).max() / np.abs(t.out[t.graded]).max()
    assert 0 < err < 2e-2


def _args(**changes):
    c = batch(np.random.default_rng(5), [1, 2], [3, 4])
    c = {n: jnp.asarray(x) for n, x in c.items()}
    c.update(changes)
    return c


@pytest.mark.parametrize("changes, error", [
    (dict(q=jnp.zeros((4, 4, 2, 8))), "q must be 3-D"),
    (dict(q=jnp.zeros((4, 4, 8), jnp.float16)), "q must be bfloat16 or float32"),
    (dict(q=jnp.zeros((4, 3, 8))), "multiple of num_kv_heads"),
    (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), r"cu_q_lens must have shape \[max_seqs \+ 1\]=\(5,\)"),
    (dict(num_seqs=jnp.int32(2)), r"num_seqs must have shape \[1\]"),
    (dict(kv_lengths=jnp.zeros((4,), jnp.float32)), "kv_lengths must be an int32 array"),
    (dict(k_pages=jnp.zeros((24, 4, 2, 8), jnp.bfloat16), v_pages=jnp.zeros((24, 4, 2, 8), jnp.bfloat16)),
     "the pool must be in q's dtype"),
    (dict(k_pages=jnp.zeros((24, 4, 2, 8), jnp.int8), v_pages=jnp.zeros((24, 4, 2, 8), jnp.int8)),
     "needs both k_scale and v_scale"),
    (dict(k_pages=jnp.zeros((24, 4, 2, 8), jnp.int8)), "k_pages and v_pages must share a dtype"),
    (dict(k_scale=1.0, v_scale=1.0), "apply to a quantized pool"),
    (dict(page_indices=jnp.zeros((4,), jnp.int32)), "page_indices must be int32"),
])
def test_bad_arguments_get_one_line_naming_them(changes, error):
    c = _args(**changes)
    arrays = [c.pop(n) for n in ("q", "k_pages", "v_pages", "kv_lengths", "page_indices", "cu_q_lens", "num_seqs")]
    with pytest.raises((ValueError, TypeError), match=error) as e:
        check_ragged_inputs(*arrays, **c)
    assert "\n" not in str(e.value)


def test_the_dims_and_the_features():
    c = _args()
    dims = check_ragged_inputs(*c.values())
    assert (dims.num_tokens, dims.max_seqs, dims.group, dims.max_length, dims.quantized) == (6, 4, 2, 16, False)
    assert RAGGED_FEATURES == ("window", "softcap", "sinks", "quantized_kv")
    assert reference_ragged_paged_attention.features == RAGGED_FEATURES
    assert supports("quantized_kv", "window")(lambda: 0).features == ("window", "quantized_kv")
