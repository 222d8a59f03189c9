"""A backward that takes ``di = rowsum(dO * O)`` from the output it stored (in the input dtype), as every
FlashAttention-style backward does, is judged against the exact answer with that rounding
(``Truth.stored_out_grads``, ``grading.tolerance.judge(answers=...)``) as well as against the truth: on
peaked rows ``dP - di`` cancels and that one rounding of O outweighs all the reference rounds. Found as a
false reject of flash, flash-triton and flash-style-features (quick level, seed 1000, the softcap check's
``q x40`` problem). The answer does not widen the bound: the reference fed q scaled and rounded to bfloat16
first (an error of the same size, in another direction) still fails there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense import truth as oracle
from tpu_kernel_records_tools.grading.candidates import resolve
from tpu_kernel_records_tools.sweeps.calibration import seed_problems
from tpu_kernel_records_tools.grading.tolerance import POLICY, STORED_OUTPUT, judge, needed_k
from tests import field_adapters


def _direct(q, k, v, ct, *, stored, causal, kv_lengths, scale, softcap):
    """dQ, dK with di from the output rounded to ``stored``, straight from the definitions (einsum over
    repeated heads, no linear shortcut)."""
    q, k, v, ct = (oracle.as_f64(x) for x in (q, k, v, ct))
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    kr, vr = (np.repeat(x, hq // hk, axis=2) for x in (k, v))
    raw = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    slope = np.ones_like(raw)
    if softcap is not None:
        raw, slope = softcap * np.tanh(raw / softcap), 1 - np.tanh(raw / softcap) ** 2
    vis = oracle.visible_keys(b, lq, lk, causal, kv_lengths)[:, None]
    top = np.where(vis, raw, -np.inf).max(-1, keepdims=True)
    e = np.where(vis, np.exp(raw - np.where(np.isfinite(top), top, 0.0)), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    di = np.einsum("bqhd,bqhd->bhq", ct, out.astype(stored).astype(np.float64))[..., None]
    ds = p * (np.einsum("bqhd,bkhd->bhqk", ct, vr) - di) * slope
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    return dq, dk.reshape(b, lk, hk, hq // hk, d).sum(axis=3)


@pytest.mark.parametrize("causal, lengths, softcap, lq", [
    (False, None, None, 6), (True, [9, 3], None, 12), (True, None, 4.0, 5), (False, [0, 7], 30.0, 4)])
def test_the_stored_output_gradients_follow_their_definition(causal, lengths, softcap, lq):
    rng = np.random.default_rng(3)
    b, lk, hq, hk, d = 2, 9, 4, 2, 8
    q, ct = (rng.standard_normal((b, lq, hq, d)) * 2 for _ in range(2))
    k, v = (rng.standard_normal((b, lk, hk, d)) for _ in range(2))
    kw = dict(causal=causal, kv_lengths=None if lengths is None else np.array(lengths), scale=0.4, softcap=softcap)
    t = oracle.attention(q, k, v, ct, stored_dtype=jnp.bfloat16, **kw)
    for got, want in zip(t.stored_out_grads, _direct(q, k, v, ct, stored=jnp.bfloat16, **kw)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert not np.allclose(t.stored_out_grads[0], t.dq, rtol=1e-6, atol=0)  # the rounding moved dQ
    exact = oracle.attention(q, k, v, ct, stored_dtype=np.float64, **kw)  # nothing rounded: the truth itself
    np.testing.assert_allclose(exact.stored_out_grads[0], exact.dq, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(exact.stored_out_grads[1], exact.dk, rtol=1e-12, atol=1e-15)
    assert oracle.attention(q, k, v, None, stored_dtype=jnp.bfloat16, **kw).stored_out_grads is None


class _Answers:
    """The part of ``grading.dense.checks.Context`` that ``_gradient_verdicts`` calls: the candidate's VJP."""

    def __init__(self, fn):
        self.fn = fn

    def vjp(self, p):
        @jax.jit  # one program (op by op, each operation would compile one)
        def run(q, k, v, ct):
            out, pull = jax.vjp(lambda q, k, v: self.fn(q, k, v, **p.kwargs), q, k, v)
            return (out, *pull(ct.astype(out.dtype)))

        return [np.asarray(x) for x in run(p.q, p.k, p.v, p.ct)]


def test_a_backward_taking_di_from_its_stored_output_is_judged_by_that_rounding(monkeypatch):
    monkeypatch.setattr(C, "compute_ahead", lambda found: None)
    monkeypatch.setattr(C, "_CACHE", {})
    drawn = seed_problems(1000, "quick", ("softcap",), prepare=False)
    (p,) = [p for p in drawn if p.label.startswith("softcap/") and "q x40" in p.label and p.ct is not None]
    assert p.dtype == "bfloat16" and p.softcap == 50
    verdicts, violations, result = C._gradient_verdicts(_Answers(resolve("flash-style-features").load()), p)
    assert all(v.ok for v in verdicts) and not violations, [v.describe() for v in verdicts if not v.ok]
    dq = verdicts[1]
    assert dq.label.endswith(" dq")
    alone = judge("dq", result[1], p.truth.dq, p.baseline[1], p.dtype, gradient=True,
                  magnitude=p.truth.magnitude["dq"], logit_scale=p.logit_max)
    assert needed_k(alone) > POLICY.k_gradient  # the reference's rounding alone rejects it
    assert needed_k(dq) < 2.5  # off from that answer by about what the reference is off from the truth
    reference = _Answers(resolve("reference").load()).vjp(p)[1]
    assert needed_k(judge("dq", reference, p.truth.dq, p.baseline[1], p.dtype, gradient=True,
                          magnitude=p.truth.magnitude["dq"], logit_scale=p.logit_max)) < 1.5
    assert dq.against == STORED_OUTPUT and dq.tol_norm == alone.tol_norm  # the same bound, another answer
    prerounded = _Answers(field_adapters.prerounded_reference).vjp(p)[1]
    assert not judge("dq", prerounded, p.truth.dq, p.baseline[1], p.dtype, gradient=True,
                     magnitude=p.truth.magnitude["dq"], answers={STORED_OUTPUT: p.truth.stored_out_grads[0]},
                     logit_scale=p.logit_max).ok
