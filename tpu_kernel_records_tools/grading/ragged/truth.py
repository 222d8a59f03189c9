"""Float64 NumPy ground truth of the ragged paged contract (``kernel_src.contract``, ``ragged_paged_attention``).

Each sequence ``i < num_seqs[0]`` is taken on its own: its rows ``cu_q_lens[i] <= r < cu_q_lens[i + 1]``, its
first ``kv_lengths[i]`` keys gathered through its row of the table (``grading.paged.truth.gather``: never a slot
past the length), dequantized in float64 when the pool is quantized (``float64(stored) * scale``), and handed
to the dense float64 truth (``grading.dense.truth.attention``) as a cache of ``kv_len = kv_lengths[i]``: the
dense contract puts row ``j`` at ``j + kv_len - q_len_i``, the ragged position. Rows past
``cu_q_lens[num_seqs[0]]`` are not graded and nothing past ``num_seqs[0]`` is read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...grading.dense import truth as oracle
from ...grading.paged.truth import gather


class RaggedTruth(NamedTuple):
    """Float64 results of one ragged call.

    ``out``: ``[num_tokens, num_q_heads, head_dim]`` (zeros on padding rows); ``graded``: bool ``[num_tokens]``,
    the rows some sequence owns; ``owner``: int ``[num_tokens]``, that sequence (-1 on padding rows);
    ``magnitude``: ``{"out": P |V|}`` (``grading.dense.truth.Truth``); ``logit_max``: the largest ``|logit|``
    over visible pairs."""

    out: np.ndarray
    graded: np.ndarray
    owner: np.ndarray
    magnitude: dict
    logit_max: float


def keys(pages, scale, page_indices, length: int) -> np.ndarray:
    """``[length, num_kv_heads, head_dim]`` float64: one sequence's keys (or values), dequantized with ``scale``
    when it is not None."""
    stored = oracle.as_f64(gather(np.asarray(pages), page_indices, length))
    return stored if scale is None else stored * float(np.asarray(scale, np.float64))


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs,
                           scale: float | None = None, causal: bool = True, window=None, softcap: float | None = None,
                           sinks=None, k_scale=None, v_scale=None, magnitude_dtype=np.float32) -> RaggedTruth:
    """The ragged contract in float64, one sequence at a time through the dense truth.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``; k_pages, v_pages ``[num_pages, page_size, num_kv_heads,
        head_dim]`` (any dtype, quantized ones included: values are taken exactly); kv_lengths int
        ``[max_seqs]``; page_indices int ``[max_seqs, pages_per_sequence]``; cu_q_lens int ``[max_seqs + 1]``;
        num_seqs int ``[1]``.
      scale, causal, window, softcap, sinks, k_scale, v_scale: the contract's (``window`` is ``window_size``).
      magnitude_dtype: as in ``grading.dense.truth.attention``.
    """
    q = oracle.as_f64(q)
    lengths, table = np.asarray(kv_lengths, np.int64), np.asarray(page_indices, np.int64)
    cu, count = np.asarray(cu_q_lens, np.int64), int(np.asarray(num_seqs).reshape(-1)[0])
    out, magnitude = np.zeros(q.shape), np.zeros(q.shape)
    owner = np.full(q.shape[0], -1, np.int64)
    logit_max = 0.0
    for i in range(count):
        start, end, n = int(cu[i]), int(cu[i + 1]), int(lengths[i])
        if end <= start:
            continue
        k, v = keys(k_pages, k_scale, table[i], n)[None], keys(v_pages, v_scale, table[i], n)[None]
        t = oracle.attention(q[None, start:end], k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                             sinks=sinks, magnitude_dtype=magnitude_dtype)
        out[start:end], magnitude[start:end] = t.out[0], t.magnitude["out"][0]
        owner[start:end] = i
        logit_max = max(logit_max, t.logit_max)
    return RaggedTruth(out, owner >= 0, owner, {"out": magnitude}, logit_max)
