"""Work counted per case (FLOPs, minimum bytes moved), achieved rates and the fraction of device peak.

Conventions (the same for every implementation of a case, so rates compare like with like):

* Attention FLOPs count the useful work only: ``4 * num_q_heads * head_dim`` per *visible*
  (query, key) pair, i.e. 2 FLOPs per multiply-add for Q·Kᵀ and again for P·V. Causal and padded
  pairs are not counted even when an implementation computes them (the XLA reference does), nor are
  pairs a sliding window or segment ids hide (``visible_pairs``: each row's window is an interval of
  keys, counted in closed form; with segment ids the keys of the row's id inside that interval are
  counted). A soft-cap's ``tanh`` and a sink's extra term are not matmul work and add nothing.
* Forward + backward (the ``model-fwd-bwd`` scope): ``3.5`` times the forward FLOPs, the
  convention of the FlashAttention papers: the backward's useful work is five matmuls per visible
  pair (S = Q·Kᵀ recomputed, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q) against the forward's
  two, so 2.5 times the forward. Causal attention counts about half of the dense pairs
  (``s * (s + 1) / 2`` of ``s**2``), in both passes.
* Softmax FLOPs: ``5`` per logit element (max, subtract, exp, sum, divide), over every element,
  masked or not, since each must be read and written.
* Minimum bytes: every input read once and every output written once, at their dtypes
  (attention: q, k, v, kv_lengths in, out in the input dtype; forward + backward: q, k, v,
  kv_lengths and the output cotangent in, dq, dk, dv out; softmax: logits and kv_lengths in,
  fp32 probabilities out; int32 segment ids and fp32 sinks in where given, and fp32 dsinks out
  with the backward). Intermediates that a fused kernel never writes are not counted.
* Paged decode (``paged_work``, the ``paged-decode`` scope): the useful bytes are the K/V actually
  read: each key some new row sees, its K and V once (a key past a sequence's length, in a page no
  row reaches or before a window counts nothing, however the pool is laid out), plus q read and
  the output written once; the page table and lengths are not counted. FLOPs as above, per
  sequence at its own length (its new rows are its last ``q_len`` positions).
* Ragged paged steps (``ragged_work``, the ``ragged`` scope): as paged decode, each sequence with its
  own count of new rows; K and V at the cache's itemsize (1 byte for float8_e4m3fn), q and the
  output at theirs.

Peaks (dense, per device; ``None`` for a device the table does not know):

* TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM (Google Cloud TPU v5e documentation).
* NVIDIA H100 SXM: 989 TFLOP/s bf16 dense, 3350 GB/s; H100 PCIe: 756 TFLOP/s, 2000 GB/s
  (NVIDIA H100 datasheet; the datasheet's larger figures assume 2:4 sparsity).
* NVIDIA H200: 989 TFLOP/s bf16 dense, 4800 GB/s (NVIDIA H200 datasheet).
* NVIDIA A100: 312 TFLOP/s bf16 dense; 2039 GB/s (SXM 80GB), 1935 GB/s (PCIe 80GB),
  1555 GB/s (40GB) (NVIDIA A100 datasheet).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np


class Peak(NamedTuple):
    flops_per_s: float
    bytes_per_s: float


# (pattern on device_kind, case-insensitive) -> peak; the first match wins, so specific before general.
PEAKS: tuple[tuple[str, Peak], ...] = (
    (r"tpu v5 ?lite|tpu v5e", Peak(197e12, 819e9)),
    (r"h200", Peak(989e12, 4800e9)),
    (r"h100.*pcie", Peak(756e12, 2000e9)),
    (r"h100", Peak(989e12, 3350e9)),
    (r"a100.*80gb.*pcie|a100.*pcie.*80gb", Peak(312e12, 1935e9)),
    (r"a100.*80gb", Peak(312e12, 2039e9)),
    (r"a100", Peak(312e12, 1555e9)),
)


def device_peak(device_kind: str) -> Peak | None:
    """The table's peak for ``device_kind`` (e.g. ``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``)."""
    for pattern, peak in PEAKS:
        if re.search(pattern, device_kind, re.IGNORECASE):
            return peak
    return None


def _row_intervals(q_len: int, kv_len: int, causal: bool, length: int,
                   window: tuple[int | None, int | None] | None) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` int64 ``[q_len]``: the keys ``lo <= j <= hi`` row ``i`` may see before segment ids
    (empty where ``hi < lo``): the contract's masks are each an interval around the row's position
    ``p = i + kv_len - q_len``: ``j <= p`` (causal), ``j < length``, ``p - left <= j <= p + right``."""
    position = np.arange(q_len, dtype=np.int64) + (kv_len - q_len)
    lo = np.zeros(q_len, np.int64)
    hi = np.full(q_len, min(max(int(length), 0), kv_len) - 1, np.int64)
    if causal:
        hi = np.minimum(hi, position)
    left, right = window if window is not None else (None, None)
    if left is not None:
        lo = np.maximum(lo, position - int(left))
    if right is not None:
        hi = np.minimum(hi, position + int(right))
    return lo, hi


def _same_id_counts(lo: np.ndarray, hi: np.ndarray, q_ids: np.ndarray, kv_ids: np.ndarray) -> np.ndarray:
    """Per row ``i``: how many keys ``lo[i] <= j <= hi[i]`` have ``kv_ids[j] == q_ids[i]`` (any ids:
    repeated, unsorted, A B A). Keys sorted by (id, position); two binary searches per row."""
    codes, inverse = np.unique(np.concatenate([np.asarray(q_ids), np.asarray(kv_ids)]), return_inverse=True)
    q_code, kv_code = inverse[:len(q_ids)].astype(np.int64), inverse[len(q_ids):].astype(np.int64)
    stride = len(kv_ids) + 1
    keys = np.sort(kv_code * stride + np.arange(len(kv_ids), dtype=np.int64))
    below = np.searchsorted(keys, q_code * stride + lo, side="left")
    upto = np.searchsorted(keys, q_code * stride + np.maximum(hi, lo - 1), side="right")
    return upto - below


def visible_pairs(q_len: int, kv_len: int, causal: bool, kv_lengths: np.ndarray | None, batch: int,
                  window: tuple[int | None, int | None] | None = None,
                  q_segment_ids: np.ndarray | None = None, kv_segment_ids: np.ndarray | None = None) -> int:
    """Number of visible (query, key) pairs summed over the batch, under the contract's masks
    (``kernel_src.contract.visible``): causal (bottom-right), ``kv_lengths``, ``window=(left, right)``
    (either side None: unbounded) and segment ids (``[batch, q_len]`` and ``[batch, kv_len]``, both or
    neither: only equal ids see each other). Exact: each row's keys are an interval (closed form), and
    with segment ids the keys of its id in that interval are counted."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids go together: give both or neither")
    lengths = np.full(batch, kv_len) if kv_lengths is None else np.minimum(np.asarray(kv_lengths), kv_len)
    total = 0
    for b, length in enumerate(lengths.astype(np.int64)):
        lo, hi = _row_intervals(q_len, kv_len, causal, int(length), window)
        if q_segment_ids is None:
            total += int(np.clip(hi - lo + 1, 0, None).sum())
        else:
            total += int(_same_id_counts(lo, hi, np.asarray(q_segment_ids)[b], np.asarray(kv_segment_ids)[b]).sum())
    return total


BACKWARD_FLOPS_PER_FORWARD = 2.5  # five matmuls per visible pair against the forward's two


def attention_work(batch: int, q_len: int, kv_len: int, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, itemsize: int, causal: bool,
                   kv_lengths: np.ndarray | None, backward: bool = False,
                   window: tuple[int | None, int | None] | None = None,
                   q_segment_ids: np.ndarray | None = None, kv_segment_ids: np.ndarray | None = None,
                   sinks: bool = False) -> tuple[float, float]:
    """``(flops, min_bytes)`` of grouped-query attention under the conventions above.

    ``backward=False``: the forward ``(q, k, v, kv_lengths) -> out``. ``backward=True``: the
    forward and its VJP as one program ``(q, k, v, kv_lengths, d_out) -> (dq, dk, dv)``,
    ``1 + BACKWARD_FLOPS_PER_FORWARD`` times the forward's FLOPs. ``window`` and the segment ids
    hide pairs (``visible_pairs``); segment ids and ``sinks`` (fp32 ``[num_q_heads]``, and their
    gradient with the backward) add their bytes.
    """
    pairs = visible_pairs(q_len, kv_len, causal, kv_lengths, batch, window, q_segment_ids, kv_segment_ids)
    flops = 4.0 * num_q_heads * head_dim * pairs
    q_sized = (3 if backward else 2) * batch * q_len * num_q_heads * head_dim  # q, out | q, d_out, dq
    kv_sized = (4 if backward else 2) * batch * kv_len * num_kv_heads * head_dim  # k, v (, dk, dv)
    lengths = 0 if kv_lengths is None else 4 * batch
    segments = 0 if q_segment_ids is None else 4 * batch * (q_len + kv_len)
    sink_bytes = (2 if backward else 1) * 4 * num_q_heads if sinks else 0  # sinks (, dsinks)
    if backward:
        flops *= 1.0 + BACKWARD_FLOPS_PER_FORWARD
    return flops, float((q_sized + kv_sized) * itemsize + lengths + segments + sink_bytes)


def paged_keys(q_len: int, length: int, causal: bool,
               window: tuple[int | None, int | None] | None) -> tuple[int, int]:
    """``(visible pairs, keys read)`` of one paged sequence of ``length`` keys whose ``q_len`` new rows
    are its last positions: pairs under the contract's masks (``visible_pairs``), and the keys some
    row sees (the union of the rows' intervals)."""
    # the sequence's keys as a dense cache of exactly its length: row i at position length - q_len + i (< 0: no key)
    lo, hi = _row_intervals(q_len, int(length), causal, int(length), window)
    keep = hi >= lo
    if not keep.any():
        return 0, 0
    marks = np.zeros(max(int(length), 1) + 1, np.int64)
    np.add.at(marks, lo[keep], 1)
    np.add.at(marks, hi[keep] + 1, -1)
    return int((hi[keep] - lo[keep] + 1).sum()), int((np.cumsum(marks)[:-1] > 0).sum())


def paged_work(kv_lengths: np.ndarray, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               itemsize: int, causal: bool = True,
               window: tuple[int | None, int | None] | None = None) -> tuple[float, float]:
    """``(flops, useful_bytes)`` of one paged-attention call (``kernel_src.contract.paged_attention``)
    over sequences of ``kv_lengths`` keys: ``ragged_work`` with ``q_len`` new rows each, the cache in
    the queries' dtype."""
    q_lens = np.full(len(kv_lengths), q_len, np.int64)
    return ragged_work(q_lens, kv_lengths, num_q_heads, num_kv_heads, head_dim, itemsize, itemsize, causal, window)


def ragged_work(q_lens: np.ndarray, kv_lens: np.ndarray, num_q_heads: int, num_kv_heads: int, head_dim: int,
                kv_itemsize: int, q_itemsize: int, causal: bool = True,
                window: tuple[int | None, int | None] | None = None) -> tuple[float, float]:
    """``(flops, least useful bytes)`` of one ragged paged call (``kernel_src.contract.ragged_paged_attention``)
    whose sequence ``i`` has ``q_lens[i]`` new rows ending its ``kv_lens[i]`` keys: FLOPs per visible pair,
    bytes the K and V of every key some row sees, once, at the cache's ``kv_itemsize`` (a quantized cache's
    scales not counted), plus q read and the output written at ``q_itemsize`` (``paged_keys``)."""
    pairs = keys = 0
    for q_len, length in zip(np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)):
        p, k = paged_keys(int(q_len), int(length), causal, window)
        pairs, keys = pairs + p, keys + k
    rows = int(np.asarray(q_lens, np.int64).sum())
    return (4.0 * num_q_heads * head_dim * pairs,
            float(2 * keys * num_kv_heads * head_dim * kv_itemsize + 2 * rows * num_q_heads * head_dim * q_itemsize))


def softmax_work(batch: int, heads: int, q_len: int, kv_len: int, itemsize: int,
                 padded: bool) -> tuple[float, float]:
    """``(flops, min_bytes)`` of masked softmax over ``[batch, heads, q_len, kv_len]`` logits."""
    elements = batch * heads * q_len * kv_len
    return 5.0 * elements, float(elements * (itemsize + 4) + (4 * batch if padded else 0))


def rates(flops: float | None, bytes_moved: float | None, median_ms: float | None,
          device_kind: str, devices: int) -> dict[str, float | None]:
    """Achieved TFLOP/s and GB/s at the median, and their fractions of ``devices`` devices' peak."""
    out = dict.fromkeys(("tflops", "gbps", "peak_flops_fraction", "peak_bandwidth_fraction"))
    if median_ms is None or median_ms <= 0:
        return out
    seconds = median_ms * 1e-3
    peak = device_peak(device_kind)
    if flops is not None:
        out["tflops"] = flops / seconds / 1e12
        if peak is not None:
            out["peak_flops_fraction"] = flops / seconds / (peak.flops_per_s * devices)
    if bytes_moved is not None:
        out["gbps"] = bytes_moved / seconds / 1e9
        if peak is not None:
            out["peak_bandwidth_fraction"] = bytes_moved / seconds / (peak.bytes_per_s * devices)
    return out
