"""Ragged paged attention in Pallas: one call per serving step, for TPU and for GPU.

The ragged contract (``kernel_src.contract``): ``ragged_paged_attention(q, k_pages, v_pages, *,
kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None, causal=True, window_size=None,
softcap=None, sinks=None, k_scale=None, v_scale=None) -> out``: ``q [num_tokens, num_q_heads,
head_dim]`` holds the new rows of every sequence one after another (decode rows, chunks of
prefill and whole prompts mixed), sequence ``i < num_seqs[0]`` owning rows ``cu_q_lens[i] <= r <
cu_q_lens[i + 1]``, the last ``q_len_i`` positions of its ``kv_lengths[i]`` keys, which sit in
the pool through its row of ``page_indices``. The pool may be int8 or float8_e4m3fn with
``k_scale``, ``v_scale``. Forward only. One file per part:

* ``plan``: ``RaggedBlockSizes``, the call's static plan, the work list, the mask;
* ``tpu``: the Mosaic kernel: work list and page table in scalar prefetch, pages and q's and the
  output's rows DMA'd by hand, items of many rows reading their pages once;
* ``gpu``: the Triton kernel: keys gathered through the page table inside each program;
* ``api``: ``ragged_paged_attention_tpu`` and ``ragged_paged_attention_triton``.

Both declare the features ``window``, ``softcap``, ``sinks`` and ``quantized_kv``.

What has been exercised: both in interpret mode on CPU against a float64 NumPy truth
(``tests/test_ragged_kernels.py``), the Mosaic kernel compiled for a TPU v5e on a machine without
one (jax >= 0.7), the Triton kernel lowered to Triton IR via ``jax.export``.
What has not: running either compiled on a TPU or GPU from this repository's tests.
"""

from kernel_src.ragged.api import ragged_paged_attention_tpu, ragged_paged_attention_triton
from kernel_src.ragged.plan import RaggedBlockSizes

__all__ = ["RaggedBlockSizes", "ragged_paged_attention_tpu", "ragged_paged_attention_triton"]
