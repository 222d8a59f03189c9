"""Float64 NumPy ground truth of the paged contract (``kernel_src.contract``, ``paged_attention``).

Each sequence's keys are gathered through its page table, exactly ``kv_lengths[b]`` of them (never a
slot past the length, so whatever the pool holds there cannot reach the truth), and handed to the dense
float64 truth (``grading.dense.truth.attention``) as a cache of ``kv_len = kv_lengths[b]``: the dense contract
puts row ``i`` at ``i + kv_len - q_len``, which is then the paged position ``kv_lengths[b] - q_len + i``.

``dense_twin`` writes the same problem once more in the dense contract's own terms, for the rubric's
``paged-dense`` check and for the tests: the gathered caches right-aligned in one ``[batch, span]`` cache
and the leading slots of a shorter sequence marked off by segment ids.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...grading.dense import truth as oracle


class PagedTruth(NamedTuple):
    """Float64 results of one paged problem.

    ``out``: ``[batch, q_len, num_q_heads, head_dim]``; ``empty``: bool ``[batch, q_len]``, the rows that see
    no key (their output is exact zeros); ``magnitude``: ``{"out": P |V|}`` (``grading.dense.truth.Truth``);
    ``logit_max``: the largest ``|logit|`` over visible pairs (0 when none is)."""

    out: np.ndarray
    empty: np.ndarray
    magnitude: dict
    logit_max: float


def gather(pages: np.ndarray, page_indices: np.ndarray, length: int) -> np.ndarray:
    """``[length, num_kv_heads, head_dim]``: the first ``length`` keys (or values) of one sequence, read
    through its row of ``page_indices`` from ``pages`` ``[num_pages, page_size, num_kv_heads, head_dim]``;
    the pool's dtype is kept (only the pages that hold them are touched)."""
    page_size = pages.shape[1]
    used = -(-int(length) // page_size)
    rows = np.asarray(pages[np.asarray(page_indices[:used], np.int64)])
    return rows.reshape(used * page_size, *pages.shape[2:])[:length]


def paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale: float | None = None,
                    causal: bool = True, window=None, softcap: float | None = None, sinks=None,
                    magnitude_dtype=np.float32) -> PagedTruth:
    """The paged contract in float64, one sequence at a time through the dense truth.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; k_pages, v_pages ``[num_pages, page_size, num_kv_heads,
        head_dim]``; kv_lengths int ``[batch]``; page_indices int ``[batch, pages_per_sequence]`` (any
        array, JAX or NumPy, bf16 included; values are taken exactly).
      scale, causal, window, softcap, sinks: the contract's (``window`` is ``window_size``).
      magnitude_dtype: as in ``grading.dense.truth.attention``.
    """
    q = oracle.as_f64(q)
    k_pages, v_pages = np.asarray(k_pages), np.asarray(v_pages)
    lengths, table = np.asarray(kv_lengths, np.int64), np.asarray(page_indices, np.int64)
    batch, q_len, hq, d = q.shape
    out, magnitude = np.zeros(q.shape), np.zeros(q.shape)
    empty = np.ones((batch, q_len), bool)
    logit_max = 0.0
    for b in range(batch):
        n = int(lengths[b])
        if n <= 0:
            continue
        k, v = gather(k_pages, table[b], n)[None], gather(v_pages, table[b], n)[None]
        t = oracle.attention(q[b:b + 1], k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                             sinks=sinks, magnitude_dtype=magnitude_dtype)
        out[b], magnitude[b] = t.out[0], t.magnitude["out"][0]
        empty[b] = ~t.visible[0].any(axis=-1)
        logit_max = max(logit_max, t.logit_max)
    return PagedTruth(out, empty, {"out": magnitude}, logit_max)


class DenseTwin(NamedTuple):
    """A paged problem in the dense contract's terms: ``k``, ``v`` ``[batch, span, num_kv_heads, head_dim]``
    (sequence ``b``'s keys in the last ``kv_lengths[b]`` slots, zeros before them), ``q_segment_ids`` ones
    ``[batch, q_len]`` and ``kv_segment_ids`` ``[batch, span]``, 1 on a sequence's keys and 0 before them."""

    k: np.ndarray
    v: np.ndarray
    q_segment_ids: np.ndarray
    kv_segment_ids: np.ndarray


def dense_twin(q_len: int, k_pages, v_pages, kv_lengths, page_indices) -> DenseTwin:
    """The gathered cache right-aligned, so that the dense contract's bottom-right causal (row ``i`` at
    ``i + span - q_len``; key ``j`` of sequence ``b`` at ``j + span - kv_lengths[b]``) and window see
    exactly what the paged contract's row at ``kv_lengths[b] - q_len + i`` sees, and segment ids hide the
    slots before a shorter sequence. ``span`` is the longest length (at least 1)."""
    k_pages, v_pages = np.asarray(k_pages), np.asarray(v_pages)
    lengths, table = np.asarray(kv_lengths, np.int64), np.asarray(page_indices, np.int64)
    batch, span = len(lengths), max(1, int(lengths.max(initial=0)))
    k = np.zeros((batch, span, *k_pages.shape[2:]), k_pages.dtype)
    v = np.zeros_like(k)
    kv_ids = np.zeros((batch, span), np.int32)
    for b, n in enumerate(lengths):
        if n > 0:
            k[b, span - n:] = gather(k_pages, table[b], n)
            v[b, span - n:] = gather(v_pages, table[b], n)
            kv_ids[b, span - n:] = 1
    return DenseTwin(k, v, np.ones((batch, q_len), np.int32), kv_ids)
