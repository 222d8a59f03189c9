"""Vendor attention kernels wrapped in the candidate contract's signature, for comparison only."""

from __future__ import annotations

import jax


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    kv_lengths: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """cuDNN's fused attention, ``jax.nn.dot_product_attention(implementation="cudnn")``; GPU only.

    Same layouts as the contract (q ``[batch, q_len, num_q_heads, head_dim]``, k, v ``[batch,
    kv_len, num_kv_heads, head_dim]``), but cuDNN aligns the causal mask top-left and treats rows
    with no visible key differently: it equals the contract only for ``q_len == kv_len`` and no
    empty row (every ``kv_lengths[b] > 0``).
    """
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        key_value_seq_lengths=kv_lengths, implementation="cudnn")
