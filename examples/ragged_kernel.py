"""A correct ragged paged attention kernel to copy: plain JAX, one query row at a time.

Grade it (needs bubblewrap; see docs/SUBMITTING.md, "Ragged paged attention"):

    tpu-kernel-rubric --ragged --candidate examples/ragged_kernel.py:ragged_paged_attention --quick

The contract (``kernel_src/contract.py``, the ragged section), in short:

* ``q`` is ``[num_tokens, num_q_heads, head_dim]``: the new tokens of every sequence, one sequence after
  another. Sequence ``i < num_seqs[0]`` owns rows ``cu_q_lens[i] <= r < cu_q_lens[i + 1]`` (possibly none).
* ``k_pages``, ``v_pages`` are ``[num_pages, page_size, num_kv_heads, head_dim]``; key ``t < kv_lengths[i]``
  of sequence ``i`` is slot ``t % page_size`` of page ``page_indices[i, t // page_size]``.
* Row ``j`` of sequence ``i`` sits at position ``kv_lengths[i] - q_len_i + j`` (the new tokens are the
  sequence's last ones); ``causal`` (default True) hides the keys after it.
* Rows past ``cu_q_lens[num_seqs[0]]``, table and length entries past ``num_seqs[0]``, and every pool slot no
  key of a graded sequence is on may hold anything, NaN included: they must not change a graded row.
* Features: ``window_size=(left, right)``, ``softcap``, ``sinks`` as for the dense contract, and a quantized
  pool (``float8_e4m3fn`` or ``int8``, value = ``float32(stored) * k_scale`` or ``* v_scale``).
* Logits, softmax statistics and accumulation in float32; the output has ``q``'s dtype and shape.
"""

import functools

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _sequence_of_each_row(cu_q_lens, num_seqs, num_tokens):
    """Row r belongs to the number of sequences i + 1 <= num_seqs that end at or before it; a sequence with no
    rows ends where it starts and is skipped. Rows at or past cu_q_lens[num_seqs] are padding."""
    rows = jnp.arange(num_tokens)
    ends = cu_q_lens[1:]  # sequence i ends at ends[i]; entries past num_seqs are garbage
    real = jnp.arange(1, ends.shape[0] + 1) <= num_seqs[0]
    seq = jnp.sum(real[None, :] & (ends[None, :] <= rows[:, None]), axis=1)
    padding = rows >= cu_q_lens[num_seqs[0]]
    return jnp.where(padding, 0, seq), padding


def _dequantize(pages, scale):
    pages = pages.astype(jnp.float32)
    return pages if scale is None else pages * jnp.asarray(scale, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window_size", "softcap"))
def _ragged(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, sinks, k_scale, v_scale, *,
            scale, causal, window_size, softcap):
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    max_keys = page_indices.shape[1] * page_size
    seq, padding = _sequence_of_each_row(cu_q_lens, num_seqs, num_tokens)

    def one_row(r):
        i = seq[r]
        length = kv_lengths[i]
        q_len = cu_q_lens[i + 1] - cu_q_lens[i]
        position = length - q_len + (r - cu_q_lens[i])

        # The sequence's keys, gathered through its table: [max_keys, num_kv_heads, head_dim]. Slots past its
        # length may hold NaN: replace them (where, never a multiply: 0 * NaN is NaN).
        t = jnp.arange(max_keys)
        exists = t < length
        pages = page_indices[i, t // page_size]
        k = jnp.where(exists[:, None, None], _dequantize(k_pages[pages, t % page_size], k_scale), 0.0)
        v = jnp.where(exists[:, None, None], _dequantize(v_pages[pages, t % page_size], v_scale), 0.0)

        # Logits in float32: [num_kv_heads, group, max_keys].
        row = jnp.where(padding[r], 0.0, q[r].astype(jnp.float32)).reshape(num_kv_heads, group, head_dim)
        logits = jnp.einsum("hgd,khd->hgk", row, k, precision=HIGHEST) * scale
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)

        # Which keys the row sees.
        visible = exists
        if causal:
            visible = visible & (t <= position)
        if window_size is not None:
            left, right = window_size
            if left is not None:
                visible = visible & (t >= position - left)
            if right is not None:
                visible = visible & (t <= position + right)

        # Softmax over the visible keys (and the sinks' logits, which carry no value).
        logits = jnp.where(visible, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
            row_max = jnp.maximum(row_max, sink)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        weights = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        if sinks is not None:
            total = total + jnp.exp(sink - row_max)
        probs = weights / jnp.where(total > 0, total, 1.0)
        out = jnp.einsum("hgk,khd->hgd", probs, v, precision=HIGHEST).reshape(num_q_heads, head_dim)
        return jnp.where(padding[r], 0.0, out)

    return jax.lax.map(one_row, jnp.arange(num_tokens)).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                           causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _ragged(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, sinks, k_scale, v_scale,
                   scale=float(scale), causal=bool(causal),
                   window_size=None if window_size is None else tuple(window_size),
                   softcap=None if softcap is None else float(softcap))


ragged_paged_attention.features = ("window", "softcap", "sinks", "quantized_kv")
