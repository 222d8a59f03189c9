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


def jax_pages_per_block(page_size: int, pages_per_sequence: int, keys: int = 512) -> int:
    """``pages_per_compute_block`` for JAX's ``paged_attention``: the most pages of at most ``keys``
    keys (at least one) that divide ``pages_per_sequence``, as that kernel requires; 512 keys as the
    project's TPU paged kernel takes per step."""
    pages = max(1, min(pages_per_sequence, keys // page_size))
    while pages_per_sequence % pages:
        pages -= 1
    return pages


def jax_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, kv_lengths: jax.Array,
                        page_indices: jax.Array, scale: float | None = None, causal: bool = True,
                        pages_per_compute_block: int | None = None) -> jax.Array:
    """JAX's Pallas TPU ``paged_attention`` for a decode step, in the paged contract's call; TPU only.

    Differences from the paged contract: the pools are JAX's own layout ``[num_kv_heads, num_pages,
    page_size, head_dim]`` (the ``paged-decode`` benchmark lays them out so, on the host: a relayout
    of the cache in the timed program would be timed too); ``q`` is ``[batch, 1, num_q_heads,
    head_dim]`` only (one new row, at position ``kv_lengths[b] - 1``, so causal or not it sees every
    key); no window, soft-cap or sinks. JAX's kernel does not scale the logits: ``q`` is scaled here
    (in fp32, then rounded to its dtype). ``pages_per_compute_block``: ``jax_pages_per_block``'s
    by default. Each ``(sequence, kv head)`` copies whole blocks of that many pages, as long as the
    block starts before the sequence's length.
    """
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    del causal  # one new row, the last of its sequence: it sees every key either way
    batch, q_len, num_q_heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"JAX's paged_attention decodes one row per sequence, got q_len={q_len}")
    scale = head_dim ** -0.5 if scale is None else scale
    page_size, pages_per_sequence = k_pages.shape[2], page_indices.shape[1]
    blocks = pages_per_compute_block or jax_pages_per_block(page_size, pages_per_sequence)
    rows = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
    out = paged_attention(rows, k_pages, v_pages, kv_lengths.astype(jnp.int32), page_indices.astype(jnp.int32),
                          pages_per_compute_block=blocks)
    return out[:, None].astype(q.dtype)


def jax_ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, *, kv_lengths: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array, scale: float | None = None,
                               causal: bool = True, k_scale: float | None = None,
                               v_scale: float | None = None) -> jax.Array:
    """JAX's Pallas TPU ``ragged_paged_attention`` in the ragged contract's call; TPU only.

    Differences from the ragged contract: one pool in JAX's own layout ``[num_pages, page_size, 2 *
    num_kv_heads, head_dim]``, K at even heads and V at odd (the ``ragged`` benchmark lays it out so, on
    the host: a relayout of the cache in the timed program would be timed too), in place of ``k_pages``
    and ``v_pages``; causal only; no window, soft-cap or sinks; ``k_scale`` and ``v_scale`` Python floats
    (JAX's kernel takes no traced scale); ``head_dim`` whole 128-lane tiles. Its block sizes are its own
    tuned table's.
    """
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    if not causal:
        raise ValueError("JAX's ragged_paged_attention is causal only, got causal=False")
    head_dim = q.shape[-1]
    out = ragged_paged_attention(q, kv_pages, kv_lengths.astype(jnp.int32), page_indices.astype(jnp.int32),
                                 cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
                                 sm_scale=head_dim ** -0.5 if scale is None else float(scale),
                                 k_scale=None if k_scale is None else float(k_scale),
                                 v_scale=None if v_scale is None else float(v_scale))
    return out.astype(q.dtype)


jax_ragged_paged_attention.features = ("quantized_kv",)
