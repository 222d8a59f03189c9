"""Float64 NumPy oracle of the candidate contract and its gradients.

Written from the contract text alone (no kernel_src import), so tests need not trust the code
under test. Layouts follow the contract: q ``[batch, q_len, num_q_heads, head_dim]``, k and v
``[batch, kv_len, num_kv_heads, head_dim]``. Everything is computed in float64.
"""

from __future__ import annotations

import numpy as np


def np_visible(batch: int, q_len: int, kv_len: int, causal: bool, kv_lengths=None) -> np.ndarray:
    """``[batch, q_len, kv_len]`` bool: may query ``i`` of batch ``b`` see key ``j``?"""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    ok = np.ones((batch, q_len, kv_len), dtype=bool)
    if causal:
        ok &= j <= i + (kv_len - q_len)
    if kv_lengths is not None:
        ok &= j[None] < np.asarray(kv_lengths).reshape(batch, 1, 1)
    return ok


def np_masked_softmax(logits, *, causal: bool = False, kv_lengths=None) -> np.ndarray:
    """Float64 softmax of ``[batch, heads, q_len, kv_len]`` logits; rows with no visible key are 0."""
    logits = np.asarray(logits, dtype=np.float64)
    batch, _, q_len, kv_len = logits.shape
    mask = np_visible(batch, q_len, kv_len, causal, kv_lengths)[:, None]
    masked = np.where(mask, logits, -np.inf)
    row_max = masked.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(mask, np.exp(masked - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)


def _forward(q, k, v, causal, kv_lengths, scale):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    num_q_heads, num_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    kv_head = np.arange(num_q_heads) // (num_q_heads // num_kv_heads)
    k_per_q, v_per_q = k[:, :, kv_head], v[:, :, kv_head]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k_per_q) * scale
    probs = np_masked_softmax(logits, causal=causal, kv_lengths=kv_lengths)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v_per_q)
    return out, probs, q, k_per_q, v_per_q, kv_head, scale


def np_attention(q, k, v, *, causal: bool = False, kv_lengths=None, scale=None) -> np.ndarray:
    """Float64 attention output ``[batch, q_len, num_q_heads, head_dim]``."""
    return _forward(q, k, v, causal, kv_lengths, scale)[0]


def np_attention_grads(q, k, v, do, *, causal: bool = False, kv_lengths=None, scale=None):
    """Float64 ``(dq, dk, dv)`` of ``sum(np_attention(q, k, v) * do)``, by the analytic backward.

    ``dS = P * (dP - rowsum(dP * P))``; K and V gradients of query heads sharing a kv head add up.
    """
    _, probs, q, k_per_q, v_per_q, kv_head, scale = _forward(q, k, v, causal, kv_lengths, scale)
    do = np.asarray(do, dtype=np.float64)
    dprobs = np.einsum("bqhd,bkhd->bhqk", do, v_per_q)
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", dlogits, k_per_q) * scale
    dk_per_q = np.einsum("bhqk,bqhd->bkhd", dlogits, q) * scale
    dv_per_q = np.einsum("bhqk,bqhd->bkhd", probs, do)
    dk = np.zeros(k_per_q.shape[:2] + (int(kv_head.max()) + 1, q.shape[3]))
    dv = np.zeros_like(dk)
    for h, kv in enumerate(kv_head):
        dk[:, :, kv] += dk_per_q[:, :, h]
        dv[:, :, kv] += dv_per_q[:, :, h]
    return dq, dk, dv
