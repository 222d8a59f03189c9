"""Paged attention in Pallas: the decode kernel of serving engines, for TPU and for GPU.

The paged contract: ``paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices,
scale=None, causal=True, window_size=None, softcap=None, sinks=None) -> out``, with
``q [batch, q_len, num_q_heads, head_dim]``, pools ``[num_pages, page_size, num_kv_heads,
head_dim]`` and key ``j`` of sequence ``b`` at ``k_pages[page_indices[b, j // page_size],
j % page_size]`` for ``j < kv_lengths[b]``; the new rows are the last ``q_len`` of each sequence.
Whatever else the pool and the table hold (NaN, Inf, out-of-range entries past a sequence's last
page) changes nothing. Forward only. One file per part:

* ``plan``: ``PagedBlockSizes``, the call's static plan, the row layout and the mask;
* ``tpu``: the Mosaic kernel: page table in scalar prefetch, pages DMA'd by hand, double-buffered;
* ``gpu``: the Triton kernel: keys gathered through the page table inside each program;
* ``api``: ``paged_attention_tpu`` and ``paged_attention_triton``.

Both declare the features ``window``, ``softcap`` and ``sinks`` (``features``); segment ids are
not part of the paged contract.

What has been exercised: both run in interpret mode on CPU against a float64 gather-then-attend
reference (``tests/test_paged_kernels.py``; the Mosaic kernel also under the strict TPU
interpreter: races, NaN-filled VMEM, out-of-bounds reads) and pass the paged rubric's full level
on seeds 0-2 (``tpu-kernel-rubric --paged``, built-ins ``paged-pallas`` and ``paged-triton``), the
Mosaic kernel compiles for a TPU v5e on a machine without one under jax 0.10 and 0.6.2 (the
Kaggle image's: ``tpu``'s layout "rows"; slow tests there), and the Triton
kernel lowers to Triton IR via ``jax.export``.
What has not: running either compiled on a TPU or GPU from this repository's tests.
"""

from kernel_src.paged.api import paged_attention_triton, paged_attention_tpu
from kernel_src.paged.plan import PagedBlockSizes

__all__ = ["PagedBlockSizes", "paged_attention_tpu", "paged_attention_triton"]
