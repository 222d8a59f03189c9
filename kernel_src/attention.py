"""Grouped-query attention whose masked softmax is the Pallas kernel in ``kernel_src.masked_softmax``.

XLA owns both matrix multiplications (Q·Kᵀ and P·V, fp32 accumulation at HIGHEST precision); the
Pallas kernel owns the masked softmax and its backward. This is the boundary the benchmark's
``attention`` scope measures against ``kernel_src.reference.reference_attention``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kernel_src.contract import check_inputs, default_scale
from kernel_src.masked_softmax import SoftmaxBlockSizes, masked_softmax

_HIGHEST = jax.lax.Precision.HIGHEST


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                     kv_lengths: jax.Array | None = None, scale: float | None = None,
                     interpret: Any = None, block_sizes: SoftmaxBlockSizes | None = None) -> jax.Array:
    """Attention under the candidate contract with a Pallas masked softmax.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype as ``q``; query head ``h``
        reads kv head ``h // (num_q_heads // num_kv_heads)`` (K and V are never repeated).
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding.
      scale: logit scale, ``head_dim ** -0.5`` by default.
      interpret, block_sizes: passed to ``masked_softmax``.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype; fp32 logits, probabilities and
      P·V accumulation; exact zeros for rows with no visible key. ``jax.grad`` flows through the
      kernel's custom VJP.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    scale = default_scale(dims.head_dim, scale)
    grouped = (dims.batch, dims.num_kv_heads, dims.group, dims.q_len, dims.kv_len)
    qg = q.reshape(dims.batch, dims.q_len, dims.num_kv_heads, dims.group, dims.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    probs = masked_softmax(logits.reshape(dims.batch, dims.num_q_heads, dims.q_len, dims.kv_len),
                           causal=causal, kv_lengths=kv_lengths, interpret=interpret,
                           block_sizes=block_sizes)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.reshape(grouped), v.astype(jnp.float32),
                     precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
