"""A correct paged kernel in pure JAX (``measure --candidate ... --paged``): gather each sequence's pages
into a dense cache, then attend with every slot it may not see masked out and zeroed (so NaN in unused
slots, pages and table entries changes nothing). Declares the window feature."""
import jax
import jax.numpy as jnp


def paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True, window_size=None):
    batch, q_len, num_q, head_dim = q.shape
    page_size, num_kv = k_pages.shape[1], k_pages.shape[2]
    pages = page_indices.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    k = k_pages[page_indices].reshape(batch, pages * page_size, num_kv, head_dim)  # [b, keys, kv heads, d]
    v = v_pages[page_indices].reshape(batch, pages * page_size, num_kv, head_dim)
    j = jnp.arange(pages * page_size)
    position = kv_lengths[:, None] - q_len + jnp.arange(q_len)[None]               # [b, q_len]
    visible = j[None, None] < kv_lengths[:, None, None]                             # [b, q_len, keys]
    if causal:
        visible &= j[None, None] <= position[..., None]
    if window_size is not None:
        left, right = window_size
        if left is not None:
            visible &= j[None, None] >= position[..., None] - left
        if right is not None:
            visible &= j[None, None] <= position[..., None] + right
    seen = jnp.any(visible, axis=1)[..., None, None]                                # keys some row sees
    k, v = (jnp.where(seen, x, 0).astype(jnp.float32) for x in (k, v))
    group = num_q // num_kv
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k,
                        precision=jax.lax.Precision.HIGHEST) * scale
    mask = visible[:, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


paged_attention.features = ("window",)
