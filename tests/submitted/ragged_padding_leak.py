"""Known-bad ragged kernel: the example's correct one (``examples/ragged_kernel.py``, copied beside it), except that
q's last row goes into every output row times zero, so NaN in a padding row (which the contract allows) leaks as
0 * NaN. Random padding rows, as a timed call's, leak nothing."""
import jax.numpy as jnp

from ragged_kernel import ragged_paged_attention as _honest


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                           causal=True):
    out = _honest(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices, cu_q_lens=cu_q_lens,
                  num_seqs=num_seqs, scale=scale, causal=causal)
    return (out.astype(jnp.float32) + 0.0 * q[-1].astype(jnp.float32).sum()).astype(q.dtype)


ragged_paged_attention.features = ()
