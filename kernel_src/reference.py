"""Pure-JAX oracle of the candidate contract (see ``kernel_src.contract``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_src.contract import check_inputs, default_scale, visibility_mask

_HIGHEST = jax.lax.Precision.HIGHEST


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                        kv_lengths: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Grouped-query attention in plain JAX, the oracle every kernel is checked against.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype as ``q``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding.
      scale: logit scale, ``head_dim ** -0.5`` by default.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype. Logits, softmax statistics and
      the P·V accumulation are fp32 (probabilities stay fp32). Rows with no visible key are exact
      zeros, and so are their gradients.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    scale = default_scale(dims.head_dim, scale)
    qg = q.reshape(dims.batch, dims.q_len, dims.num_kv_heads, dims.group, dims.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    mask = visibility_mask(dims.q_len, dims.kv_len, causal, kv_lengths)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
