"""Pure-JAX attention written the ways kernels are, which the built-in candidates are made of.

A dense masked attention whose switches are traced (the correct variant ``rounded-probs`` and most of the
known-bad ones), the online softmax over key chunks and the flash-style tiled attention with its own backward
(the correct variants, and the known-bad ones that break them one way), and split-KV decoding without the
parts' maxima. ``grading.candidates`` wraps them in the contract and registers them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kernel_src.reference import reference_attention

Attention = Callable[..., jax.Array]

# --------------------------------------------------------------------------------------------------
# One pure-JAX attention whose switches are *traced* values, so the correct variant and every bug built
# on it share one compiled executable per shape and dtype (most of the rubric's cost is XLA compiling).
# Each switch is written so that, when off, it adds no NaN to values or gradients.

class Switches(NamedTuple):
    """Runtime switches of :func:`_attend`; all off is the contract."""

    probs_in_input_dtype: bool = False  # round probabilities to the input dtype before P·V (allowed)
    ignore_causal: bool = False
    ignore_lengths: bool = False
    top_left: bool = False              # causal offset 0 instead of kv_len - q_len
    length_slack: int = 0               # key j valid while j < kv_lengths[b] + slack
    bf16_logits: bool = False           # logits and softmax statistics rounded to bfloat16
    tile_heads: bool = False            # query head h reads kv head h % num_kv_heads
    no_max: bool = False                # exp(s) without subtracting the row max
    nan_empty: bool = False             # 0 / 0 on rows with no visible key
    mean_empty: bool = False            # uniform weights on rows with no visible key
    stop_grad_k: bool = False
    head_dim_tile: bool = False         # logits from the first 128 of head_dim only (one 128-lane tile)
    query_tile_local: bool = False      # causal mask from the row index within its 128-row query tile
    key_tile_wrap: bool = False         # key j >= 256 reads K/V row j % 256 (tile index wraps at 2)
    large_kv_top_left: bool = False     # the kv_len >= 1024 code path aligns causal top-left


def rounded(x: jax.Array, dtype) -> jax.Array:
    """``x`` (fp32) rounded to ``dtype``'s precision, kept in fp32 (a bfloat16 operand of an fp32-accumulating
    matmul). ``lax.reduce_precision``, not ``astype(dtype).astype(float32)``: XLA may drop such a pair of
    converts (excess precision is allowed by default), and then the rounding never happens."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return x
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _attend(q, k, v, lengths, causal, scale, sw: Switches):
    lq, hq = q.shape[1], q.shape[2]
    lk, hk = k.shape[1], k.shape[2]
    heads = jnp.arange(hq)
    kv_head = jnp.where(sw.tile_heads, heads % hk, heads // (hq // hk))
    k, v = jnp.take(k, kv_head, axis=2), jnp.take(v, kv_head, axis=2)
    rows = jnp.where(sw.key_tile_wrap, jnp.arange(lk) % 256, jnp.arange(lk))
    k, v = jnp.take(k, rows, axis=1), jnp.take(v, rows, axis=1)
    k = jnp.where(sw.stop_grad_k, jax.lax.stop_gradient(k), k)
    q = q * jnp.where(sw.head_dim_tile & (jnp.arange(q.shape[-1]) >= 128), 0, 1).astype(q.dtype)

    def low(x):
        return jnp.where(sw.bf16_logits, rounded(x, jnp.bfloat16), x)

    s = low(jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32) * scale)
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    i = jnp.where(sw.query_tile_local, i % 128, i)
    offset = jnp.where(sw.top_left | (sw.large_kv_top_left & (lk >= 1024)), 0, lk - lq)
    vis = (j <= i + offset) | sw.ignore_causal | ~causal
    vis = vis[None, None] & ((j < lengths[:, None] + sw.length_slack) | sw.ignore_lengths)[:, None, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(low(jnp.where(jnp.isfinite(m) & ~sw.no_max, m, 0.0)))
    empty = ~jnp.any(vis, axis=-1, keepdims=True)
    e = low(jnp.where(vis, jnp.exp(s - m), jnp.where(sw.mean_empty & empty, 1.0, 0.0)))
    denom = low(jnp.sum(e, axis=-1, keepdims=True))
    p = e / jnp.where(sw.nan_empty | (denom > 0), denom, 1.0)
    p = jnp.where(sw.probs_in_input_dtype, rounded(p, q.dtype), p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


_attend_jit = jax.jit(_attend)


def _variant(default_scale: Callable[[int], float] = lambda d: d ** -0.5, **switches) -> Attention:
    """The contract on top of :func:`_attend` with some switches on (flags become traced values)."""
    sw = Switches(**switches)

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        batch, kv_len = k.shape[0], k.shape[1]
        lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
        scale = default_scale(q.shape[-1]) if scale is None else scale
        return _attend_jit(q, k, v, lengths, jnp.asarray(bool(causal)), jnp.asarray(scale, jnp.float32), sw)

    return attention


def _online_softmax(q, k, v, kv_lengths, *, causal, scale, chunk=16, bug: str = "", first_block_guard=True,
                    window_size=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, sinks=None):
    """Flash-style: running max, sum and fp32 accumulator over key chunks of ``chunk`` (a ``lax.scan``).

    The features, where given: each chunk builds its own mask (window around the row's position, equal
    segment ids), the cap is applied to the chunk's logits before its mask, and a row's running max and
    sum start from its head's sink (``m = sink``, ``l = 1``) instead of ``-inf`` and 0.

    ``bug`` (known-bad candidates only): "input-dtype-accumulator" ("bf16-accumulator") keeps the output
    accumulator and the running sum in the input dtype (in bfloat16) between chunks; "frozen-max" sets
    the running max from the first chunk with a visible key and never raises it. ``first_block_guard``
    False (a traced bool, so the bug and the correct variant share their programs) drops the guard on the
    running max (``exp(m - m_new)`` with both ``-inf`` is NaN) and instead starts the rows that see no key
    at all from ``m = 0``: a row whose first chunk its window or segment hides whole turns NaN.
    """
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    pad = -lk % chunk
    dtype = q.dtype
    acc_dtype = {"input-dtype-accumulator": dtype, "bf16-accumulator": jnp.bfloat16}.get(bug, jnp.float32)
    # fp32 copies (exact): autodiff through the scan then sums dQ (and dK, dV over the group) in fp32, not
    # per chunk in the input dtype, which the contract does not allow.
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k = jnp.pad(jnp.repeat(k, hq // hk, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(jnp.repeat(v, hq // hk, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    lengths = jnp.full((b,), lk) if kv_lengths is None else kv_lengths
    i = jnp.arange(lq)[:, None]
    left, right = (None, None) if window_size is None else window_size
    if q_segment_ids is not None:
        kv_ids = jnp.pad(kv_segment_ids, ((0, 0), (0, pad)))  # the padded keys are masked by j < lk

    def step(carry, start):
        m, l, acc = carry
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=1)
        j = start + jnp.arange(chunk)[None, :]
        vis = (j < lk) & ((j <= i + (lk - lq)) | (not causal))
        if left is not None:
            vis = vis & (j >= i + (lk - lq) - left)
        if right is not None:
            vis = vis & (j <= i + (lk - lq) + right)
        vis = vis[None, None] & (j[None, None] < lengths[:, None, None, None])
        if q_segment_ids is not None:
            ids = jax.lax.dynamic_slice_in_dim(kv_ids, start, chunk, axis=1)
            vis = vis & (q_segment_ids[:, None, :, None] == ids[:, None, None, :])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kc, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(vis, s, -jnp.inf)
        # The result does not depend on the running max, so no gradient flows through it.
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        if bug == "frozen-max":
            m_new = jnp.where(jnp.isfinite(m), m, m_new)
        m_new = jax.lax.stop_gradient(m_new)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
        if first_block_guard is not True:  # unguarded: exp(-inf - -inf) = NaN where m and m_new are -inf
            alpha = jnp.where(first_block_guard, alpha, jnp.exp(m - m_new))
            p = jnp.where(first_block_guard, p, jnp.where(vis, jnp.exp(s - m_new), 0.0))
        l = alpha * l.astype(jnp.float32) + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc.astype(jnp.float32) + jnp.einsum("bhqk,bkhd->bhqd", p, vc.astype(jnp.float32),
                                                           precision=jax.lax.Precision.HIGHEST)
        return (m_new, l.astype(acc_dtype), acc.astype(acc_dtype)), None

    if sinks is None:
        init = (jnp.full((b, hq, lq, 1), -jnp.inf, jnp.float32), jnp.zeros((b, hq, lq, 1), acc_dtype),
                jnp.zeros((b, hq, lq, d), acc_dtype))
        if first_block_guard is not True:  # unguarded, only a row with no visible key at all starts from m = 0
            empty = _row_sees_nothing(lq, lk, causal, lengths, window_size, q_segment_ids, kv_segment_ids)
            init = (jnp.where(~first_block_guard & empty[:, None, :, None], 0.0, init[0]), *init[1:])
    else:  # the sink is the row's first "key": m = sink and l = exp(sink - m) = 1 (its gradient is dsinks')
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (b, hq, lq, 1))
        m0 = jax.lax.stop_gradient(sink)
        init = (m0, jnp.exp(sink - m0).astype(acc_dtype), jnp.zeros((b, hq, lq, d), acc_dtype))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(0, lk + pad, chunk))
    l = l.astype(jnp.float32)
    out = acc.astype(jnp.float32) / jnp.where(l > 0, l, 1.0)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(dtype)


def _row_sees_nothing(lq, lk, causal, lengths, window_size, q_segment_ids, kv_segment_ids) -> jax.Array:
    """Bool ``[batch, q_len]``: rows that see no key (the contract's mask, whole rows at once)."""
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    left, right = (None, None) if window_size is None else window_size
    seen = (j <= i + (lk - lq)) | (not causal)
    if left is not None:
        seen = seen & (j >= i + (lk - lq) - left)
    if right is not None:
        seen = seen & (j <= i + (lk - lq) + right)
    seen = seen[None] & (j[None] < lengths[:, None, None])
    if q_segment_ids is not None:
        seen = seen & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return ~jnp.any(seen, axis=-1)


def _split_kv_without_maxima(q, k, v, kv_lengths, *, causal, scale, split=512):
    """Split-KV decoding (q_len <= 16): each ``split``-key part softmax-normalised on its own, the parts
    combined with weights ``l_i = sum exp(s - m_i)`` but *without* the factors ``exp(m_i - m)``."""
    b, lq, hq, d = q.shape
    lk = k.shape[1]
    if lq > 16 or lk <= split:
        return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    scale = d ** -0.5 if scale is None else scale
    lengths = jnp.full((b,), lk) if kv_lengths is None else kv_lengths
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    vis = ((j <= i + lk - lq) | (not causal))[None] & (j[None] < lengths[:, None, None])  # [b, q, k]
    kk = jnp.repeat(k, hq // k.shape[2], axis=2)
    vv = jnp.repeat(v, hq // k.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis[:, None], s, -jnp.inf)
    outs, weights = [], []
    for start in range(0, lk, split):
        part = s[..., start:start + split]
        m = jax.lax.stop_gradient(jnp.max(part, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(part - m)
        l = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("bhqk,bkhd->bhqd", e, vv[:, start:start + split].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) / jnp.where(l > 0, l, 1.0)
        outs.append(o * l)
        weights.append(l)
    total = sum(weights)
    out = sum(outs) / jnp.where(total > 0, total, 1.0)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


LOG2E = 1.4426950408889634


def _flash_style(q, k, v, kv_lengths, *, causal, scale, per_head_dkv=False, block_q=128, block_k=128,
                 window_size=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, sinks=None):
    """Correct, written the way fast kernels are (FlashAttention-2/3, the Pallas TPU kernels).

    Forward: query tiles of ``block_q`` rows times key tiles of ``block_k`` keys, online softmax in
    base 2 on logits pre-scaled by log2(e) (``exp2``), fp32 running max, sum and accumulator,
    probabilities rounded to the input dtype before P·V; saves the fp32 log-sum-exp. Backward
    (``jax.custom_vjp``): P recomputed from the log-sum-exp, ``di = rowsum(dO * O)`` with O as returned
    (input dtype), P and dS rounded to the input dtype before the dV, dQ and dK matmuls, fp32
    accumulation. ``per_head_dkv``: each query head's dK/dV contribution is rounded to the input dtype
    before the sum over its group (a backward run on repeated K/V heads).

    The features, where given, the way FlashAttention-2 and the Pallas kernels add them: each tile's mask
    from its own positions and segment ids; the cap on the tile's logits before the mask, its slope
    ``1 - tanh^2`` applied to dS in the backward; the sink as every row's first running max and sum (in
    base 2), in the saved log-sum-exp, and ``dsinks = -sum(P_sink * di)`` over the head's rows.
    """
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = d ** -0.5 if scale is None else scale
    lengths = jnp.full((b,), lk, jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
    dt = q.dtype
    hi = jax.lax.Precision.HIGHEST
    left, right = (None, None) if window_size is None else window_size
    segments = q_segment_ids is not None

    def visible(q_pos, k_pos, lengths, q_ids=None, kv_ids=None):  # q_pos [q, 1], k_pos [1, k], lengths [b]
        ok = (k_pos < lk) & ((k_pos <= q_pos + (lk - lq)) | (not causal))    # -> [b, 1, q, k]
        if left is not None:
            ok = ok & (k_pos >= q_pos + (lk - lq) - left)
        if right is not None:
            ok = ok & (k_pos <= q_pos + (lk - lq) + right)
        ok = ok[None, None] & (k_pos[None, None] < lengths[:, None, None, None])
        if q_ids is not None:  # q_ids [b, q], kv_ids [b, k]
            ok = ok & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
        return ok

    def capped(s):  # fp32 logits (scale applied) -> the cap's tanh, or None without a cap
        return None if softcap is None else jnp.tanh(s / softcap)

    def logits2(qh, kh):  # [b, h, q, d] x [b, h, k, d] -> base-2 logits [b, h, q, k] (fp32)
        if softcap is not None:
            s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, precision=hi, preferred_element_type=jnp.float32) * scale
            return softcap * capped(s) * LOG2E
        return jnp.einsum("bhqd,bhkd->bhqk", qh, kh, precision=hi, preferred_element_type=jnp.float32) \
            * (scale * LOG2E)

    def heads(x):  # [b, len, kv heads, d] -> [b, q heads, len, d] (each kv head read by its group)
        return jnp.transpose(jnp.repeat(x, g, axis=2), (0, 2, 1, 3))

    def forward(q, k, v, lengths, extra):
        q_ids, kv_ids, sink = extra
        nq, nk = -(-lq // block_q), -(-lk // block_k)
        qh = jnp.pad(jnp.transpose(q, (0, 2, 1, 3)), ((0, 0), (0, 0), (0, nq * block_q - lq), (0, 0)))
        kh = jnp.pad(heads(k), ((0, 0), (0, 0), (0, nk * block_k - lk), (0, 0)))
        vh = jnp.pad(heads(v), ((0, 0), (0, 0), (0, nk * block_k - lk), (0, 0)))
        if segments:
            q_ids = jnp.pad(q_ids, ((0, 0), (0, nq * block_q - lq)))
            kv_ids = jnp.pad(kv_ids, ((0, 0), (0, nk * block_k - lk)))

        def query_tile(qi):
            qt = jax.lax.dynamic_slice_in_dim(qh, qi * block_q, block_q, axis=2)
            q_pos = qi * block_q + jnp.arange(block_q)[:, None]
            q_tile_ids = jax.lax.dynamic_slice_in_dim(q_ids, qi * block_q, block_q, axis=1) if segments else None

            def key_tile(carry, ki):
                m, l, acc = carry
                kt = jax.lax.dynamic_slice_in_dim(kh, ki * block_k, block_k, axis=2)
                vt = jax.lax.dynamic_slice_in_dim(vh, ki * block_k, block_k, axis=2)
                if segments:
                    k_tile_ids = jax.lax.dynamic_slice_in_dim(kv_ids, ki * block_k, block_k, axis=1)
                    vis = visible(q_pos, ki * block_k + jnp.arange(block_k)[None, :], lengths, q_tile_ids,
                                  k_tile_ids)
                else:
                    vis = visible(q_pos, ki * block_k + jnp.arange(block_k)[None, :], lengths)
                s = jnp.where(vis, logits2(qt, kt), -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                alpha = jnp.exp2(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
                p = jnp.where(vis, jnp.exp2(s - m_safe), 0.0)
                l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
                pv = jnp.einsum("bhqk,bhkd->bhqd", rounded(p, dt), vt.astype(jnp.float32), precision=hi,
                                preferred_element_type=jnp.float32)
                return (m_new, l, alpha * acc + pv), None

            if sink is None:
                init = (jnp.full((b, hq, block_q, 1), -jnp.inf, jnp.float32),
                        jnp.zeros((b, hq, block_q, 1), jnp.float32), jnp.zeros((b, hq, block_q, d), jnp.float32))
            else:  # the sink opens every row: running max sink * log2(e), running sum exp2(0) = 1
                init = (jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None] * LOG2E, (b, hq, block_q, 1)),
                        jnp.ones((b, hq, block_q, 1), jnp.float32), jnp.zeros((b, hq, block_q, d), jnp.float32))
            (m, l, acc), _ = jax.lax.scan(key_tile, init, jnp.arange(nk))
            out = acc / jnp.where(l > 0, l, 1.0)
            lse2 = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), jnp.inf)  # base 2; +inf: no key
            return out, lse2

        out, lse2 = jax.lax.map(query_tile, jnp.arange(nq))  # [nq, b, h, block_q, ...]
        out = jnp.moveaxis(out, 0, 2).reshape(b, hq, nq * block_q, d)[:, :, :lq]
        lse2 = jnp.moveaxis(lse2, 0, 2).reshape(b, hq, nq * block_q, 1)[:, :, :lq]
        return jnp.transpose(out, (0, 2, 1, 3)).astype(dt), lse2

    # lengths and the feature arrays are arguments, not closures: custom_vjp functions may not close over
    # traced values.
    @jax.custom_vjp
    def attention(q, k, v, lengths, extra):
        return forward(q, k, v, lengths, extra)[0]

    def fwd(q, k, v, lengths, extra):
        out, lse2 = forward(q, k, v, lengths, extra)
        return out, (q, k, v, lengths, extra, out, lse2)

    def bwd(res, do):
        q, k, v, lengths, extra, out, lse2 = res
        q_ids, kv_ids, sink = extra
        qh, kh, vh = jnp.transpose(q, (0, 2, 1, 3)), heads(k), heads(v)
        doh = jnp.transpose(do.astype(dt), (0, 2, 1, 3))
        vis = visible(jnp.arange(lq)[:, None], jnp.arange(lk)[None, :], lengths, q_ids, kv_ids)
        p = jnp.where(vis, jnp.exp2(logits2(qh, kh) - lse2), 0.0)
        pr = rounded(p, dt)
        doh, vh, kh, qh = (x.astype(jnp.float32) for x in (doh, vh, kh, qh))
        dv = jnp.einsum("bhqk,bhqd->bhkd", pr, doh, precision=hi)
        dp = jnp.einsum("bhqd,bhkd->bhqk", doh, vh, precision=hi)
        di = jnp.sum(doh.astype(jnp.float32) * jnp.transpose(out, (0, 2, 1, 3)).astype(jnp.float32),
                     axis=-1, keepdims=True)
        if softcap is None:
            ds = rounded(p * (dp - di), dt)
        else:  # through the cap: d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            t = capped(jnp.einsum("bhqd,bhkd->bhqk", qh, kh, precision=hi) * scale)
            ds = rounded(p * (dp - di) * (1.0 - t * t), dt)
        dq = jnp.einsum("bhqk,bhkd->bhqd", ds, kh, precision=hi) * scale
        dk = jnp.einsum("bhqk,bhqd->bhkd", ds, qh, precision=hi) * scale

        def fold(x):  # [b, hq, lk, d] per query head -> [b, lk, hk, d] summed over each group
            if per_head_dkv:
                x = rounded(x, dt)
            return jnp.transpose(x.reshape(b, hk, g, lk, d).sum(axis=2), (0, 2, 1, 3)).astype(dt)

        dsink = None
        if sink is not None:  # the sink's probability in each row times -di, summed over the head's rows
            p_sink = jnp.exp2(sink.astype(jnp.float32)[None, :, None, None] * LOG2E - lse2)
            dsink = (-jnp.sum(p_sink * di, axis=(0, 2, 3))).astype(sink.dtype)
        return (jnp.transpose(dq, (0, 2, 1, 3)).astype(dt), fold(dk), fold(dv), None,
                (None, None, dsink))

    attention.defvjp(fwd, bwd)
    return attention(q, k, v, lengths, (q_segment_ids, kv_segment_ids, sinks))
