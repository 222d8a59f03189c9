"""A correct attention kernel to copy: plain JAX, about forty lines, passes the full rubric.

Grade it (needs bubblewrap; see docs/SUBMITTING.md):

    tpu-kernel-rubric --candidate examples/simple_attention.py:attention

The contract (``kernel_src/contract.py``), in short:

* ``q`` is ``[batch, q_len, num_q_heads, head_dim]``; ``k`` and ``v`` are
  ``[batch, kv_len, num_kv_heads, head_dim]``; all float32 or all bfloat16.
* Grouped-query attention: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* ``causal=True`` is aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + (kv_len - q_len)``.
  With ``q_len = 3`` and ``kv_len = 5`` (``x`` = visible)::

               key j:  0 1 2 3 4
        query i = 0:   x x x . .
        query i = 1:   x x x x .
        query i = 2:   x x x x x

* ``kv_lengths`` (int ``[batch]``): keys ``j >= kv_lengths[b]`` are padding, never seen.
* A query row that sees no key returns exact zeros (and gets a zero gradient).
* ``scale`` defaults to ``head_dim ** -0.5``.
* Logits, softmax statistics and accumulation in float32; the output has ``q``'s dtype.
* ``jax.grad`` must work through it (this one lets JAX differentiate the forward).
"""

import jax
import jax.numpy as jnp


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    if scale is None:
        scale = head_dim ** -0.5

    # Grouped-query: repeat each kv head for the query heads that read it.
    group = num_q_heads // num_kv_heads
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)

    # Logits in float32: [batch, heads, q_len, kv_len].
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST) * scale

    # Which keys each query sees.
    i = jnp.arange(q_len)[:, None]
    j = jnp.arange(kv_len)[None, :]
    visible = jnp.ones((q_len, kv_len), bool)
    if causal:
        visible = j <= i + (kv_len - q_len)  # bottom-right aligned
    visible = visible[None, None]  # [1, 1, q_len, kv_len]
    if kv_lengths is not None:
        visible = visible & (j < kv_lengths[:, None, None, None])

    # Softmax over the visible keys; a row with none gives zeros, not NaN.
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)

    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)
