"""The paged contract's float64 truth, its pure-JAX reference and its argument checks (issue 36).

The truth (``grading.paged.truth``) is checked against a hand-written loop over keys on tiny pools laid out
as the rubric lays them out (permuted, shared, NaN wherever no key is), against the dense truth on a
contiguous identity table, and against the dense contract on the gathered cache (``dense_twin``); the
reference is checked against the truth and for garbage that must not leak."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import truth as oracle

from tpu_kernel_records_tools.grading.paged import truth as paged_oracle
from tpu_kernel_records_tools.grading.paged.problems import draw, layout
from tpu_kernel_records_tools.grading.paged.slots import PagedSlot
from kernel_src.contract import check_paged_inputs
from kernel_src.reference import reference_paged_attention


def _slot(lengths, *, batch=None, q_len=3, hq=4, hk=2, d=8, ps=4, pps=5, dtype="float32", pool=40):
    return PagedSlot("tiny", batch or len(lengths), q_len, hq, hk, d, ps, pps, pool, tuple(lengths), dtype)


def _loop(p, window=None, softcap=None, sinks=None) -> np.ndarray:
    """The contract read literally: one row, one head, one key at a time, in float64."""
    q, kp, vp = (np.asarray(x).astype(np.float64) for x in (p.q, p.k_pages, p.v_pages))
    b_, lq, hq, d = q.shape
    ps, hk = kp.shape[1], kp.shape[2]
    scale = d ** -0.5 if p.scale is None else p.scale
    out = np.zeros(q.shape)
    for b in range(b_):
        n = int(p.lengths[b])
        for i in range(lq):
            pos = n - lq + i
            for h in range(hq):
                logits, values = [], []
                for j in range(n):
                    if p.causal and j > pos:
                        continue
                    if window is not None and ((window[0] is not None and j < pos - window[0]) or
                                               (window[1] is not None and j > pos + window[1])):
                        continue
                    page, slot = p.table[b, j // ps], j % ps
                    s = scale * q[b, i, h] @ kp[page, slot, h // (hq // hk)]
                    logits.append(softcap * np.tanh(s / softcap) if softcap else s)
                    values.append(vp[page, slot, h // (hq // hk)])
                if not logits:
                    continue
                top = max(logits + ([sinks[h]] if sinks is not None else []))
                e = np.exp(np.array(logits) - top)
                denom = e.sum() + (np.exp(sinks[h] - top) if sinks is not None else 0.0)
                out[b, i, h] = (e[:, None] * np.array(values)).sum(0) / denom
    return out


CASES = [dict(), dict(causal=False), dict(window=(3, 0)), dict(causal=False, window=(2, 3)), dict(softcap=2.0),
         dict(sinks=np.array([0.5, -1.0, 2.0, 0.0]))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_truth_is_the_contract_read_key_by_key(case):
    """Edge lengths (0, 1, page_size +- 1, a multiple, the full table) and q_len 3 > some lengths (rows with
    no key), on a permuted, shared, NaN-filled pool."""
    kw = dict(CASES[case])
    causal = kw.pop("causal", True)
    rng = np.random.default_rng(case)
    p = draw(rng, _slot((0, 1, 3, 4, 5, 8, 20, 13)), causal=causal, q_boost=3.0, **kw)
    assert np.isnan(p.k_pages[~p.holds]).all() and p.table.max() < p.k_pages.shape[0]
    want = _loop(p, kw.get("window"), kw.get("softcap"), kw.get("sinks"))
    t = p.truth
    assert np.allclose(t.out, want, rtol=1e-12, atol=1e-12)
    empty = np.array([[p.lengths[b] == 0 or (causal and p.lengths[b] - 3 + i < 0) for i in range(3)]
                      for b in range(8)])
    if "window" not in kw:
        assert (t.empty == empty).all()
    assert (t.out[t.empty] == 0).all()


def test_truth_is_the_dense_truth_on_a_contiguous_identity_table():
    rng = np.random.default_rng(7)
    b, lq, hq, hk, d, ps, pps = 3, 5, 6, 3, 16, 8, 4
    q = rng.standard_normal((b, lq, hq, d))
    k, v = rng.standard_normal((2, b, pps * ps, hk, d))
    table = np.arange(b * pps).reshape(b, pps)
    for lengths in ([pps * ps] * b, [0, 9, pps * ps]):
        for causal in (True, False):
            got = paged_oracle.paged_attention(q, k.reshape(-1, ps, hk, d), v.reshape(-1, ps, hk, d),
                                               kv_lengths=lengths, page_indices=table, causal=causal).out
            if lengths[0]:  # every sequence full: the dense contract's own alignment
                want = oracle.attention(q, k, v, causal=causal, kv_lengths=lengths).out
            else:  # one sequence at a time, its own length (the dense causal aligns on kv_len)
                want = np.concatenate([oracle.attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal).out
                                       if n else np.zeros((1, lq, hq, d)) for i, n in enumerate(lengths)])
            assert np.allclose(got, want, rtol=1e-13, atol=1e-14)
    # The trap: the dense contract on the whole table aligns rows on its end, not on each length.
    short = paged_oracle.paged_attention(q, k.reshape(-1, ps, hk, d), v.reshape(-1, ps, hk, d),
                                         kv_lengths=[9, 9, 9], page_indices=table).out
    aligned = oracle.attention(q, k, v, causal=True, kv_lengths=[9, 9, 9]).out
    assert not np.allclose(short, aligned)


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (5, 0)), (False, (4, 2))])
def test_truth_is_the_dense_contract_on_the_gathered_cache(causal, window):
    """``dense_twin``: right-aligned caches, segment ids before shorter sequences (the paged-dense check)."""
    rng = np.random.default_rng(3)
    p = draw(rng, _slot((0, 2, 4, 7, 20, 11), q_len=4), causal=causal, window=window)
    twin = paged_oracle.dense_twin(4, p.k_pages, p.v_pages, p.lengths, p.table)
    assert np.isfinite(twin.k.astype(np.float32)).all()
    dense = oracle.attention(p.q, twin.k, twin.v, causal=causal, window=window, q_segment_ids=twin.q_segment_ids,
                             kv_segment_ids=twin.kv_segment_ids).out
    assert np.allclose(dense, p.truth.out, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_matches_the_truth_and_garbage_does_not_leak(dtype):
    rng = np.random.default_rng(11)
    p = draw(rng, _slot((0, 1, 3, 4, 5, 8, 20, 13), dtype=dtype))
    out = np.asarray(reference_paged_attention(jnp.asarray(p.q), jnp.asarray(p.k_pages), jnp.asarray(p.v_pages),
                                               **p.kwargs))
    assert out.dtype == p.q.dtype and np.isfinite(out.astype(np.float32)).all()
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert np.allclose(out.astype(np.float64), p.truth.out, atol=tol)
    assert (out[p.truth.empty] == 0).all()
    for kind in ("inf", "huge"):
        again = p.refilled(kind, rng)
        same = np.asarray(reference_paged_attention(jnp.asarray(again.q), jnp.asarray(again.k_pages),
                                                    jnp.asarray(again.v_pages), **again.kwargs))
        assert np.array_equal(same.view(np.uint8), out.view(np.uint8)), kind


def test_layout_is_permuted_shared_and_nan_padded():
    slot = _slot((0, 1, 3, 4, 5, 8, 20, 13, 20, 17), pool=60)
    tables = [layout(np.random.default_rng(s), slot)[0] for s in range(6)]
    used = [-(-n // 4) for n in slot.lengths]
    assert any(len({tuple(t[b, :2]) for b in range(10) if used[b] >= 2}) < sum(u >= 2 for u in used)
               for t in tables), "no shared prefix in six layouts"
    table, holds = layout(np.random.default_rng(0), slot)
    for b, u in enumerate(used):
        if u < slot.pages_per_sequence:
            assert not holds[table[b, u]].any(), "the first trailing entry must be a page with no key"


@pytest.mark.parametrize("bad, message", [
    (dict(q=np.zeros((2, 3, 4))), "q must be 4-D"),
    (dict(k_pages=np.zeros((5, 4, 3, 8), np.float32), v_pages=np.zeros((5, 4, 3, 8), np.float32)),
     "num_q_heads (4) must be a multiple of num_kv_heads (3)"),
    (dict(k_pages=np.zeros((5, 4, 3, 8), np.float32)), "k_pages and v_pages must have the same shape"),
    (dict(page_indices=np.zeros((2, 5), np.float32)), "page_indices must be an int32 array"),
    (dict(page_indices=np.zeros((3, 5), np.int32)), "page_indices must have shape [batch=2"),
    (dict(kv_lengths=np.zeros((3,), np.int32)), "kv_lengths must have shape [batch]=(2,)"),
    (dict(q=np.zeros((2, 0, 4, 8), np.float32)), "q_len must be >= 1"),
    (dict(v_pages=np.zeros((5, 4, 2, 8), np.float16)), "v_pages must be bfloat16 or float32"),
    (dict(kv_lengths=None), "kv_lengths is required"),
])
def test_a_malformed_argument_is_one_line_naming_it(bad, message):
    args = dict(q=np.zeros((2, 3, 4, 8), np.float32), k_pages=np.zeros((5, 4, 2, 8), np.float32),
                v_pages=np.zeros((5, 4, 2, 8), np.float32), kv_lengths=np.zeros((2,), np.int32),
                page_indices=np.zeros((2, 5), np.int32))
    args.update(bad)
    args = {n: None if x is None else jnp.asarray(x) for n, x in args.items()}
    with pytest.raises((ValueError, TypeError)) as e:
        check_paged_inputs(args["q"], args["k_pages"], args["v_pages"], args["kv_lengths"], args["page_indices"])
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises((ValueError, TypeError), match=None) as e:
        reference_paged_attention(args.pop("q"), args.pop("k_pages"), args.pop("v_pages"), **args)
    assert "\n" not in str(e.value)
