"""Pure-JAX oracle of the candidate contract (see ``kernel_src.contract``), every feature included."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_src.contract import (FEATURES, PAGED_FEATURES, RAGGED_FEATURES, Window, check_features, check_inputs,
                                 check_paged_features, check_paged_inputs, check_ragged_features, check_ragged_inputs,
                                 default_scale, dequantize, visibility_mask, visible)

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


def reference_ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, kv_lengths: jax.Array,
                                     page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                                     scale: float | None = None, causal: bool = True,
                                     window_size: Window | None = None, softcap: float | None = None,
                                     sinks: jax.Array | None = None, k_scale=None, v_scale=None) -> jax.Array:
    """The ragged paged contract (``kernel_src.contract``) in plain JAX: each row gathers its sequence's table.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``, bf16 or fp32: sequence ``i < num_seqs[0]`` owns rows
        ``cu_q_lens[i] <= r < cu_q_lens[i + 1]``; later rows are padding.
      k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]`` in q's dtype, or both float8_e4m3fn
        or both int8 with ``k_scale``, ``v_scale`` (float32 scalars): a key is ``float32(stored) * k_scale``.
      kv_lengths: int ``[max_seqs]``; page_indices: int ``[max_seqs, pages_per_sequence]``; cu_q_lens: int
        ``[max_seqs + 1]``; num_seqs: int ``[1]``. Entries past ``num_seqs[0]`` are never read as a sequence's.
      scale, causal, window_size, softcap, sinks: as in ``reference_attention``, with row ``cu_q_lens[i] + j`` at
        position ``kv_lengths[i] - q_len_i + j``.

    Returns:
      ``[num_tokens, num_q_heads, head_dim]`` in q's dtype: fp32 logits, statistics and accumulation, a
      dequantized pool rounded to q's dtype before the matmuls (as JAX's ``ref_ragged_paged_attention``).
      Keys past a length are replaced by zeros with ``where`` before any product and each row is computed
      on its own, so nothing in a slot no key is on, or in a padding row, reaches a graded row; padding rows
      are zeros.
    """
    dims = check_ragged_inputs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    window = check_ragged_features(dims, window_size=window_size, softcap=softcap, sinks=sinks)
    scale = default_scale(dims.head_dim, scale)
    t, hk, g, d, span = dims.num_tokens, dims.num_kv_heads, dims.group, dims.head_dim, dims.max_length
    owner, graded = row_owners(cu_q_lens, num_seqs, t)
    cu = cu_q_lens.astype(jnp.int32)
    length = kv_lengths.astype(jnp.int32)[owner]  # [t]: the row's sequence's length, its q_len and position
    position = length - (cu[owner + 1] - cu[owner]) + jnp.arange(t) - cu[owner]
    j = jnp.arange(span)
    exists = (j[None, :] < length[:, None])[:, :, None, None]  # [t, span, 1, 1]
    pages = page_indices.astype(jnp.int32)[owner]  # [t, pages_per_sequence]
    k, v = (x[pages].reshape(t, span, hk, d) for x in (k_pages, v_pages))  # only the pages the rows read
    if dims.quantized:
        k, v = (dequantize(x, s).astype(q.dtype) for x, s in ((k, k_scale), (v, v_scale)))
    k, v = jnp.where(exists, k, 0), jnp.where(exists, v, 0)
    logits = jnp.einsum("thgd,tkhd->thgk", q.reshape(t, hk, g, d), k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = visible(position[:, None], j[None, :], span, span, causal, length[:, None], window)  # [t, span]
    p = _softmax_where(logits[:, :, :, None], mask[:, None, None, None], None if sinks is None else
                       sinks.reshape(hk, g))[:, :, :, 0]
    out = jnp.einsum("thgk,tkhd->thgd", p, v.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(graded[:, None, None], out.reshape(q.shape), 0).astype(q.dtype)


reference_ragged_paged_attention.features = RAGGED_FEATURES


def row_owners(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """``(owner, graded)``: int32 ``[num_tokens]``, the sequence each row belongs to (0 for a padding row), and
    bool ``[num_tokens]``, whether it belongs to one. Only entries ``cu_q_lens[: num_seqs[0] + 1]`` are read as
    boundaries, so whatever follows them changes nothing."""
    cu = cu_q_lens.astype(jnp.int32)
    i = jnp.arange(cu.shape[0] - 1)
    r = jnp.arange(num_tokens)[:, None]
    belongs = (i[None, :] < num_seqs.astype(jnp.int32)[0]) & (cu[None, :-1] <= r) & (r < cu[None, 1:])
    return jnp.sum(jnp.where(belongs, i[None, :], 0), axis=1).astype(jnp.int32), jnp.any(belongs, axis=1)
