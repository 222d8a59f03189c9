"""The contract-precision reference (``kernel_src.reference_attention``) graded against the float64 truth
at bounds derived from float32 rounding, not measured: so a 0.1% error in its scale or a mask that is
off by one key fails, although the rubric (which uses the reference as its own baseline) could not see it.

The bound, first order in the unit roundoff ``u = 2**-24`` (float32 inputs, fp32 logits, statistics and
accumulation, as the contract says; ``d`` head_dim, ``n`` the keys a row sums over, ``m`` the query rows
a key's gradient sums over):

* a logit ``s = scale * q.k`` is off by at most ``Δ = (d + 1) u scale Σ|q_i k_i|``;
* a probability is off by at most ``ρ = 2 max Δ + u max|s - rowmax| + (n + 6) u`` of itself (the
  rowmax error cancels; the exp's, the sum's and the division's rounding);
* the output ``Σ p v`` by at most ``ρ + n u`` of its magnitude ``Σ p |v|``;
* dV by ``ρ + m u``; dS ``= P ⊙ (dP - rowsum(P ⊙ dP))`` by ``3ρ + (2d + 2n + 8) u``, and dQ, dK that plus
  ``n u`` or ``m u`` -- all relative to ``grading.dense.truth.Truth.magnitude``, which bounds the result.

Both the norm-wise and the worst-element error (``grading.tolerance.error``) must stay under it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import truth as oracle
from tpu_kernel_records_tools.grading.tolerance import error
from kernel_src import reference_attention

U = 2.0 ** -24  # float32 unit roundoff

# name: (batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim, causal, kv_lengths, scale)
PROBLEMS = {
    "gqa3-causal-lengths": (2, 16, 40, 6, 3, 32, True, [40, 13], None),
    "mqa-causal-square": (1, 24, 24, 4, 1, 16, True, None, None),
    "explicit-scale-padding": (2, 8, 20, 2, 2, 16, False, [20, 5], 0.3),
    "empty-rows-zero-length": (3, 12, 8, 4, 2, 16, True, [0, 3, 8], None),
}


def _inputs(name: str, dtype=np.float32):
    b, lq, lk, hq, hk, d, causal, lengths, scale = PROBLEMS[name]
    rng = np.random.default_rng([b, lq, lk, hq, hk, d])
    q, ct = (rng.standard_normal((b, lq, hq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, lk, hk, d)).astype(dtype) for _ in range(2))
    return q, k, v, ct, {"causal": causal, "kv_lengths": lengths, "scale": scale}


_forward = jax.jit(reference_attention, static_argnames=("causal", "scale"))


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _vjp(q, k, v, ct, kv_lengths, *, causal, scale):
    out, pull = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths,
                                                            scale=scale), q, k, v)
    return (out, *pull(ct))


def _call(q, k, v, ct=None, *, causal, kv_lengths, scale, dtype=jnp.float32):
    """The reference's ``(out,)``, or ``(out, dq, dk, dv)`` under the cotangent ``ct``, as NumPy arrays."""
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    lengths = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
    if ct is None:
        return (np.asarray(_forward(*args, causal=causal, kv_lengths=lengths, scale=scale)),)
    result = _vjp(*args, jnp.asarray(ct, dtype), lengths, causal=causal, scale=scale)
    return tuple(np.asarray(x) for x in result)


def _bounds(q, k, truth: oracle.Truth, scale) -> dict[str, float]:
    """The a-priori bounds of the module docstring for this problem (float32 arithmetic)."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = d ** -0.5 if scale is None else scale
    kh = k[:, :, np.arange(hq) // group]
    abs_dot = np.einsum("bihd,bjhd->bhij", np.abs(q), np.abs(kh)) * scale
    logits = np.einsum("bihd,bjhd->bhij", q, kh) * scale
    vis = truth.visible[:, None]
    delta = (d + 1) * U * np.max(np.where(vis, abs_dot, 0.0))
    rowmax = np.max(np.where(vis, logits, -np.inf), axis=-1, keepdims=True)
    spread = np.max(np.where(vis, np.abs(logits - np.where(np.isfinite(rowmax), rowmax, 0.0)), 0.0))
    rho = 2 * delta + U * spread + (lk + 6) * U
    ds = 3 * rho + (2 * d + 2 * lk + 8) * U
    return {"out": rho + lk * U, "dv": rho + lq * group * U, "dq": ds + lk * U, "dk": ds + lq * group * U}


def _errors(name):
    q, k, v, ct, kw = _inputs(name)
    lengths = None if kw["kv_lengths"] is None else np.asarray(kw["kv_lengths"])
    truth = oracle.attention(q, k, v, ct, causal=kw["causal"], kv_lengths=lengths, scale=kw["scale"])
    return q, k, v, ct, kw, truth, _bounds(q, k, truth, kw["scale"])


def _assert_within(got: dict, truth: oracle.Truth, bounds: dict, label: str):
    for name, result in got.items():
        want = getattr(truth, name)
        e = error(result, want, truth.magnitude[name])
        assert e.norm <= bounds[name] and e.worst <= bounds[name], \
            f"{label} {name}: norm {e.norm:.3g}, worst {e.worst:.3g} at {e.index} > float32 bound {bounds[name]:.3g}"


def _exceeds(got: dict, truth: oracle.Truth, bounds: dict) -> list[str]:
    over = []
    for name, result in got.items():
        e = error(result, getattr(truth, name), truth.magnitude[name])
        if e.worst > bounds[name]:
            over.append(name)
    return over


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_reference_is_within_float32_rounding_of_the_truth(name):
    q, k, v, ct, kw, truth, bounds = _errors(name)
    out, dq, dk, dv = _call(q, k, v, ct, **kw)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == np.float32
    _assert_within({"out": out, "dq": dq, "dk": dk, "dv": dv}, truth, bounds, name)
    # The exact zeros the contract demands: rows with no visible key, keys no query sees.
    empty = ~truth.visible.any(axis=2)
    unseen = ~truth.visible.any(axis=1)
    assert np.all(out[empty] == 0) and np.all(dq[empty] == 0)
    assert np.all(dk[unseen] == 0) and np.all(dv[unseen] == 0)
    if name == "empty-rows-zero-length":
        assert empty.any() and unseen.any()


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_a_tenth_of_a_percent_scale_error_breaks_the_bound(name):
    """The bound is tight enough to see a scale off by 0.1% (the power of the test above)."""
    q, k, v, ct, kw, truth, bounds = _errors(name)
    scale = q.shape[-1] ** -0.5 if kw["scale"] is None else kw["scale"]
    (out,) = _call(q, k, v, **{**kw, "scale": scale * 1.001})
    assert _exceeds({"out": out}, truth, bounds) == ["out"], name


@pytest.mark.parametrize("name", ["gqa3-causal-lengths", "explicit-scale-padding", "empty-rows-zero-length"])
def test_a_mask_off_by_one_key_breaks_the_bound(name):
    q, k, v, ct, kw, truth, bounds = _errors(name)
    lengths = [min(n + 1, k.shape[1]) for n in kw["kv_lengths"]]
    (out,) = _call(q, k, v, **{**kw, "kv_lengths": lengths})
    assert _exceeds({"out": out}, truth, bounds) == ["out"]


def test_bfloat16_reference_rounds_only_its_output():
    """bfloat16 inputs: internals in fp32, so the output is within the float32 bound plus half a
    bfloat16 ulp (unit roundoff 2**-8) of its magnitude, and is returned in bfloat16."""
    q, k, v, ct, kw = _inputs("gqa3-causal-lengths")
    qb, kb, vb = (np.asarray(jnp.asarray(x, jnp.bfloat16)) for x in (q, k, v))
    lengths = np.asarray(kw["kv_lengths"])
    truth = oracle.attention(qb, kb, vb, causal=kw["causal"], kv_lengths=lengths, scale=kw["scale"])
    bound = _bounds(qb.astype(np.float32), kb.astype(np.float32), truth, kw["scale"])["out"] + 2.0 ** -8
    (out,) = _call(qb, kb, vb, **kw, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    e = error(out, truth.out, truth.magnitude["out"])
    assert e.norm <= bound and e.worst <= bound, (e, bound)


def test_reference_is_within_float32_rounding_for_logits_near_300():
    """Every logit shifted by about +300 (a common direction in q and k): without the row max
    subtracted exp overflows, so a reference that lost its max (or its -inf mask fill) fails here."""
    q, k, v, ct, kw = _inputs("gqa3-causal-lengths")
    u = np.full(q.shape[-1], q.shape[-1] ** -0.5, np.float32)  # unit vector
    q, k = q + 40 * u, k + 40 * u
    lengths = np.asarray(kw["kv_lengths"])
    truth = oracle.attention(q, k, v, ct, causal=kw["causal"], kv_lengths=lengths, scale=kw["scale"])
    bounds = _bounds(q, k, truth, kw["scale"])
    logits = np.einsum("bihd,bjhd->bhij", q[:, :, :3], k) * q.shape[-1] ** -0.5
    assert logits.min() > 150  # the premise
    out, dq, dk, dv = _call(q, k, v, ct, **kw)
    _assert_within({"out": out, "dq": dq, "dk": dk, "dv": dv}, truth, bounds, "logits near 300")
