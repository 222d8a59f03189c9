"""The float64 truth (``grading.dense.truth``) checked by derivations that share no code with it.

Every bound of the rubric is measured against this truth, and a wrong truth inflates the reference's
baseline error and so loosens every bound. So its forward output and its Q/K/V gradients are compared
with two independent derivations, in float64:

* ``jax.vjp`` of a JAX formulation written here (one query head at a time, explicit kv-head index,
  ``jax_enable_x64`` switched on only inside these tests);
* central finite differences of the oracle's own forward output, along random directions in all of
  q, k, v at once (so scaling any one gradient, or any slice of it, moves the directional derivative).

The problems cover causal (q_len below, equal to and above kv_len), kv_lengths 0, partial and full,
groups of 1, 2 and 4, an explicit scale, rows that see no key (zero output, zero dQ) and keys that no
query sees (zero dK, dV).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import truth as oracle


@contextlib.contextmanager
def x64():
    """``jax_enable_x64`` for the duration of the block only (the API moved between JAX versions)."""
    if hasattr(jax, "enable_x64"):
        with jax.enable_x64(True):
            yield
    else:  # jax 0.6
        from jax.experimental import enable_x64
        with enable_x64():
            yield


# name: (batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim, causal, kv_lengths, scale)
PROBLEMS = {
    "group1-causal-short-q-partial": (2, 5, 7, 2, 2, 4, True, [7, 3], None),
    "group2-causal-long-q-zero-length": (3, 6, 4, 4, 2, 8, True, [0, 2, 4], 0.3),
    "group4-unmasked-explicit-scale": (1, 3, 5, 4, 1, 8, False, None, 0.7),
    "group4-causal-square-lengths": (2, 6, 6, 8, 2, 4, True, [6, 1], None),
    "group2-padding-only": (2, 4, 9, 2, 1, 4, False, [5, 9], None),
}


def _inputs(name: str, seed: int = 0):
    b, lq, lk, hq, hk, d, causal, lengths, scale = PROBLEMS[name]
    rng = np.random.default_rng([seed, len(name)])
    q = rng.standard_normal((b, lq, hq, d))
    k = rng.standard_normal((b, lk, hk, d))
    v = rng.standard_normal((b, lk, hk, d))
    ct = rng.standard_normal((b, lq, hq, d))
    kw = {"causal": causal, "kv_lengths": None if lengths is None else np.array(lengths), "scale": scale}
    return q, k, v, ct, kw


def _independent_attention(q, k, v, *, causal, kv_lengths, scale):
    """The contract written out with an explicit kv-head index per query head (float64 inside ``x64()``);
    shares nothing with the oracle."""
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kv_head = np.arange(hq) * hk // hq  # == h // (hq // hk)
    keys, values = k[:, :, kv_head], v[:, :, kv_head]  # [b, lk, hq, d]
    logits = jnp.einsum("bihd,bjhd->bhij", q, keys) * scale
    rows = jnp.arange(lq)[:, None]
    cols = jnp.arange(lk)[None, :]
    seen = jnp.ones((b, 1, lq, lk), bool)
    if causal:
        seen = seen & (cols - rows <= lk - lq)
    if kv_lengths is not None:
        seen = seen & (cols < jnp.asarray(kv_lengths)[:, None, None, None])
    any_seen = jnp.any(seen, axis=-1, keepdims=True)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(seen, logits, -1e300), axis=-1, keepdims=True))
    top = jnp.where(any_seen, top, 0.0)
    w = jnp.where(seen, jnp.exp(jnp.where(seen, logits, top) - top), 0.0)
    total = jnp.sum(w, axis=-1, keepdims=True)
    probs = w / jnp.where(any_seen, total, 1.0)
    return jnp.einsum("bhij,bjhd->bihd", probs, values)


def _independent(q, k, v, ct, kw):
    """(out, dq, dk, dv) of the independent formulation, as float64 NumPy arrays."""
    with x64():
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, ct)]
        assert args[0].dtype == jnp.float64

        @jax.jit
        def run(q, k, v, ct):
            out, pull = jax.vjp(lambda a, b_, c: _independent_attention(a, b_, c, **kw), q, k, v)
            return (out, *pull(ct))

        return tuple(np.asarray(x) for x in run(*args))


def _close(got, want, what, rtol=1e-11):
    scale = max(float(np.max(np.abs(want))), 1e-300)
    worst = float(np.max(np.abs(got - want))) / scale
    assert got.dtype == np.float64 and got.shape == want.shape, what
    assert worst <= rtol, f"{what}: relative difference {worst:.3g}"


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_truth_matches_jax_grad_of_an_independent_float64_formulation(name):
    q, k, v, ct, kw = _inputs(name)
    truth = oracle.attention(q, k, v, ct, **kw)
    want = _independent(q, k, v, ct, kw)
    for what, got, expected in zip(("out", "dq", "dk", "dv"), (truth.out, truth.dq, truth.dk, truth.dv), want):
        _close(got, expected, f"{name} {what}")


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_truth_gradients_match_central_differences(name):
    q, k, v, ct, kw = _inputs(name, seed=1)
    truth = oracle.attention(q, k, v, ct, **kw)

    def loss(dq, dk, dv, h):
        return float(np.sum(ct * oracle.attention(q + h * dq, k + h * dk, v + h * dv, **kw).out))

    rng = np.random.default_rng(7)
    for direction in ("q", "k", "v", "all"):
        dirs = {n: rng.standard_normal(x.shape) if direction in (n, "all") else np.zeros(x.shape)
                for n, x in (("q", q), ("k", k), ("v", v))}
        h = 1e-5
        numeric = (loss(dirs["q"], dirs["k"], dirs["v"], h) - loss(dirs["q"], dirs["k"], dirs["v"], -h)) / (2 * h)
        analytic = float(np.sum(truth.dq * dirs["q"]) + np.sum(truth.dk * dirs["k"]) + np.sum(truth.dv * dirs["v"]))
        size = float(np.sum(np.abs(truth.dq * dirs["q"])) + np.sum(np.abs(truth.dk * dirs["k"]))
                     + np.sum(np.abs(truth.dv * dirs["v"])))
        assert abs(numeric - analytic) <= 1e-7 * size, (name, direction, numeric, analytic)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_truth_gradients_element_by_element(name):
    """A few single elements of each gradient by central differences (a wrong slice of a gradient fails)."""
    q, k, v, ct, kw = _inputs(name, seed=2)
    truth = oracle.attention(q, k, v, ct, **kw)
    rng = np.random.default_rng(3)
    for which, grad in (("q", truth.dq), ("k", truth.dk), ("v", truth.dv)):
        for _ in range(6):
            index = tuple(int(rng.integers(n)) for n in grad.shape)
            plus = {"q": q, "k": k, "v": v}
            minus = dict(plus)
            h = 1e-5
            plus[which] = plus[which].copy()
            plus[which][index] += h
            minus[which] = minus[which].copy()
            minus[which][index] -= h
            numeric = (np.sum(ct * oracle.attention(**plus, **kw).out)
                       - np.sum(ct * oracle.attention(**minus, **kw).out)) / (2 * h)
            assert abs(numeric - grad[index]) <= 1e-7 * (1 + abs(grad[index])), (name, which, index)


def test_empty_rows_and_unseen_keys_are_exact_zeros_in_the_truth():
    q, k, v, ct, kw = _inputs("group2-causal-long-q-zero-length")
    truth = oracle.attention(q, k, v, ct, **kw)
    lq, lk = q.shape[1], k.shape[1]
    # Batch 0 has kv_lengths 0: every row is empty and every key unseen. In the others, causal with
    # q_len - kv_len = 2 hides every key from rows 0 and 1; batch 1 (length 2) never shows keys 2, 3.
    empty = np.zeros((q.shape[0], lq), bool)
    empty[0] = True
    empty[1:, : lq - lk] = True
    assert np.array_equal(~truth.visible.any(axis=2), empty)
    assert np.all(truth.out[empty] == 0) and np.all(truth.dq[empty] == 0)
    assert np.all(np.abs(truth.out[~empty]) > 0)
    unseen = np.zeros((k.shape[0], lk), bool)
    unseen[0] = True
    unseen[1, 2:] = True
    assert np.array_equal(~truth.visible.any(axis=1), unseen)
    assert np.all(truth.dk[unseen] == 0) and np.all(truth.dv[unseen] == 0)
    assert np.all(np.abs(truth.dv[~unseen]) > 0)
    assert np.all(truth.probs.sum(axis=-1)[:, :, :][np.repeat(empty[:, None], q.shape[2], 1)] == 0)


def test_visibility_is_bottom_right_causal_and_padding():
    vis = oracle.visible_keys(2, 3, 5, True, np.array([5, 2]))
    expect = np.array([[[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
                       [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]], bool)
    assert np.array_equal(vis, expect)
    assert np.array_equal(oracle.visible_keys(1, 4, 2, True, None)[0],
                          np.array([[0, 0], [0, 0], [1, 0], [1, 1]], bool))
    assert oracle.visible_keys(1, 2, 3, False, None).all()


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_probabilities_are_the_softmax_rows(name):
    q, k, v, ct, kw = _inputs(name)
    truth = oracle.attention(q, k, v, **kw)
    b, lq, hq, d = q.shape
    group = hq // k.shape[2]
    scale = d ** -0.5 if kw["scale"] is None else kw["scale"]
    for h in range(hq):
        s = np.einsum("bid,bjd->bij", q[:, :, h], k[:, :, h // group]) * scale
        w = np.where(truth.visible, np.exp(s - 50.0), 0.0)  # |s| < 50 here: no under/overflow
        total = w.sum(-1, keepdims=True)
        want = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
        assert np.allclose(truth.probs[:, h], want, rtol=1e-12, atol=1e-300)
        assert np.allclose(truth.out[:, :, h], np.einsum("bij,bjd->bid", want, v[:, :, h // group]),
                           rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_magnitudes_bound_the_results_and_match_their_definition(name):
    """``magnitude`` is the same computation on absolute values: P|V| for the output; for the gradients
    P ⊙ (|dO||V|ᵀ + rowsum(P ⊙ |dO||V|ᵀ)) carried through |K| (dQ) or |Q| (dK), and Pᵀ|dO| for dV."""
    q, k, v, ct, kw = _inputs(name, seed=4)
    t = oracle.attention(q, k, v, ct, **kw)
    b, lq, hq, d = q.shape
    hk = k.shape[2]
    group = hq // hk
    scale = d ** -0.5 if kw["scale"] is None else kw["scale"]
    mag = {"out": np.zeros(q.shape), "dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape)}
    for h in range(hq):
        g = h // group
        p = t.probs[:, h]  # [b, lq, lk]
        dp = np.einsum("bid,bjd->bij", np.abs(ct[:, :, h]), np.abs(v[:, :, g]))
        ds = p * (dp + np.sum(p * dp, axis=-1, keepdims=True))
        mag["out"][:, :, h] = np.einsum("bij,bjd->bid", p, np.abs(v[:, :, g]))
        mag["dq"][:, :, h] = scale * np.einsum("bij,bjd->bid", ds, np.abs(k[:, :, g]))
        mag["dk"][:, :, g] += scale * np.einsum("bij,bid->bjd", ds, np.abs(q[:, :, h]))
        mag["dv"][:, :, g] += np.einsum("bij,bid->bjd", p, np.abs(ct[:, :, h]))
    results = {"out": t.out, "dq": t.dq, "dk": t.dk, "dv": t.dv}
    for key in mag:
        assert np.allclose(t.magnitude[key], mag[key], rtol=1e-12, atol=1e-300), key
        assert np.all(np.abs(results[key]) <= t.magnitude[key] * (1 + 1e-12) + 1e-300), key
    # Where nothing cancels (V >= 0) the output's magnitude is |out| itself.
    positive = oracle.attention(q, k, np.abs(v), **kw)
    assert np.allclose(positive.magnitude["out"], np.abs(positive.out), rtol=1e-13, atol=0)


def test_per_head_outputs_name_the_kv_head_each_query_head_reads():
    q, k, v, ct, kw = _inputs("group4-causal-square-lengths")
    truth = oracle.attention(q, k, v, **kw)
    per_head = oracle.per_head_outputs(q, k, v, **kw)
    hq, hk = q.shape[2], k.shape[2]
    assert per_head.shape == (hk, *q.shape)
    for h in range(hq):
        for g in range(hk):
            same = np.allclose(per_head[g][:, :, h], truth.out[:, :, h], rtol=1e-12, atol=1e-14)
            assert same == (g == h // (hq // hk)), (h, g)


def test_truth_takes_bfloat16_values_exactly():
    q, k, v, ct, kw = _inputs("group1-causal-short-q-partial")
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    exact = [np.asarray(x).astype(np.float64) for x in (qb, kb, vb)]
    got = oracle.attention(qb, kb, vb, **kw).out
    assert got.dtype == np.float64
    assert np.array_equal(got, oracle.attention(*exact, **kw).out)


@pytest.mark.parametrize("causal, lengths", [(False, None), (True, None), (True, [0, 3]), (False, [5, 1])])
def test_masked_softmax_is_the_contract_softmax(causal, lengths):
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((2, 3, 4, 5)) * 4
    got = oracle.masked_softmax(logits, causal=causal, kv_lengths=None if lengths is None else np.array(lengths))
    i, j = np.arange(4)[:, None], np.arange(5)[None, :]
    seen = np.ones((2, 1, 4, 5), bool)
    if causal:
        seen &= j <= i + 1
    if lengths is not None:
        seen &= j < np.array(lengths)[:, None, None, None]
    w = np.exp(logits) * seen
    total = w.sum(-1, keepdims=True)
    want = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    assert got.dtype == np.float64 and np.allclose(got, want, rtol=1e-13, atol=0)
    assert np.all(got[~seen.repeat(3, 1)] == 0)
    empty = ~seen.any(-1)
    assert np.all(got.sum(-1)[np.broadcast_to(empty, got.shape[:-1])] == 0)


def test_masked_softmax_defaults_to_no_mask():
    logits = np.random.default_rng(13).standard_normal((1, 2, 3, 3))
    w = np.exp(logits)
    assert np.allclose(oracle.masked_softmax(logits), w / w.sum(-1, keepdims=True), rtol=1e-13, atol=0)


def test_truth_is_exact_for_logits_far_below_zero():
    """Softmax is shift-invariant: rows whose visible logits all lie near -1000 (exp underflows unless
    the row max is subtracted) still get the softmax of their logits, summing to one."""
    rng = np.random.default_rng(12)
    u = np.ones(4) / 2.0
    k = rng.standard_normal((1, 6, 1, 4)) * 0.1 + 40 * u
    q_far = rng.standard_normal((1, 3, 1, 4)) * 0.1 - 100 * u  # logits near -100 * 40 * |u|^2 / 2 = -2000
    far = oracle.attention(q_far, k, k, kv_lengths=np.array([4]))
    assert np.allclose(far.probs.sum(-1), 1.0, rtol=1e-12)
    assert np.all(far.probs[..., 4:] == 0)
    s = np.einsum("bihd,bjhd->bhij", q_far, k) * 0.5
    assert s[..., :4].max() < -1500  # the premise: far below where exp underflows
    w = np.exp(s[..., :4] - s[..., :4].max(-1, keepdims=True))
    assert np.allclose(far.probs[..., :4], w / w.sum(-1, keepdims=True), rtol=1e-10)
