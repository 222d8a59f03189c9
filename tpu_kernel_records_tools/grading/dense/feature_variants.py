"""The contract's features on one dense masked attention with traced switches: the known-bad feature candidates.

``_feature_variant(**switches)`` is the contract with every feature (window, soft-cap, segment ids, sinks)
and one bug switched on; ``grading.candidates`` registers each as a known-bad built-in.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ...sandbox.cpu_jit import jit_cpu
from kernel_src.contract import FEATURES

Attention = Callable[..., jax.Array]

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
