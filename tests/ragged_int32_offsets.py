"""A ragged kernel with one bug (an independent tester's holdout, issue 53): K/V gathered from the flattened pool by
int32 element offsets, which wrap past 2^31 elements (`grading.ragged.big_pool`).

Ragged paged attention, every token of the batch at once, page by page (online softmax).

Each row finds its sequence and position, then one loop walks page slot j = 0 .. pages_per_sequence - 1
of every row's own table at once: the row gathers that page, masks it, and folds it into a running
max / sum / accumulator (fp32). Jitted; nothing is read back to the host."""
import functools

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _rows(cu_q_lens, num_seqs, tokens):
    """Each row's sequence (int32 [tokens]) and whether it is graded (bool [tokens])."""
    r = jnp.arange(tokens, dtype=jnp.int32)
    i = jnp.arange(1, cu_q_lens.shape[0], dtype=jnp.int32)
    counted = (i[None, :] <= num_seqs[0]) & (cu_q_lens[1:][None, :] <= r[:, None])  # @SEQ_COUNT
    seq = jnp.sum(counted, axis=1, dtype=jnp.int32)
    graded = r < cu_q_lens[num_seqs[0]]
    return jnp.where(graded, seq, 0), graded


def _flat(pages, page):
    """pages[page] by int32 element offsets into the flattened pool ([tokens, ps, hk, d])."""
    _, ps, hk, d = pages.shape
    off = (((page[:, None, None, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :, None, None]) * hk
            + jnp.arange(hk, dtype=jnp.int32)[None, None, :, None]) * d + jnp.arange(d, dtype=jnp.int32))
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(pages.reshape(-1), off[..., None], dims, (1,), mode=jax.lax.GatherScatterMode.CLIP)


def _dequant(x, s):
    x = x.astype(jnp.float32)
    return x if s is None else x * jnp.asarray(s, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window_size", "softcap"))
def _attend(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, sinks, k_scale, v_scale, *,
            scale, causal, window_size, softcap):
    tokens, hq, d = q.shape
    _, ps, hk, _ = k_pages.shape
    g = hq // hk
    seq, graded = _rows(cu_q_lens, num_seqs, tokens)
    start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - start
    length = kv_lengths[seq]
    pos = length - q_len + (jnp.arange(tokens, dtype=jnp.int32) - start)  # @POSITION
    first = jnp.zeros_like(pos)
    if window_size is not None and window_size[0] is not None:
        first = jnp.maximum(pos - window_size[0], 0)
    first_page = first // ps  # @FIRST_PAGE
    qf = jnp.where(graded[:, None, None], q, 0).astype(jnp.float32).reshape(tokens, hk, g, d)  # @QROWS
    table = page_indices[seq]  # [tokens, pages_per_sequence]

    def body(j, carry):
        m, l, acc = carry  # [tokens, hk, g], same, [tokens, hk, g, d]
        page = table[:, j]  # @PAGE_ID
        k = _dequant(_flat(k_pages, page), k_scale)  # BUG (KSCALE)
        v = _dequant(_flat(v_pages, page), v_scale)  # BUG (VSCALE)
        t = j * ps + jnp.arange(ps, dtype=jnp.int32)  # @KEY_POS
        exists = t[None, :] < length[:, None]  # [tokens, ps]
        k = jnp.where(exists[:, :, None, None], k, 0.0)
        v = jnp.where(exists[:, :, None, None], v, 0.0)  # @V_ZERO
        vis = exists & (j >= first_page)[:, None]
        if causal:
            vis = vis & (t[None, :] <= pos[:, None])  # @CAUSAL
        if window_size is not None:
            left, right = window_size
            if left is not None:
                vis = vis & (t[None, :] >= pos[:, None] - left)
            if right is not None:
                vis = vis & (t[None, :] <= pos[:, None] + right)
        s = jnp.einsum("thgd,tshd->thgs", qf, k, precision=_HI) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)  # @SOFTCAP
        s = jnp.where(vis[:, None, None, :], s, -jnp.inf)  # @MASK
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # @ROWMAX
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(m - shift)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("thgs,tshd->thgd", p, v, precision=_HI)
        return m_new, l, acc

    init = (jnp.full((tokens, hk, g), -jnp.inf, jnp.float32), jnp.zeros((tokens, hk, g), jnp.float32),
            jnp.zeros((tokens, hk, g, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, page_indices.shape[1], body, init)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(hk, g)[None]  # @SINK
        m_all = jnp.maximum(m, sink)
        l = l * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
        acc = acc * jnp.exp(m - m_all)[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(graded[:, None, None, None], out, 0.0)
    return out.reshape(tokens, hq, d).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                           causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window = None if window_size is None else tuple(window_size)
    as32 = lambda x: jnp.asarray(x, jnp.int32)
    return _attend(q, k_pages, v_pages, as32(kv_lengths), as32(page_indices), as32(cu_q_lens), as32(num_seqs),
                   sinks, k_scale, v_scale, scale=scale, causal=bool(causal), window_size=window,
                   softcap=None if softcap is None else float(softcap))


ragged_paged_attention.features = ("window", "softcap", "sinks", "quantized_kv")
