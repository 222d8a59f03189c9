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
    are measured against it (``grading.tolerance``). ``logit_max`` sets the tolerance floor's multiple;
    ``per_head_dkv`` (``attention(per_head=True)``) is each query head's share of dK and dV before the sum
    over its group. ``stored_out_grads`` (``attention(stored_dtype=...)``) is ``(dq, dk)`` computed exactly
    but for one rounding: ``di = rowsum(dO * O)`` taken from the output rounded to ``stored_dtype``, as
    FlashAttention-style backwards take it from the output they stored (dV does not depend on it).
    """

    out: np.ndarray
    dq: np.ndarray | None
    dk: np.ndarray | None
    dv: np.ndarray | None
    visible: np.ndarray
    probs: np.ndarray
    magnitude: dict
    logit_max: float = 0.0       # largest |logit| (capped, when soft-capped) over visible pairs (0 when none is)
    per_head_dkv: tuple | None = None  # (dk, dv) per query head, [b, kv_len, num_q_heads, d], when asked
    dsinks: np.ndarray | None = None   # [num_q_heads], when sinks and a cotangent were given
    stored_out_grads: tuple | None = None  # (dq, dk) with rowsum(dO * O) from the stored output, when asked


def visible_keys(batch: int, q_len: int, kv_len: int, causal: bool, kv_lengths: np.ndarray | None,
                 window=None, q_segment_ids=None, kv_segment_ids=None) -> np.ndarray:
    """Bool ``[batch, q_len, kv_len]``: query ``i`` sees key ``j`` (bottom-right causal, kv_lengths padding,
    the window ``(left, right)`` around position ``i + kv_len - q_len``, equal segment ids)."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    position = i + (kv_len - q_len)
    ok = np.ones((batch, q_len, kv_len), bool)
    if causal:
        ok &= (j <= position)[None]
    if kv_lengths is not None:
        ok &= j[None] < np.asarray(kv_lengths).reshape(batch, 1, 1)
    if window is not None:
        left, right = window
        if left is not None:
            ok &= (j >= position - left)[None]
        if right is not None:
            ok &= (j <= position + right)[None]
    if q_segment_ids is not None:
        ok &= np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :]
    return ok


def as_f64(x) -> np.ndarray:
    """Any array (JAX, NumPy, bf16 included) as a float64 NumPy array, values unchanged."""
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # float32's upper half: widened through its bits, 3x faster than the dtype's cast
        x = (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


def attention(q, k, v, ct=None, *, causal: bool = False, kv_lengths=None, scale: float | None = None,
              window=None, softcap: float | None = None, q_segment_ids=None, kv_segment_ids=None, sinks=None,
              magnitude_dtype=np.float64, per_head: bool = False, magnitudes: bool = True,
              stored_dtype=None) -> Truth:
    """The contract in float64: ``out = softmax(scale * q k^T, masked) v`` per query head.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; k, v: ``[batch, kv_len, num_kv_heads, head_dim]``.
        Any float dtype; the values are taken exactly and computed on in float64.
      ct: optional cotangent of ``out`` (same shape as ``q``); when given, gradients are returned.
      causal, kv_lengths, scale: as in the contract (``scale`` defaults to ``head_dim ** -0.5``).
      window, softcap, q_segment_ids, kv_segment_ids, sinks: the contract's features (``window`` is
        ``window_size``); with ``sinks`` and ``ct`` the truth also has ``dsinks``.
      magnitude_dtype: the dtype the magnitudes are computed in (float32: half the cost of their
        matmuls, for a scale that needs no more than float32's precision; returned as float64).
      per_head: also return ``per_head_dkv``. magnitudes: False leaves ``magnitude`` empty.
      stored_dtype: with ``ct``, also return ``stored_out_grads`` (the output stored in this dtype).

    Rows that see no key under the causal mask (queries ahead of every key) and keys past every
    kv_length are left out of the float64 products (their results are exact zeros anyway).
    """
    q, k, v = as_f64(q), as_f64(k), as_f64(v)
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else float(scale)
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)
    vis = visible_keys(batch, q_len, kv_len, causal, lengths, window, q_segment_ids, kv_segment_ids)
    extra = (softcap, None if sinks is None else as_f64(sinks), None if ct is None else stored_dtype)
    first = min(q_len, max(0, q_len - kv_len)) if causal else 0  # rows i < q_len - kv_len see no key
    keys = kv_len if lengths is None else int(min(kv_len, max(0, int(np.max(lengths, initial=0)))))
    if (first == 0 and keys == kv_len) or first == q_len or keys == 0:
        return _attention(q, k, v, None if ct is None else as_f64(ct), vis, scale, magnitude_dtype, per_head,
                          magnitudes, *extra)
    # The same computation on the rows and keys that take part, padded back with exact zeros.
    part = _attention(q[:, first:], k[:, :keys], v[:, :keys], None if ct is None else as_f64(ct)[:, first:],
                      vis[:, first:, :keys], scale, magnitude_dtype, per_head, magnitudes, *extra)

    def rows(x, axis=1):
        return None if x is None else _pad(x, axis, first, q_len - first - x.shape[axis])

    def cols(x, axis=1):
        return None if x is None else _pad(x, axis, 0, kv_len - x.shape[axis])

    probs = _pad(_pad(part.probs, 2, first, 0), 3, 0, kv_len - keys)
    mag = {n: m if n == "dsinks" else (rows if n in ("out", "dq") else cols)(m) for n, m in part.magnitude.items()}
    per = None if part.per_head_dkv is None else tuple(cols(x) for x in part.per_head_dkv)
    stored = None if part.stored_out_grads is None else (rows(part.stored_out_grads[0]), cols(part.stored_out_grads[1]))
    return Truth(rows(part.out), rows(part.dq), cols(part.dk), cols(part.dv), vis, probs, mag, part.logit_max, per,
                 part.dsinks, stored)


def _pad(x: np.ndarray, axis: int, before: int, after: int) -> np.ndarray:
    if before == 0 and after == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, after)
    return np.pad(x, widths)


def _attention(q, k, v, ct, vis, scale, magnitude_dtype, per_head, magnitudes, softcap=None, sinks=None,
               stored_dtype=None) -> Truth:
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    group = hq // hk
    mask = vis[:, None, None]  # [b, 1, 1, q, k]

    # Head-major views for batched matmuls (BLAS): queries [b, hk, g, q, d], keys/values [b, hk, 1, k, d].
    qg = q.reshape(batch, q_len, hk, group, d).transpose(0, 2, 3, 1, 4)
    kh, vh = (x.transpose(0, 2, 1, 3)[:, :, None] for x in (k, v))
    # The [b, hk, g, q, k] arrays are worked on in place (the same operations, so the same bits): a fresh
    # array per step cost more in page faults than in arithmetic on the long slots.
    s = _per_kv_head(qg, kh.swapaxes(-1, -2))
    s *= scale  # [b, hk, g, q, k]
    if softcap is not None:
        tanh = np.tanh(s / softcap)
        s = softcap * tanh
        slope = 1.0 - tanh * tanh  # d(capped)/d(uncapped)
    hidden = ~mask
    logit_max = max(0.0, float(np.max(s, where=mask, initial=0.0)), -float(np.min(s, where=mask, initial=0.0)))
    np.copyto(s, -np.inf, where=hidden)
    row_max = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(1, hk, group, 1, 1)
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(np.subtract(s, row_max, out=s), out=s)
    np.copyto(e, 0.0, where=hidden)
    denom = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        e_sink = np.exp(sink - row_max)
        denom = denom + e_sink
    p = np.divide(e, np.where(denom > 0, denom, 1.0), out=e)
    out = _token_major(_per_kv_head(p, vh), q.shape)
    probs = p.reshape(batch, hq, q_len, kv_len)
    m = magnitude_dtype
    pm, vm = p.astype(m, copy=False), np.abs(vh).astype(m)
    mag = {"out": _token_major(_per_kv_head(pm, vm), q.shape).astype(np.float64)} if magnitudes else {}
    if ct is None:
        return Truth(out, None, None, None, vis, probs, mag, logit_max)

    do = ct.reshape(batch, q_len, hk, group, d).transpose(0, 2, 3, 1, 4)
    pt = p.swapaxes(-1, -2)  # [b, hk, g, k, q]
    dv_h = pt @ do
    dp = _per_kv_head(do, vh.swapaxes(-1, -2))
    rowsum = (dp * p).sum(axis=-1, keepdims=True)  # dO . O per row
    ds = p * (dp - rowsum)
    dsinks = None
    if sinks is not None:  # d out / d sink = -p_sink * out: dsinks[h] = -sum over rows of p_sink * (dO . O)
        p_sink = np.where(denom > 0, e_sink / np.where(denom > 0, denom, 1.0), 0.0)
        dsinks = -(p_sink * rowsum).sum(axis=(0, 3, 4)).reshape(hq)
    if softcap is not None:
        ds = ds * slope
    dq = _token_major(_per_kv_head(ds, kh), q.shape) * scale
    dk_h = (ds.swapaxes(-1, -2) @ qg) * scale
    dk, dv = _kv_major(dk_h), _kv_major(dv_h)
    per = (_per_head(dk_h), _per_head(dv_h)) if per_head else None
    stored = None
    if stored_dtype is not None:  # dS moves by P * slope * (di - di'): linear in each row's change of di
        kept = out.astype(stored_dtype).astype(np.float64).reshape(batch, q_len, hk, group, d).transpose(0, 2, 3, 1, 4)
        shift = rowsum - (do * kept).sum(axis=-1, keepdims=True)  # [b, hk, g, q, 1]
        weight = p if softcap is None else p * slope
        stored = (dq + _token_major(_per_kv_head(weight, kh) * shift, q.shape) * scale,
                  dk + _kv_major(weight.swapaxes(-1, -2) @ (qg * shift)) * scale)

    if magnitudes:
        dom = np.abs(do).astype(m)
        dp_mag = _per_kv_head(dom, vm.swapaxes(-1, -2))
        rowsum_mag = (dp_mag * pm).sum(axis=-1, keepdims=True)
        ds_mag = pm * (dp_mag + rowsum_mag)
        if softcap is not None:
            ds_mag = ds_mag * slope.astype(m)
        mag["dv"] = _kv_major(pm.swapaxes(-1, -2) @ dom).astype(np.float64)
        mag["dq"] = (_token_major(_per_kv_head(ds_mag, np.abs(kh).astype(m)), q.shape) * scale).astype(np.float64)
        mag["dk"] = (_kv_major(ds_mag.swapaxes(-1, -2) @ np.abs(qg).astype(m)) * scale).astype(np.float64)
        if sinks is not None:
            mag["dsinks"] = (p_sink * rowsum_mag).sum(axis=(0, 3, 4)).reshape(hq).astype(np.float64)
    return Truth(out, dq, dk, dv, vis, probs, mag, logit_max, per, dsinks, stored)


def _per_kv_head(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for ``a`` ``[batch, hk, g, m, n]`` and ``b`` ``[batch, hk, 1, n, p]`` (one matrix per kv head,
    shared by its group): the group folded into ``a``'s rows, so each product is one BLAS call. NumPy's
    broadcasting matmul over the group took seconds (no BLAS) on caches of 100k keys."""
    batch, hk, g, m, n = a.shape
    out = a.reshape(batch, hk, g * m, n) @ b[:, :, 0]
    return out.reshape(batch, hk, g, m, out.shape[-1])


def _token_major(x: np.ndarray, shape) -> np.ndarray:
    """``[b, hk, g, q, d]`` as the contract's ``[b, q, hk * g, d]``."""
    return x.transpose(0, 3, 1, 2, 4).reshape(shape)


def _per_head(x: np.ndarray) -> np.ndarray:
    """``[b, hk, g, k, d]`` as ``[b, k, hk * g, d]`` (one slot per query head)."""
    b, hk, g, lk, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, lk, hk * g, d)


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
        outs.append(attention(q, kg, vg, causal=causal, kv_lengths=kv_lengths, scale=scale, magnitudes=False).out)
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
