"""A correct submission with a Pallas kernel (``interpret=True`` on a CPU): one grid step per batch and
query head computes the masked softmax attention of that head; the backward is pure JAX."""
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pure_jax import attention as pure  # noqa: E402


def _kernel(q_ref, k_ref, v_ref, len_ref, o_ref, *, causal, scale):
    q, k, v = q_ref[0, :, 0, :], k_ref[0, :, 0, :], v_ref[0, :, 0, :]
    lq, lk = q.shape[0], k.shape[0]
    s = jnp.dot(q.astype(jnp.float32), k.astype(jnp.float32).T) * scale
    i = jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
    vis = j < len_ref[0]
    if causal:
        vis = vis & (j <= i + (lk - lq))
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    o_ref[0, :, 0, :] = jnp.dot(p, v.astype(jnp.float32)).astype(o_ref.dtype)


def _forward(q, k, v, lengths, causal, scale):
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    return pl.pallas_call(
        functools.partial(_kernel, causal=causal, scale=scale),
        grid=(b, hq),
        in_specs=[pl.BlockSpec((1, lq, 1, d), lambda bi, h: (bi, 0, h, 0)),
                  pl.BlockSpec((1, lk, 1, d), lambda bi, h: (bi, 0, h // g, 0)),
                  pl.BlockSpec((1, lk, 1, d), lambda bi, h: (bi, 0, h // g, 0)),
                  pl.BlockSpec((1,), lambda bi, h: (bi,))],
        out_specs=pl.BlockSpec((1, lq, 1, d), lambda bi, h: (bi, 0, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=True)(q, k, v, lengths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, lengths, causal, scale):
    return _forward(q, k, v, lengths, causal, scale)


def _fwd(q, k, v, lengths, causal, scale):
    return _forward(q, k, v, lengths, causal, scale), (q, k, v, lengths)


def _bwd(causal, scale, res, ct):
    q, k, v, lengths = res
    _, pull = jax.vjp(lambda q, k, v: pure(q, k, v, causal=causal, kv_lengths=lengths, scale=scale), q, k, v)
    return (*pull(ct), None)


_attention.defvjp(_fwd, _bwd)


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    lengths = jnp.full((q.shape[0],), k.shape[1], jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attention(q, k, v, lengths, bool(causal), scale)
