"""Float64 NumPy ground truth of the candidate contract: forward output and Q/K/V gradients.

This is what every candidate (and the contract-precision reference) is measured against. It shares no
code with the JAX oracle in ``kernel_src.reference`` apart from the contract's wording, so a mistake
in one is not silently repeated in the other.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Truth(NamedTuple):
    """Float64 results; the gradient fields are ``None`` when no cotangent was given.

    ``out``/``dq``: ``[batch, q_len, num_q_heads, head_dim]``; ``dk``/``dv``: ``[batch, kv_len,
    num_kv_heads, head_dim]``; ``visible``: bool ``[batch, q_len, kv_len]``; ``probs``: ``[batch,
    num_q_heads, q_len, kv_len]`` (zero rows where no key is visible).

    ``magnitude`` maps "out", "dq", "dk", "dv" to the same computation carried out on absolute values
    (``P |V|`` for the output, ``P ⊙ (|dO||V|ᵀ + rowsum)`` through ``|K|``/``|Q|`` for dQ/dK, ...): the
    size of the terms each result sums. It equals ``|result|`` where nothing cancels and stays
    meaningful where the exact result cancels to zero (dQ of a row that sees a single key), so errors
    are measured against it (``grading.tolerance``).
    """

    out: np.ndarray
    dq: np.ndarray | None
    dk: np.ndarray | None
    dv: np.ndarray | None
    visible: np.ndarray
    probs: np.ndarray
    magnitude: dict


def visible_keys(batch: int, q_len: int, kv_len: int, causal: bool,
                 kv_lengths: np.ndarray | None) -> np.ndarray:
    """Bool ``[batch, q_len, kv_len]``: query ``i`` sees key ``j`` (bottom-right causal, kv_lengths padding)."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    ok = np.ones((batch, q_len, kv_len), bool)
    if causal:
        ok &= (j <= i + (kv_len - q_len))[None]
    if kv_lengths is not None:
        ok &= j[None] < np.asarray(kv_lengths).reshape(batch, 1, 1)
    return ok


def as_f64(x) -> np.ndarray:
    """Any array (JAX, NumPy, bf16 included) as a float64 NumPy array, values unchanged."""
    return np.asarray(x).astype(np.float64)


def attention(q, k, v, ct=None, *, causal: bool = False, kv_lengths=None, scale: float | None = None) -> Truth:
    """The contract in float64: ``out = softmax(scale * q k^T, masked) v`` per query head.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; k, v: ``[batch, kv_len, num_kv_heads, head_dim]``.
        Any float dtype; the values are taken exactly and computed on in float64.
      ct: optional cotangent of ``out`` (same shape as ``q``); when given, gradients are returned.
      causal, kv_lengths, scale: as in the contract (``scale`` defaults to ``head_dim ** -0.5``).
    """
    q, k, v = as_f64(q), as_f64(k), as_f64(v)
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = d ** -0.5 if scale is None else float(scale)
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    vis = visible_keys(batch, q_len, kv_len, causal, lengths)
    mask = vis[:, None, None]  # [b, 1, 1, q, k]

    # Head-major views for batched matmuls (BLAS): queries [b, hk, g, q, d], keys/values [b, hk, 1, k, d].
    qg = q.reshape(batch, q_len, hk, group, d).transpose(0, 2, 3, 1, 4)
    kh, vh = (x.transpose(0, 2, 1, 3)[:, :, None] for x in (k, v))
    s = (qg @ kh.swapaxes(-1, -2)) * scale  # [b, hk, g, q, k]
    s = np.where(mask, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(s - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1.0)
    out = _token_major(p @ vh, q.shape)
    probs = p.reshape(batch, hq, q_len, kv_len)
    mag = {"out": _token_major(p @ np.abs(vh), q.shape)}
    if ct is None:
        return Truth(out, None, None, None, vis, probs, mag)

    do = as_f64(ct).reshape(batch, q_len, hk, group, d).transpose(0, 2, 3, 1, 4)
    pt = p.swapaxes(-1, -2)  # [b, hk, g, k, q]
    dv = _kv_major(pt @ do)
    dp = do @ vh.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = _token_major(ds @ kh, q.shape) * scale
    dk = _kv_major(ds.swapaxes(-1, -2) @ qg) * scale

    dp_mag = np.abs(do) @ np.abs(vh).swapaxes(-1, -2)
    ds_mag = p * (dp_mag + (dp_mag * p).sum(axis=-1, keepdims=True))
    mag["dv"] = _kv_major(pt @ np.abs(do))
    mag["dq"] = _token_major(ds_mag @ np.abs(kh), q.shape) * scale
    mag["dk"] = _kv_major(ds_mag.swapaxes(-1, -2) @ np.abs(qg)) * scale
    return Truth(out, dq, dk, dv, vis, probs, mag)


def _token_major(x: np.ndarray, shape) -> np.ndarray:
    """``[b, hk, g, q, d]`` as the contract's ``[b, q, hk * g, d]``."""
    return x.transpose(0, 3, 1, 2, 4).reshape(shape)


def _kv_major(x: np.ndarray) -> np.ndarray:
    """``[b, hk, g, k, d]`` summed over the group, as the contract's ``[b, k, hk, d]``."""
    return x.sum(axis=2).transpose(0, 2, 1, 3)


def per_head_outputs(q, k, v, *, causal: bool = False, kv_lengths=None,
                     scale: float | None = None) -> np.ndarray:
    """``[num_kv_heads, batch, q_len, num_q_heads, head_dim]``: the output every query head would have
    if it read kv head ``g`` (index 0), used to name the kv head a candidate actually read."""
    q = as_f64(q)
    k, v = as_f64(k), as_f64(v)
    hq, hk = q.shape[2], k.shape[2]
    outs = []
    for g in range(hk):
        kg = np.repeat(k[:, :, g:g + 1], hq, axis=2)
        vg = np.repeat(v[:, :, g:g + 1], hq, axis=2)
        outs.append(attention(q, kg, vg, causal=causal, kv_lengths=kv_lengths, scale=scale).out)
    return np.stack(outs)


def masked_softmax(logits, causal: bool = False, kv_lengths=None) -> np.ndarray:
    """Float64 softmax over the key axis of ``[batch, heads, q_len, kv_len]`` logits under the
    contract's mask (bottom-right causal, ``kv_lengths`` padding); rows with no visible key are 0."""
    s = as_f64(logits)
    batch, _, q_len, kv_len = s.shape
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    mask = visible_keys(batch, q_len, kv_len, causal, lengths)[:, None]
    s = np.where(mask, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    return e / np.where(denom > 0, denom, 1.0)
