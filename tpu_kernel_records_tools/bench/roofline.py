"""Work counted per case (FLOPs, minimum bytes moved), achieved rates and the fraction of device peak.

Conventions (the same for every implementation of a case, so rates compare like with like):

* Attention FLOPs count the useful work only: ``4 * num_q_heads * head_dim`` per *visible*
  (query, key) pair, i.e. 2 FLOPs per multiply-add for Q·Kᵀ and again for P·V. Causal and padded
  pairs are not counted even when an implementation computes them (the XLA reference does).
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
  fp32 probabilities out). Intermediates that a fused kernel never writes are not counted.

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


def visible_pairs(q_len: int, kv_len: int, causal: bool, kv_lengths: np.ndarray | None, batch: int) -> int:
    """Number of visible (query, key) pairs summed over the batch, under the contract's masks."""
    lengths = np.full(batch, kv_len) if kv_lengths is None else np.minimum(np.asarray(kv_lengths), kv_len)
    total = 0
    for length in lengths.astype(np.int64):
        if causal:
            rows = np.arange(q_len, dtype=np.int64) + (kv_len - q_len) + 1  # keys j <= i + offset
            total += int(np.clip(np.minimum(rows, length), 0, None).sum())
        else:
            total += int(max(length, 0)) * q_len
    return total


BACKWARD_FLOPS_PER_FORWARD = 2.5  # five matmuls per visible pair against the forward's two


def attention_work(batch: int, q_len: int, kv_len: int, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, itemsize: int, causal: bool,
                   kv_lengths: np.ndarray | None, backward: bool = False) -> tuple[float, float]:
    """``(flops, min_bytes)`` of grouped-query attention under the conventions above.

    ``backward=False``: the forward ``(q, k, v, kv_lengths) -> out``. ``backward=True``: the
    forward and its VJP as one program ``(q, k, v, kv_lengths, d_out) -> (dq, dk, dv)``,
    ``1 + BACKWARD_FLOPS_PER_FORWARD`` times the forward's FLOPs.
    """
    flops = 4.0 * num_q_heads * head_dim * visible_pairs(q_len, kv_len, causal, kv_lengths, batch)
    q_sized = (3 if backward else 2) * batch * q_len * num_q_heads * head_dim  # q, out | q, d_out, dq
    kv_sized = (4 if backward else 2) * batch * kv_len * num_kv_heads * head_dim  # k, v (, dk, dv)
    lengths = 0 if kv_lengths is None else 4 * batch
    if backward:
        flops *= 1.0 + BACKWARD_FLOPS_PER_FORWARD
    return flops, float((q_sized + kv_sized) * itemsize + lengths)


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
