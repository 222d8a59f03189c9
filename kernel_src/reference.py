"""Pure-JAX oracle of the candidate contract (see ``kernel_src.contract``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_src.contract import check_inputs, default_scale, visibility_mask

_HIGHEST = jax.lax.Precision.HIGHEST


def reference_masked_softmax(logits: jax.Array, *, causal: bool = False,
                             kv_lengths: jax.Array | None = None) -> jax.Array:
    """Masked softmax over the last axis in fp32: the XLA side of the ``softmax`` benchmark scope.

    Args:
      logits: ``[batch, ..., q_len, kv_len]`` (any leading head axes), any float dtype.
      causal: bottom-right aligned causal mask.
      kv_lengths: optional int ``[batch]`` key lengths.

    Returns:
      fp32 probabilities of the same shape; rows with no visible key are exact zeros.
    """
    q_len, kv_len = logits.shape[-2:]
    mask = visibility_mask(q_len, kv_len, causal, kv_lengths)
    mask = mask.reshape(mask.shape[:1] + (1,) * (logits.ndim - 3) + mask.shape[1:])
    logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


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
    p = reference_masked_softmax(logits, causal=causal, kv_lengths=kv_lengths)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
