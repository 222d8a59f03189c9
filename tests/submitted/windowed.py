"""A correct submission that declares two features: sliding windows and logit soft-capping (pure JAX,
written apart from the project's reference)."""
import jax
import jax.numpy as jnp


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None):
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    k, v = jnp.repeat(k, hq // hk, axis=2), jnp.repeat(v, hq // hk, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    pos = jnp.arange(lq)[:, None] + (lk - lq)
    j = jnp.arange(lk)[None, :]
    vis = jnp.ones((lq, lk), bool) if not causal else j <= pos
    if window_size is not None:
        left, right = window_size
        vis = vis & ((j >= pos - left) if left is not None else True) & ((j <= pos + right) if right is not None else True)
    vis = vis[None, None]
    if kv_lengths is not None:
        vis = vis & (j[None, None] < kv_lengths[:, None, None, None])
    s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


attention.features = ("window", "softcap")
