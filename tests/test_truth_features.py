"""The float64 truth of the contract's features (windows, soft-caps, segment ids, sinks) checked by
derivations that share no code with it: ``jax.vjp`` of a float64 formulation written here (an explicit
position per row, the cap and the sink written out, ``jax_enable_x64`` inside these tests only), central
finite differences of the truth's own forward output (in q, k, v and sinks), and masks written out by
hand for small cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_truth import _close, x64
from tpu_kernel_records_tools.grading.dense import truth as oracle

# name: (batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim, causal, kv_lengths, scale, features)
SEG_Q = [[0, 1, 1, 0, 2], [3, 3, 3, 3, 3]]
SEG_KV = [[0, 0, 1, 1, 0, 0, 2, 1], [3, 3, 3, 4, 4, 3, 3, 3]]
PROBLEMS = {
    "window-causal-decode-lengths": (3, 2, 9, 4, 2, 4, True, [9, 4, 0], None, {"window": (3, 0)}),
    "window-two-sided-ahead": (2, 7, 5, 2, 1, 8, False, None, 0.4, {"window": (1, 2)}),
    "window-left-only-causal-long-q": (1, 8, 6, 2, 2, 4, True, None, None, {"window": (None, 1)}),
    "softcap-past-the-cap": (2, 5, 7, 4, 2, 8, True, [7, 3], 1.7, {"softcap": 2.0}),
    "segments-repeated-ids": (2, 5, 8, 2, 1, 4, False, [8, 6], None,
                              {"q_segment_ids": SEG_Q, "kv_segment_ids": SEG_KV}),
    "sinks-group-causal": (2, 6, 4, 4, 2, 4, True, [4, 0], 0.6, {"sinks": [1.5, -2.0, 0.3, 4.0]}),
    "everything": (2, 5, 8, 2, 1, 4, True, [8, 5], 0.9,
                   {"window": (2, 0), "softcap": 3.0, "q_segment_ids": SEG_Q, "kv_segment_ids": SEG_KV,
                    "sinks": [0.5, -1.0]}),
}


def _inputs(name: str, seed: int = 0):
    b, lq, lk, hq, hk, d, causal, lengths, scale, features = PROBLEMS[name]
    rng = np.random.default_rng([seed, len(name), 34])
    q = rng.standard_normal((b, lq, hq, d)) * 2
    k = rng.standard_normal((b, lk, hk, d))
    v = rng.standard_normal((b, lk, hk, d))
    ct = rng.standard_normal((b, lq, hq, d))
    kw = {"causal": causal, "kv_lengths": None if lengths is None else np.array(lengths), "scale": scale,
          **{n: np.array(x) if isinstance(x, list) else x for n, x in features.items()}}
    return q, k, v, ct, kw


def _independent(q, k, v, sinks, *, causal, kv_lengths, scale, window=None, softcap=None, q_segment_ids=None,
                 kv_segment_ids=None):
    """The contract per query head with an explicit position ``p`` per row; shares nothing with the oracle."""
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kv_head = np.arange(hq) * hk // hq
    logits = jnp.einsum("bihd,bjhd->bhij", q, k[:, :, kv_head]) * scale
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    p = np.arange(lq)[:, None] + lk - lq
    j = np.arange(lk)[None, :]
    seen = np.ones((b, 1, lq, lk), bool)
    if causal:
        seen &= j <= p
    if kv_lengths is not None:
        seen &= j < np.asarray(kv_lengths)[:, None, None, None]
    if window is not None:
        if window[0] is not None:
            seen &= j >= p - window[0]
        if window[1] is not None:
            seen &= j <= p + window[1]
    if q_segment_ids is not None:
        seen &= (np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :])[:, None]
    seen = jnp.asarray(seen)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(seen, logits, -1e300), axis=-1, keepdims=True))
    if sinks is not None:
        top = jnp.maximum(top, jax.lax.stop_gradient(sinks)[None, :, None, None])
    w = jnp.where(seen, jnp.exp(jnp.where(seen, logits, top) - top), 0.0)
    total = jnp.sum(w, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks[None, :, None, None] - top)
    probs = w / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhij,bjhd->bihd", probs, v[:, :, kv_head])


def _independent_vjp(q, k, v, ct, kw):
    kw = dict(kw)
    sinks = kw.pop("sinks", None)
    with x64():
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, ct)]
        if sinks is not None:
            args.append(jnp.asarray(sinks, jnp.float64))

        @jax.jit  # one program (op by op, each operation would compile one)
        def vjp(q, k, v, ct, *s):
            out, pull = jax.vjp(lambda *x: _independent(*x[:3], x[3] if s else None, **kw), q, k, v, *s)
            return (out, *pull(ct))

        return tuple(np.asarray(x) for x in vjp(*args))


def _truth(q, k, v, ct=None, **kw):
    kw = dict(kw)
    return oracle.attention(q, k, v, ct, **kw)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_feature_truth_matches_jax_grad_of_an_independent_float64_formulation(name):
    q, k, v, ct, kw = _inputs(name)
    truth = _truth(q, k, v, ct, **kw)
    want = _independent_vjp(q, k, v, ct, kw)
    got = (truth.out, truth.dq, truth.dk, truth.dv) + ((truth.dsinks,) if "sinks" in kw else ())
    assert len(got) == len(want)
    for what, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        _close(a, b, f"{name} {what}")


@pytest.mark.parametrize("name", ["softcap-past-the-cap", "sinks-group-causal", "everything"])
def test_feature_truth_gradients_match_central_differences(name):
    """Along random directions in q, k, v (and sinks): the cap's slope and dsinks included."""
    q, k, v, ct, kw = _inputs(name, seed=1)
    truth = _truth(q, k, v, ct, **kw)
    sinks = kw.pop("sinks", None)
    rng = np.random.default_rng(5)

    def loss(h, dirs):
        extra = {} if sinks is None else {"sinks": sinks + h * dirs["s"]}
        return float(np.sum(ct * _truth(q + h * dirs["q"], k + h * dirs["k"], v + h * dirs["v"], **kw, **extra).out))

    for direction in ("q", "k", "v", "s", "all"):
        if direction == "s" and sinks is None:
            continue
        shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "s": () if sinks is None else sinks.shape}
        dirs = {n: rng.standard_normal(shape) if direction in (n, "all") else np.zeros(shape)
                for n, shape in shapes.items()}
        h = 1e-5
        numeric = (loss(h, dirs) - loss(-h, dirs)) / (2 * h)
        terms = [truth.dq * dirs["q"], truth.dk * dirs["k"], truth.dv * dirs["v"]]
        if sinks is not None:
            terms.append(truth.dsinks * dirs["s"])
        analytic = float(sum(np.sum(t) for t in terms))
        size = float(sum(np.sum(np.abs(t)) for t in terms))
        assert abs(numeric - analytic) <= 1e-7 * size, (name, direction, numeric, analytic)


def test_window_visibility_written_out_by_hand():
    # q_len 2 against 6 keys: rows sit at positions 4 and 5. window (2, 0): keys 2..4 and 3..5.
    vis = oracle.visible_keys(1, 2, 6, False, None, window=(2, 0))[0]
    assert np.array_equal(vis, np.array([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], bool))
    # Two-sided (1, 1) with causal: the right side is cut at the row's own position.
    vis = oracle.visible_keys(1, 3, 3, True, None, window=(1, 1))[0]
    assert np.array_equal(vis, np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool))
    # (0, 0): the row's own position only; q_len > kv_len: rows 0, 1 sit at -2, -1 and see nothing.
    vis = oracle.visible_keys(1, 4, 2, False, None, window=(0, 0))[0]
    assert np.array_equal(vis, np.array([[0, 0], [0, 0], [1, 0], [0, 1]], bool))
    # A left side of None is unbounded: (None, 0) is causal.
    assert np.array_equal(oracle.visible_keys(1, 3, 5, False, None, window=(None, 0)),
                          oracle.visible_keys(1, 3, 5, True, None))


def test_segment_visibility_is_equality_not_runs():
    q_ids, kv_ids = np.array([[0, 1, 0]]), np.array([[0, 1, 1, 0]])
    vis = oracle.visible_keys(1, 3, 4, False, None, q_segment_ids=q_ids, kv_segment_ids=kv_ids)[0]
    assert np.array_equal(vis, np.array([[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]], bool))


def test_sinks_take_probability_and_give_no_value():
    q, k, v, _, kw = _inputs("sinks-group-causal")
    with_sinks = _truth(q, k, v, **kw)
    kw.pop("sinks")
    without = _truth(q, k, v, **kw)
    rows = with_sinks.visible.any(axis=2)  # [batch, q_len]
    mass = with_sinks.probs.sum(axis=-1)   # [batch, heads, q_len]
    assert np.all(mass[np.repeat(rows[:, None], mass.shape[1], 1)] < 1 - 1e-6)
    assert np.all(mass[np.repeat(~rows[:, None], mass.shape[1], 1)] == 0)
    assert np.all(with_sinks.out[~rows] == 0) and (~rows).any()
    # A sink at -inf in effect (-1e30) changes nothing; one far above leaves almost nothing.
    off = _truth(q, k, v, **kw, sinks=np.full(4, -1e30))
    assert np.array_equal(off.out, without.out)
    high = _truth(q, k, v, **kw, sinks=np.full(4, 80.0))
    assert np.max(np.abs(high.out)) < 1e-20 < np.max(np.abs(without.out))
    # Past exp's float64 range (the sink in the max-shifted frame): still finite, gradients included.
    far = _truth(q, k, v, np.ones(q.shape), **kw, sinks=np.full(4, 1000.0))
    assert all(np.all(np.isfinite(x)) for x in (far.out, far.dq, far.dk, far.dv, far.dsinks))


def test_a_huge_cap_and_a_covering_window_change_nothing():
    q, k, v, _, kw = _inputs("softcap-past-the-cap")
    kw.pop("softcap")
    plain = _truth(q, k, v, **kw).out
    assert np.allclose(_truth(q, k, v, **kw, softcap=1e30).out, plain, rtol=1e-12, atol=0)
    assert np.array_equal(_truth(q, k, v, **kw, window=(k.shape[1], None)).out, plain)
    capped = _truth(q, k, v, **kw, softcap=2.0)
    assert capped.logit_max <= 2.0 and not np.allclose(capped.out, plain)
