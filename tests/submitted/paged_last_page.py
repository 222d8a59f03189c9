"""Known-bad paged kernel: the correct gather-then-attend, except that the last page's slots past a
sequence's length go into P·V unzeroed, so NaN kept there (which the contract allows) leaks as 0 * NaN."""
import jax.numpy as jnp

from paged_gather import paged_attention as _honest


def paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True, window_size=None):
    out = _honest(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices, scale=scale, causal=causal,
                  window_size=window_size)
    page_size = k_pages.shape[1]
    last = page_indices[jnp.arange(q.shape[0]), jnp.maximum(kv_lengths - 1, 0) // page_size]  # [b]
    tail = jnp.arange(page_size)[None] >= (kv_lengths[:, None] - 1) % page_size + 1            # [b, slots]
    leak = jnp.where(tail[..., None, None], v_pages[last], 0).sum(axis=(1, 2)).astype(jnp.float32)  # [b, d]
    return (out.astype(jnp.float32) + 0.0 * leak[:, None, None, :]).astype(q.dtype)


paged_attention.features = ("window",)
