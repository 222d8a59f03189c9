"""Pure-JAX oracle of the candidate contract (see ``kernel_src.contract``), every feature included."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_src.contract import (FEATURES, PAGED_FEATURES, Window, check_features, check_inputs, check_paged_features,
                                 check_paged_inputs, default_scale, visibility_mask, visible)

_HIGHEST = jax.lax.Precision.HIGHEST


def reference_masked_softmax(logits: jax.Array, *, causal: bool = False,
                             kv_lengths: jax.Array | None = None, window: Window | None = None,
                             q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                             sinks: jax.Array | None = None) -> jax.Array:
    """Masked softmax over the last axis in fp32: the XLA side of the ``softmax`` benchmark scope.

    Args:
      logits: ``[batch, ..., q_len, kv_len]`` (any leading head axes), any float dtype.
      causal: bottom-right aligned causal mask.
      kv_lengths: optional int ``[batch]`` key lengths.
      window, q_segment_ids, kv_segment_ids: the contract's window ``(left, right)`` and segment ids.
      sinks: optional fp32 logits broadcasting against ``logits.shape[1:-2]`` (one per head): each
        joins its rows' denominators, in the same max-shifted frame, and takes no probability shown.

    Returns:
      fp32 probabilities of the same shape; rows with no visible key are exact zeros.
    """
    q_len, kv_len = logits.shape[-2:]
    mask = visibility_mask(q_len, kv_len, causal, kv_lengths, window, q_segment_ids, kv_segment_ids)
    mask = mask.reshape(mask.shape[:1] + (1,) * (logits.ndim - 3) + mask.shape[1:])
    return _softmax_where(logits, mask, sinks)


def _softmax_where(logits: jax.Array, mask: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """fp32 softmax over the last axis of the keys ``mask`` (broadcasting against ``logits``) shows, the
    sinks (broadcasting against ``logits.shape[1:-2]``) in each denominator; rows with no key are zeros."""
    logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[..., None, None], row_max.shape)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    return p / jnp.where(denom > 0, denom, 1.0)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                        kv_lengths: jax.Array | None = None, scale: float | None = None,
                        window_size: Window | None = None, softcap: float | None = None,
                        q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention in plain JAX, the oracle every kernel is checked against.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype as ``q``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding.
      scale: logit scale, ``head_dim ** -0.5`` by default.
      window_size: ``(left, right)``, ints >= 0 or None: row ``i`` at position ``p = i + kv_len - q_len``
        sees keys ``p - left <= j <= p + right``; a model's ``sliding_window=W`` is ``(W - 1, 0)``.
      softcap: float > 0: logits become ``softcap * tanh(scale * q.k / softcap)`` before masking.
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` and ``[batch, kv_len]``: equal ids only.
      sinks: fp32 ``[num_q_heads]``: one unscaled, uncapped logit per query head in each row's denominator.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype. Logits, softmax statistics and
      the P·V accumulation are fp32 (probabilities stay fp32). Rows with no visible key are exact
      zeros, and so are their gradients. ``jax.grad`` flows to q, k, v and sinks.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    window = check_features(dims, window_size=window_size, softcap=softcap, q_segment_ids=q_segment_ids,
                            kv_segment_ids=kv_segment_ids, sinks=sinks)
    scale = default_scale(dims.head_dim, scale)
    qg = q.reshape(dims.batch, dims.q_len, dims.num_kv_heads, dims.group, dims.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    grouped_sinks = None if sinks is None else sinks.reshape(dims.num_kv_heads, dims.group)
    p = reference_masked_softmax(logits, causal=causal, kv_lengths=kv_lengths, window=window,
                                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sinks=grouped_sinks)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)


reference_attention.features = FEATURES


def reference_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, kv_lengths: jax.Array,
                              page_indices: jax.Array, scale: float | None = None, causal: bool = True,
                              window_size: Window | None = None, softcap: float | None = None,
                              sinks: jax.Array | None = None) -> jax.Array:
    """The paged contract (``kernel_src.contract``) in plain JAX: gather every sequence's table, then attend.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``, same dtype as ``q``.
      kv_lengths: int ``[batch]``: keys ``j < kv_lengths[b]`` of sequence ``b`` exist.
      page_indices: int ``[batch, pages_per_sequence]``: key ``j`` is slot ``j % page_size`` of page
        ``page_indices[b, j // page_size]``.
      scale, causal, window_size, softcap, sinks: as in ``reference_attention``, with row ``i`` of sequence
        ``b`` at position ``kv_lengths[b] - q_len + i``.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype, computed as ``reference_attention``
      computes (fp32 logits, statistics and accumulation). Slots past a length are replaced by zeros
      with ``where`` before any product, so NaN or Inf there (or in any page no valid key is on) reaches
      no result; rows with no visible key are exact zeros.
    """
    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    window = check_paged_features(dims, window_size=window_size, softcap=softcap, sinks=sinks)
    scale = default_scale(dims.head_dim, scale)
    b, lq, hk, g, d = dims.batch, dims.q_len, dims.num_kv_heads, dims.group, dims.head_dim
    span = dims.max_length
    lengths = kv_lengths.astype(jnp.int32)
    j = jnp.arange(span)
    exists = (j[None, :] < lengths[:, None])[:, :, None, None]  # [b, span, 1, 1]
    pages = page_indices.astype(jnp.int32)
    k = jnp.where(exists, k_pages[pages].reshape(b, span, hk, d), 0)  # the gathered cache [b, span, hk, d]
    v = jnp.where(exists, v_pages[pages].reshape(b, span, hk, d), 0)
    qg = q.reshape(b, lq, hk, g, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = visible(jnp.arange(lq)[None, :, None], j[None, None, :], lq, lengths[:, None, None], causal, None,
                   window)  # [b, q_len, span]
    grouped_sinks = None if sinks is None else sinks.reshape(hk, g)
    p = _softmax_where(logits, mask[:, None, None], grouped_sinks)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)


reference_paged_attention.features = PAGED_FEATURES
