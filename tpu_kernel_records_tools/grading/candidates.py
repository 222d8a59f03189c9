"""Candidates the rubric grades: the reference, the kernels, correct variants, known-bad ones, any user's.

Every candidate follows the contract ``attention(q, k, v, *, causal=False, kv_lengths=None, scale=None)``
(``kernel_src.contract``), plus the arguments of the features it declares (the feature built-ins declare all
four). ``BUILTIN`` maps a name to a :class:`Candidate`; :func:`resolve` also accepts
``path/to/file.py:function`` and ``package.module:function``. Loading is lazy: a kernel that does not
import yet, or a file that does not exist, fails in :meth:`Candidate.load` and the rubric turns that into
a scorecard with the load error.

Each known-bad candidate carries one bug that a real kernel or a real grader has had, written down in
its ``doc``, and names in ``catches`` the rubric check(s) built to reject it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..grading import candidate_files
from ..grading.cpu_jit import CPU_COMPILE_OPTIONS, cpu_compile_options, jit_cpu  # noqa: F401  (re-exported)
from ..grading.paged_candidates import PAGED_ENTRIES
from kernel_src.contract import FEATURES, declared_features
from kernel_src.reference import reference_attention
from kernel_src.registry import IMPLEMENTATIONS

Attention = Callable[..., jax.Array]
KINDS = ("reference", "kernel", "correct-variant", "known-bad", "external")
CONTRACTS = ("attention", "paged")  # kernel_src.contract's attention and paged_attention


class CandidateSpecError(ValueError):
    """A ``--candidate`` spec that names no built-in and is not ``file.py:function`` / ``module:function``."""


class CandidateLoadError(RuntimeError):
    """A candidate whose code could not be imported or whose function is missing or not callable."""


@dataclass(frozen=True)
class Candidate:
    """A named attention implementation. ``doc``'s first line says what it is (for known-bad: its bug)."""

    name: str
    kind: str
    doc: str
    loader: Callable[[], Attention] = field(repr=False)
    catches: tuple[str, ...] = ()
    root: str | None = None  # a folder the user named for a kernel of several files: bound, first on sys.path
    contract: str = "attention"  # CONTRACTS: which contract it follows and which checks grade it

    def load(self) -> Attention:
        """Import and return the callable; raises :class:`CandidateLoadError` with the reason."""
        try:
            fn = self.loader()
        except CandidateLoadError:
            raise
        except Exception as e:  # an import error in the candidate's own code is the candidate's problem
            raise CandidateLoadError(f"cannot load {self.name!r}: {type(e).__name__}: {e}") from e
        if not callable(fn):
            raise CandidateLoadError(f"{self.name!r} resolved to a {type(fn).__name__}, which is not callable")
        return fn

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""


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


# --------------------------------------------------------------------------------------------------
# The contract's features (issue 34) on one dense masked attention whose switches, window and cap are *traced*
# (which features a call has is static): every known-bad feature candidate built on it shares one compiled
# executable per shape, dtype and set of features, whatever its bug and whatever window or cap a probe draws.
# All off is the contract.

class FeatureSwitches(NamedTuple):
    """Runtime switches of :func:`_attend_features`; all off is the contract."""

    window_slack: int = 0               # window starts at p - left - slack (1: one key too wide, -1: too narrow)
    window_top_left: bool = False       # window around row i instead of its position i + kv_len - q_len
    window_short_path: bool = False     # no window at all when q_len <= left (should be: when the keys fit)
    cap_mode: int = 0                   # 0 cap*tanh(s/cap); 1 s*tanh(s); 2 tanh(s*cap); 3 cap*tanh(q.k/cap)*scale;
                                        # 4 cap*tanh(s/cap) on the masked logits (-1e30 -> -cap), no mask after
    segments_q_only: bool = False       # key j's id read from q_segment_ids[min(j, q_len - 1)]
    segments_runs: bool = False         # visible only inside the contiguous run of kv ids at the row's position
    segments_block_skip: int = 0        # +B / -B: each B-key block skipped whole when no query row of the batch row
                                        # has the id of its first / last key (one key decides for the block)
    sinks_scaled: bool = False          # sink multiplied by scale
    sinks_per_kv_head: bool = False     # query head h reads sinks[h // group]
    sinks_unshifted: bool = False       # exp(sink) added to a denominator of exp(s - m), m the keys' max only
    sinks_frozen: bool = False          # the sinks enter through stop_gradient: dsinks is zero, the forward exact


def _clamped_columns(x: jax.Array, start: int, n: int) -> jax.Array:
    """Columns ``clip(start + t, 0, len - 1)`` for ``t < n`` of ``x`` ``[batch, len]`` (static slices, no gather)."""
    length = x.shape[1]
    lo, hi = min(max(start, 0), length), min(max(start + n, 0), length)
    before = min(max(-start, 0), n)
    middle = x[:, lo:hi]
    after = n - before - middle.shape[1]
    return jnp.concatenate([jnp.repeat(x[:, :1], before, axis=1), middle, jnp.repeat(x[:, -1:], after, axis=1)], axis=1)


def _blocks_skipped(q_ids, kv_ids, block: jax.Array) -> jax.Array:
    """Bool ``[batch, kv_len]``: the keys of every ``|block|``-key block that a kernel deciding from one key per
    block skips (``block`` > 0: the block's first key, < 0: its last, 0: none): blocks whose deciding key's id no
    query row of the batch row has."""
    lk = kv_ids.shape[1]
    size = jnp.maximum(jnp.abs(block), 1)
    start = jnp.arange(lk) // size * size
    decider = jnp.where(block > 0, start, jnp.minimum(start + size - 1, lk - 1))
    decided = jnp.take(kv_ids, decider, axis=1)  # [b, kv_len]: the deciding key's id, for each key of its block
    in_queries = (decided[:, :, None] == q_ids[:, None, :]).any(axis=2)
    return (block != 0) & ~in_queries


def _attend_features(q, k, v, lengths, causal, scale, window, has_window, cap, q_ids, kv_ids, sinks,
                     sw: FeatureSwitches, *, has_cap: bool, has_ids: bool, has_sinks: bool):
    """The dense contract with every feature; which features a call has is static (it decides the program),
    the window, the cap and every switch are traced (one program per shape serves every bug)."""
    lq, hq = q.shape[1], q.shape[2]
    lk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    qk = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    s = qk * scale
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    position = i + (lk - lq)
    vis = ((j <= position) | ~causal)[None] & (j[None] < lengths[:, None, None])  # [b, q, k]
    left, right = window[0], window[1]
    dropped = sw.window_short_path & (lq <= left)
    centre = jnp.where(sw.window_top_left, i, position)
    inside = (((j >= centre - left - sw.window_slack) | ~has_window[0]) & ((j <= centre + right) | ~has_window[1])
              | dropped)
    vis = vis & inside[None]
    if has_ids:
        key_ids = jnp.where(sw.segments_q_only, _clamped_columns(q_ids, 0, lk), kv_ids)
        same = q_ids[:, :, None] == key_ids[:, None, :]
        change = (kv_ids[:, 1:] != kv_ids[:, :-1]).astype(jnp.int32)
        run = jnp.cumsum(jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1), axis=1)  # run of each key
        row_run = _clamped_columns(run, lk - lq, lq)  # [b, q]: the run at each row's position
        vis = vis & same & ((run[:, None, :] == row_run[:, :, None]) | ~sw.segments_runs)
        vis = vis & ~_blocks_skipped(q_ids, kv_ids, sw.segments_block_skip)[:, None, :]
    vis = vis[:, None]  # [b, 1, q, k]
    if has_cap:  # as outer * tanh(inner / divisor): mode 0 cap * tanh(s / cap), 1 s * tanh(s), 2 tanh(s * cap),
        mode = sw.cap_mode  # 3 cap * tanh(q.k / cap) * scale, 4 cap * tanh(s / cap) on s already masked to -1e30
        inner = jnp.where(mode == 3, qk, jnp.where((mode == 4) & ~vis, -1e30, s))
        divisor = jnp.where(mode == 1, 1.0, jnp.where(mode == 2, 1.0 / cap, cap))
        outer = jnp.where(mode == 1, s, jnp.where(mode == 2, 1.0, jnp.where(mode == 3, cap * scale, cap)))
        s = outer * jnp.tanh(inner / divisor)
        vis = vis | (mode == 4)  # capped after the mask: nothing masks the softmax any more
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if has_sinks:
        sink = jnp.where(sw.sinks_per_kv_head, jnp.repeat(sinks[:hk], group), sinks) \
            * jnp.where(sw.sinks_scaled, scale, 1.0)
        sink = jnp.where(sw.sinks_frozen, jax.lax.stop_gradient(sink), sink)[None, :, None, None]
        m = jnp.where(sw.sinks_unshifted, m, jnp.maximum(m, sink))
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if has_sinks:
        denom = denom + jnp.exp(jnp.where(sw.sinks_unshifted, sink, sink - m))
    p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


_attend_features_jit = jit_cpu(_attend_features, static_argnames=("has_cap", "has_ids", "has_sinks"))


def _feature_variant(**switches) -> Attention:
    """The contract with every feature on top of :func:`_attend_features` with some switches on."""
    sw = FeatureSwitches(**switches)

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None,
                  q_segment_ids=None, kv_segment_ids=None, sinks=None):
        batch, kv_len = q.shape[0], k.shape[1]
        lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        left, right = (None, None) if window_size is None else window_size
        ids = q_segment_ids is not None
        q_ids = jnp.asarray(q_segment_ids, jnp.int32) if ids else None
        kv_ids = jnp.asarray(kv_segment_ids, jnp.int32) if ids else None
        return _attend_features_jit(
            q, k, v, lengths, jnp.asarray(bool(causal)), jnp.asarray(scale, jnp.float32),
            jnp.asarray([left or 0, right or 0], jnp.int32), jnp.asarray([left is not None, right is not None]),
            jnp.asarray(1.0 if softcap is None else softcap, jnp.float32), q_ids, kv_ids, sinks, sw,
            has_cap=softcap is not None, has_ids=ids, has_sinks=sinks is not None)

    attention.features = FEATURES
    return attention


STATIC_FEATURES = ("window_size", "softcap")  # hashable feature arguments: static under jit, like scale


def given_features(window_size=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, sinks=None) -> dict:
    """The feature arguments that are set, window and cap made hashable (static under ``jax.jit``)."""
    found = {"window_size": None if window_size is None else tuple(window_size),
             "softcap": None if softcap is None else float(softcap), "q_segment_ids": q_segment_ids,
             "kv_segment_ids": kv_segment_ids, "sinks": sinks}
    return {n: x for n, x in found.items() if x is not None}


def _contract(fn, features: tuple[str, ...] = ()):
    """Give ``fn(q, k, v, kv_lengths, *, causal, scale, **features)`` the contract's signature, jitted per
    flags; it declares ``features`` and is passed only the feature arguments a call sets."""
    jitted = jit_cpu(fn, static_argnames=("causal", "scale", *(STATIC_FEATURES if features else ())))

    @functools.wraps(fn)
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return jitted(q, k, v, kv_lengths, causal=bool(causal), scale=None if scale is None else float(scale),
                      **given_features(**features))

    attention.features = features
    return attention


_online_features_jit = jit_cpu(_online_softmax, static_argnames=("causal", "scale", *STATIC_FEATURES))


def _online_features(first_block_guard: bool) -> Attention:
    """:func:`_online_softmax` with every feature; the guard is traced, so the correct variant and the bug
    without it share their compiled programs."""
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return _online_features_jit(q, k, v, kv_lengths, causal=bool(causal),
                                    scale=None if scale is None else float(scale),
                                    first_block_guard=jnp.asarray(first_block_guard), **given_features(**features))

    attention.features = FEATURES
    return attention


def _reference_fn(q, k, v, kv_lengths, *, causal, scale, window_size=None, softcap=None, q_segment_ids=None,
                  kv_segment_ids=None, sinks=None):
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, window_size=window_size,
                               softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                               sinks=sinks)


reference = _contract(_reference_fn, FEATURES)
"""``kernel_src.reference_attention`` jitted per (causal, scale, window, cap): the ``reference`` candidate and
the rubric's baseline (one compiled executable serves both); it declares every feature."""


def _reference_with_backward(backward: Callable) -> Attention:
    """``reference`` forward with a custom backward ``backward(pull, g, q, scale) -> (dq, dk, dv)``, where
    ``pull`` is the reference's own VJP. Runs eagerly around the shared ``reference`` executable, so it
    costs no compile of its own."""
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        call = functools.partial(reference, causal=causal, kv_lengths=kv_lengths, scale=scale)

        @jax.custom_vjp
        def attn(q, k, v):
            return call(q, k, v)

        def fwd(q, k, v):
            return call(q, k, v), (q, k, v)

        def bwd(residuals, g):
            return backward(jax.vjp(call, *residuals)[1], g, residuals[0], scale)

        attn.defvjp(fwd, bwd)
        return attn(q, k, v)

    return attention


def _ones_cotangent() -> Attention:
    """Replaces the cotangent by its mean over head_dim before the reference's backward."""
    def backward(pull, g, q, scale):
        g = jnp.broadcast_to(jnp.mean(g.astype(jnp.float32), axis=-1, keepdims=True), g.shape)
        return pull(g.astype(q.dtype))
    return _reference_with_backward(backward)


def _backward_ignores_scale() -> Attention:
    """dQ and dK carry head_dim**-0.5 instead of the given scale (exact when scale=None)."""
    def backward(pull, g, q, scale):
        wrong = 1.0 if scale is None else q.shape[-1] ** -0.5 / scale
        dq, dk, dv = pull(g)
        return (dq * wrong).astype(dq.dtype), (dk * wrong).astype(dk.dtype), dv
    return _reference_with_backward(backward)


def _memoizing(min_kv_len: int = 0) -> Attention:
    """Returns the first output it computed for the same shapes and flags (only where kv_len >= min_kv_len)."""
    cache: dict = {}

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        key = (q.shape, k.shape, str(q.dtype), bool(causal), kv_lengths is None, scale)
        remembers = k.shape[1] >= min_kv_len
        if remembers and key in cache:
            return cache[key]
        out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
        if remembers and not isinstance(out, jax.core.Tracer):
            cache[key] = out
        return out

    return attention


# Bugs that only the serving and training slots of the full level show (``grading.slots``): each runs the
# shared ``reference`` executable on changed inputs, branching on static shapes as size-dispatched
# kernels do, and is exact at every shape of the earlier distribution (batch <= 3, <= 16 query heads,
# kv_len <= about 2350 and never a multiple of 512, q_len 1 or 32..1400).

def _lengths(k, kv_lengths) -> jax.Array:
    return jnp.full((k.shape[0],), k.shape[1], jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)


def _batch_blocks(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Walks the batch in blocks of 4 and reads kv_lengths by the index inside the block."""
    if q.shape[0] > 4 and kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)[jnp.arange(q.shape[0]) % 4]
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _long_cache_bf16(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Past 4096 keys: online softmax over 512-key blocks, running output and sum kept in bfloat16."""
    if k.shape[1] <= 4096:
        return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return _online_bf16(q, k, v, _lengths(k, kv_lengths), causal=bool(causal), scale=scale)


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _online_bf16(q, k, v, lengths, *, causal, scale):
    return _online_softmax(q, k, v, lengths, causal=causal, scale=scale, chunk=512, bug="bf16-accumulator")


def _head_blocks(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Query heads in blocks of 16; the remainder block (24 and 40 heads: heads 16.. and 32..) is read from
    head 0 (its output is that of the block's first heads)."""
    out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    hq = q.shape[2]
    rest = hq % 16
    if hq > 16 and rest:
        out = jnp.concatenate([out[:, :, :hq - rest], out[:, :, :rest]], axis=2)
    return out


def _prefill_top_left(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """The prefill path (q_len >= 2048) aligns the causal mask top-left (j <= i)."""
    if q.shape[1] >= 2048 and causal and k.shape[1] != q.shape[1]:
        return _variant(top_left=True)(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _spec_no_causal(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """The path for 2..8 query rows (speculative decoding) drops the causal mask."""
    if 2 <= q.shape[1] <= 8:
        causal = False
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _mha_pairs(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Plain multi-head attention at head_dim 64 packs two heads into 128 lanes and unpacks them swapped:
    query head h reads kv head h ^ 1."""
    heads = k.shape[2]
    if q.shape[2] == heads >= 2 and q.shape[3] == 64:
        swap = np.arange(heads) ^ 1
        swap[swap >= heads] = heads - 1
        k, v = k[:, :, swap], v[:, :, swap]
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _skip_last_block(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """When kv_len is an exact multiple of 512, the last 512-key block is never visited (an off-by-one in
    the block count ``(kv_len - 1) // 512``)."""
    if k.shape[1] % 512 == 0:
        kv_lengths = jnp.minimum(_lengths(k, kv_lengths), k.shape[1] - 512)
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _zeros(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return jnp.zeros_like(q)


def _unrelated(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    seed = int.from_bytes(hashlib.sha256(repr((q.shape, k.shape)).encode()).digest()[:4], "little")
    fake = np.random.default_rng(seed).standard_normal(q.shape).astype(np.float32) / np.sqrt(k.shape[1])
    return jnp.asarray(fake, q.dtype)


def _nondeterministic(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    jitter = 1 + np.random.default_rng().uniform(-1, 1, out.shape).astype(np.float32) * 2.0 ** -23
    return (out.astype(jnp.float32) * jitter).astype(out.dtype)


def _wrong_dtype(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale).astype(jnp.float32)


def _kernel(find: Callable[[], Attention]) -> Callable[[], Attention]:
    """Lazy loader of the kernel ``find()`` returns (e.g. ``kernel_src.registry.Implementation.load``).

    The kernel is graded under ``jax.jit`` (static ``causal``/``scale``), as it runs in a model; without
    it an interpret-mode ``pallas_call`` is traced and compiled again on every call.
    """
    @functools.cache  # one jitted wrapper per process, so later grades reuse its executables
    def load() -> Attention:
        return jit_contract(find())

    return load


def jit_contract(fn: Attention) -> Attention:
    """``fn`` under ``jax.jit`` with static ``causal``, ``scale``, ``window_size`` and ``softcap``, called with the
    contract's signature (only the feature arguments a call sets reach ``fn``); keeps ``fn``'s features."""
    static = ("causal", "scale", *(STATIC_FEATURES if declared_features(fn) else ()))
    jitted = jax.jit(fn, static_argnames=static)

    @functools.wraps(fn)
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return jitted(q, k, v, causal=bool(causal), kv_lengths=kv_lengths,
                      scale=None if scale is None else float(scale), **given_features(**features))

    return attention


def _constant(fn):
    return lambda: fn


def _bad(name: str, doc: str, catches: tuple[str, ...], loader) -> Candidate:
    return Candidate(name, "known-bad", doc, loader, catches)


BUILTIN: dict[str, Candidate] = {c.name: c for c in [
    Candidate("reference", "reference",
              "kernel_src.reference_attention: the contract-precision pure-JAX oracle (fp32 logits, "
              "statistics and accumulation; output in the input dtype).", _constant(reference)),
    *(Candidate(impl.grading_name, "kernel", f"{impl.target}: {impl.description}", _kernel(impl.load))
      for impl in IMPLEMENTATIONS.values() if impl.kind == "kernel" and impl.grading_name and impl.contract),
    Candidate("rounded-probs", "correct-variant",
              "Probabilities rounded to the input dtype before P·V (the contract allows it), fp32 accumulation.",
              _constant(_variant(probs_in_input_dtype=True))),
    Candidate("online-softmax", "correct-variant",
              "Online softmax over 16-key chunks (running max, sum and fp32 accumulator), like a flash kernel.",
              _constant(_contract(_online_softmax))),
    Candidate("flash-style", "correct-variant",
              "Rounds where FlashAttention-2/3 do: 128x128 tiles both ways, exp2 on log2(e)-scaled logits, "
              "P in the input dtype before P·V; backward with P and dS in the input dtype, fp32 accumulation.",
              _constant(_contract(_flash_style))),
    Candidate("per-head-dkv", "correct-variant",
              "flash-style whose backward rounds each query head's dK/dV contribution to the input dtype "
              "before summing over the group (FlashAttention-2 on repeated K/V heads).",
              _constant(_contract(functools.partial(_flash_style, per_head_dkv=True)))),
    Candidate("online-softmax-features", "correct-variant",
              "online-softmax with every feature: each 16-key chunk's own window and segment mask, the cap on the "
              "chunk's logits, running max and sum that start from the row's sink (m = sink, l = 1).",
              _constant(_online_features(first_block_guard=True))),
    Candidate("flash-style-features", "correct-variant",
              "flash-style in 16x32 tiles with every feature: per-tile window and segment masks, the cap before "
              "the mask (its slope on dS), the sink as each row's first max and sum, dsinks = -sum(P_sink * di).",
              _constant(_contract(functools.partial(_flash_style, block_q=16, block_k=32), FEATURES))),
    _bad("ignores-causal", "Ignores causal=True: every query sees future keys.",
         ("causal-leak", "mask-readout"), _constant(_variant(ignore_causal=True))),
    _bad("missing-mask", "Ignores kv_lengths: padding keys take part in the softmax.",
         ("padding-leak", "mask-readout"), _constant(_variant(ignore_lengths=True))),
    _bad("low-precision", "Logits and softmax statistics in bfloat16 instead of fp32.",
         ("large-logits", "forward-accuracy"), _constant(_variant(bf16_logits=True))),
    _bad("wrong-gqa", "Grouped-query head h reads kv head h % num_kv_heads (tile instead of repeat).",
         ("gqa-mapping",), _constant(_variant(tile_heads=True))),
    _bad("causal-top-left", "Causal mask aligned top-left (j <= i) instead of bottom-right "
         "(j <= i + kv_len - q_len): wrong whenever q_len != kv_len (cached decoding).",
         ("mask-readout",), _constant(_variant(top_left=True))),
    _bad("off-by-one-padding", "Key j is treated as valid while j <= kv_lengths[b] (one padding key leaks).",
         ("padding-leak", "mask-readout"), _constant(_variant(length_slack=1))),
    _bad("nan-empty-rows", "A row with no visible key gives NaN (softmax of all -inf), as JAX's GPU "
         "reference does; the contract says exact zeros.", ("empty-rows",),
         _constant(_variant(nan_empty=True))),
    _bad("mean-v-empty-rows", "A row with no visible key gives the mean of V (finite -1e30 mask value, "
         "uniform weights), as JAX's Pallas flash kernel does; the contract says exact zeros.",
         ("empty-rows",), _constant(_variant(mean_empty=True))),
    _bad("no-max-subtraction", "Softmax without subtracting the row max: exp overflows to inf on large "
         "logits (NaN output).", ("large-logits", "peaky-attention"), _constant(_variant(no_max=True))),
    _bad("wrong-default-scale", "scale=None defaults to 1/head_dim instead of head_dim**-0.5.",
         ("forward-accuracy", "scale"), _constant(_variant(default_scale=lambda d: 1.0 / d))),
    _bad("stop-gradient-k", "K enters the logits through stop_gradient: dK is zero, forward is exact.",
         ("gradients",), _constant(_variant(stop_grad_k=True))),
    _bad("ones-cotangent", "Custom backward that replaces the cotangent by its mean over head_dim: exact "
         "for loss=sum(out) (all-ones cotangent), wrong for any other.", ("gradients",),
         _ones_cotangent),
    _bad("memoizing", "Returns the first output it computed for the same shapes and flags, whatever "
         "the values (passes graders that use one input per shape).", ("fresh-inputs",), _memoizing),
    _bad("zeros", "Returns zeros of the right shape and dtype (passes loose allclose on some problems).",
         ("forward-accuracy",), _constant(_zeros)),
    _bad("unrelated-output", "Returns a fixed pseudo-random tensor of the right shape, scale and dtype, "
         "unrelated to q, k, v.", ("fresh-inputs", "forward-accuracy"), _constant(_unrelated)),
    _bad("nondeterministic", "Correct to about one fp32 ulp but different bits on every call "
         "(like unordered atomic accumulation).", ("determinism",), _constant(_nondeterministic)),
    # Bugs the old four toy shapes (head_dim <= 64, q_len <= 24, kv_len <= 136) could not see.
    _bad("head-dim-tile", "Logits from the first 128 entries of head_dim only (a kernel tiled for head_dim "
         "<= 128): exact at head_dim 64 and 128, wrong at 256.", ("forward-accuracy", "mask-readout"),
         _constant(_variant(head_dim_tile=True))),
    _bad("query-tile-local-causal", "Causal mask built from the row index inside its 128-row query tile "
         "(the tile's start never added): exact while q_len <= 128.", ("forward-accuracy", "causal-leak"),
         _constant(_variant(query_tile_local=True))),
    _bad("key-tile-wrap", "Key j >= 256 reads K/V row j % 256 (the key tile index wraps after the second "
         "128-key tile, like a double-buffer slot used as block index): exact while kv_len <= 256.",
         ("forward-accuracy",), _constant(_variant(key_tile_wrap=True))),
    _bad("input-dtype-accumulator", "Online softmax over 32-key blocks (a Triton-sized tile) whose output "
         "accumulator and running sum are kept in the input dtype between blocks: bfloat16 roundings pile up "
         "once kv_len reaches thousands.", ("forward-accuracy", "padding-leak", "gradients"),
         _constant(_contract(functools.partial(_online_softmax, chunk=32, bug="input-dtype-accumulator")))),
    _bad("backward-ignores-scale", "Forward exact; the backward multiplies dQ and dK by head_dim**-0.5 "
         "instead of the given scale (exact whenever scale=None).", ("gradients", "scale"),
         _backward_ignores_scale),
    _bad("large-kv-top-left", "A size-dispatched path: for kv_len >= 1024 the causal mask is aligned "
         "top-left (j <= i); the small-kv path is right.", ("forward-accuracy", "gradients"),
         _constant(_variant(large_kv_top_left=True))),
    _bad("frozen-running-max", "Online softmax over 128-key chunks whose running max is set by the first "
         "chunk and never raised: exp overflows once a later key's logit exceeds it by 89.",
         ("large-logits",), _constant(_contract(functools.partial(_online_softmax, chunk=128,
                                                                 bug="frozen-max")))),
    _bad("split-kv-without-maxima", "Split-KV decoding (q_len <= 16, 512-key splits) that combines the "
         "splits' results with their sums but without their maxima: exact while kv_len <= 512.",
         ("large-logits",), _constant(_contract(_split_kv_without_maxima))),
    _bad("memoizing-large", "Caches outputs by shape and flags once kv_len >= 1024 (like an autotuning "
         "cache that also keeps results): right on the first call of each large shape only.",
         ("forward-accuracy", "large-logits", "gradients"), functools.partial(_memoizing, 1024)),
    _bad("wrong-dtype", "Returns float32 for bfloat16 inputs (accurate, but breaks the output dtype rule).",
         ("output-shape-dtype",), _constant(_wrong_dtype)),
    # Bugs at the shapes serving and training run every day, which the distribution before issue 24 never drew.
    _bad("batch-blocks-of-4", "Walks the batch in blocks of 4 and reads kv_lengths by the index inside the "
         "block: right for batch <= 4; a serving batch of 8 gets other sequences' lengths.",
         ("padding-leak", "forward-accuracy", "empty-rows"), _constant(_batch_blocks)),
    _bad("long-cache-bf16-accumulator", "Caches longer than 4096 keys take an online-softmax path over "
         "512-key blocks whose running output and sum are kept in bfloat16.", ("forward-accuracy",),
         _constant(_long_cache_bf16)),
    _bad("head-blocks-of-16", "Query heads in blocks of 16, the remainder block read from head 0: right for "
         "<= 16 heads and multiples of 16, wrong at 24 and 40 (Llama-3.2-3B, Qwen2.5-14B).", ("gqa-mapping",),
         _constant(_head_blocks)),
    _bad("prefill-top-left", "The prefill path (q_len >= 2048) aligns the causal mask top-left: wrong for "
         "chunked prefill against a longer cache.", ("forward-accuracy",), _constant(_prefill_top_left)),
    _bad("spec-decode-no-causal", "The path for 2-8 query rows (speculative decoding) drops the causal mask: "
         "draft tokens see the ones after them.", ("causal-leak",), _constant(_spec_no_causal)),
    _bad("mha-d64-pairs", "Plain multi-head attention at head_dim 64 packs heads in pairs and unpacks them "
         "swapped (query head h reads kv head h ^ 1).", ("gqa-mapping", "gradients", "forward-accuracy"),
         _constant(_mha_pairs)),
    _bad("skip-last-full-block", "When kv_len is an exact multiple of 512 the last 512-key block is skipped "
         "(static KV caches and training sequences of 512, 2048, 4096).", ("forward-accuracy", "gradients"),
         _constant(_skip_last_block)),
    # Bugs in the features (issue 34) that real kernels have had; every one declares all four features.
    _bad("window-one-key-wide", "Sliding window one key too wide: window_size's left read as the window's W keys "
         "(sees p - left - 1 .. p), the off-by-one between a model's sliding_window=W and (W - 1, 0).",
         ("window",), _constant(_feature_variant(window_slack=1))),
    _bad("window-one-key-narrow", "Sliding window one key too narrow: sees p - left + 1 .. p (the left end taken "
         "as exclusive).", ("window",), _constant(_feature_variant(window_slack=-1))),
    _bad("window-top-left", "Window placed around row i instead of its position i + kv_len - q_len (aligned "
         "top-left): right in training (q_len = kv_len), wrong for chunked prefill and decoding.", ("window",),
         _constant(_feature_variant(window_top_left=True))),
    _bad("window-short-fast-path", "A short-sequence fast path that drops the window when q_len <= left, testing "
         "the query length instead of the key span: a decoding row sees its whole cache.", ("window",),
         _constant(_feature_variant(window_short_path=True))),
    _bad("softcap-no-cap-value", "Soft-cap computed as s * tanh(s): the cap value is never used.", ("softcap",),
         _constant(_feature_variant(cap_mode=1))),
    _bad("softcap-tanh-of-product", "Soft-cap computed as tanh(s * softcap): the cap multiplied into the tanh's "
         "argument instead of dividing it and multiplying the result.", ("softcap",),
         _constant(_feature_variant(cap_mode=2))),
    _bad("softcap-before-scale", "Cap applied before the scale: softcap * tanh(q.k / softcap) * scale (the "
         "contract caps scale * q.k).", ("softcap",), _constant(_feature_variant(cap_mode=3))),
    _bad("softcap-after-mask", "Cap applied after the mask: masked logits (-1e30) become -softcap, so padding, "
         "future keys and rows with no visible key take weight again.", ("softcap",),
         _constant(_feature_variant(cap_mode=4))),
    _bad("segments-q-ids-only", "Segment ids from one side only: key j's id read from q_segment_ids (clamped at "
         "q_len - 1), kv_segment_ids ignored; right in packed training, where both are the same ids.",
         ("segments",), _constant(_feature_variant(segments_q_only=True))),
    _bad("segments-contiguous-runs", "Segment ids taken as contiguous documents: a row sees only the run of equal "
         "kv ids around its position, so two runs of one id (A B A) do not see each other.", ("segments",),
         _constant(_feature_variant(segments_runs=True))),
    _bad("segments-block-skip-first-key", "Skips each 128-key block whose first key's segment id no query row has, "
         "deciding for the whole block from one key: a query document that starts inside the block after a document "
         "only the keys hold (chunked prefill or decoding over a packed cache) loses its keys there.", ("segments",),
         _constant(_feature_variant(segments_block_skip=128))),
    _bad("segments-block-skip-last-key", "Skips each 128-key block whose last key's segment id no query row has: "
         "the block holding a sequence's last keys is dropped when the padding after kv_lengths carries an id of "
         "its own.", ("segments",), _constant(_feature_variant(segments_block_skip=-128))),
    _bad("sinks-scaled", "Sink multiplied by the softmax scale like a logit (the contract's sink is unscaled).",
         ("sinks",), _constant(_feature_variant(sinks_scaled=True))),
    _bad("sinks-per-kv-head", "Query head h reads sinks[h // group], one sink per kv head (the first "
         "num_kv_heads entries), instead of its own sinks[h].", ("sinks",),
         _constant(_feature_variant(sinks_per_kv_head=True))),
    _bad("sinks-unshifted", "Sink added outside the max-shifted frame: exp(sink) joins a denominator of "
         "exp(s - max) (exact only when the row max is 0).", ("sinks",),
         _constant(_feature_variant(sinks_unshifted=True))),
    _bad("sinks-frozen", "The sinks enter through stop_gradient (a learned sink that never learns): the "
         "forward is exact, dsinks is zero.", ("sinks",), _constant(_feature_variant(sinks_frozen=True))),
    _bad("nan-first-block", "Online softmax over 16-key chunks that guards only rows with no visible key at "
         "all: a row whose first chunk its window or segment hides whole gets exp(-inf - -inf) = NaN.",
         ("window", "segments"),
         _constant(_online_features(first_block_guard=False))),
]}


# The paged built-ins (``grading.paged_candidates``), kept apart from BUILTIN: every consumer of BUILTIN grades the
# attention contract. ``resolve`` finds both; ``is_builtin`` tells either from a stranger's code.
PAGED_BUILTIN: dict[str, Candidate] = {e.name: Candidate(e.name, e.kind, e.doc, e.loader, e.catches, contract="paged")
                                       for e in PAGED_ENTRIES}


def is_builtin(candidate) -> bool:
    """Whether ``candidate`` is one of the project's own built-ins (``BUILTIN`` or ``PAGED_BUILTIN``)."""
    name = getattr(candidate, "name", None)
    return BUILTIN.get(name) is candidate or PAGED_BUILTIN.get(name) is candidate


def names_a_file(target: str) -> bool:
    """Whether a spec's target (before ``:function``) names a source file rather than a module path."""
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_external(spec: str, target: str, function: str) -> Callable[[], Attention]:
    def load() -> Attention:
        if names_a_file(target):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise CandidateLoadError(f"candidate file {target} does not exist")
            module_name = "rubric_candidate_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise CandidateLoadError(f"cannot import {target} as Python source")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        else:
            module = importlib.import_module(target)
        if not hasattr(module, function):
            raise CandidateLoadError(f"{target} has no attribute {function!r}")
        return getattr(module, function)
    return load


def _refuse_links(check: Callable[[], None]) -> None:
    """``check()`` (a ``grading.candidate_files`` check), its refusal as a :class:`CandidateSpecError`."""
    try:
        check()
    except candidate_files.LinkRefused as e:
        raise CandidateSpecError(str(e)) from None


def resolve(spec: str | Candidate, root: str | os.PathLike | None = None) -> Candidate:
    """A built-in name (``BUILTIN`` or ``PAGED_BUILTIN``), ``path/to/file.py:function`` or
    ``package.module:function`` as a Candidate.

    ``root``: the folder of a kernel that spans several files (its modules import each other from it); a
    file spec must lie inside it. Raises :class:`CandidateSpecError` for a spec of neither form, or a
    root that is not a folder or does not hold the file (the file or module itself is only imported by
    :meth:`Candidate.load`).
    """
    if isinstance(spec, Candidate):
        return spec
    spec = str(spec).strip()
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in PAGED_BUILTIN:
        return PAGED_BUILTIN[spec]
    if ":" not in spec:
        raise CandidateSpecError(
            f"unknown candidate {spec!r}: use a built-in ({', '.join([*BUILTIN, *PAGED_BUILTIN])}), "
            f"path/to/file.py:function or package.module:function")
    target, _, function = spec.rpartition(":")
    if not target or not function.isidentifier():
        raise CandidateSpecError(f"bad candidate spec {spec!r}: expected path/to/file.py:function "
                                 f"or package.module:function")
    if not names_a_file(target) and \
            not all(part.isidentifier() for part in target.split(".")):
        raise CandidateSpecError(f"bad candidate spec {spec!r}: {target!r} is neither a .py file nor a module path")
    if root is not None:
        root = os.path.realpath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise CandidateSpecError(f"candidate folder {root} is not a folder")
        inside = os.path.realpath(os.path.expanduser(target)).startswith(root.rstrip("/") + "/")
        if names_a_file(target) and not inside:
            raise CandidateSpecError(f"candidate file {target} is not inside the candidate folder {root}")
        _refuse_links(lambda: candidate_files.check_folder(root))
    if names_a_file(target) and os.path.lexists(os.path.expanduser(target)):  # a missing file fails at load
        _refuse_links(lambda: candidate_files.check_file(os.path.expanduser(target), target))
    return Candidate(spec, "external", f"External candidate {spec}.", _load_external(spec, target, function),
                     root=root)
