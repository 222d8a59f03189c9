"""The candidate contract shared by every kernel and grader.

``attention(q, k, v, *, causal=False, kv_lengths=None, scale=None) -> out``

* ``q``: ``[batch, q_len, num_q_heads, head_dim]``; ``k``, ``v``:
  ``[batch, kv_len, num_kv_heads, head_dim]`` (the layout of
  ``jax.nn.dot_product_attention``); all three float32 or all three bfloat16.
* ``causal`` is bottom-right aligned: query ``i`` sees key ``j`` iff
  ``j <= i + (kv_len - q_len)``.
* ``kv_lengths``: int ``[batch]``; key ``j >= kv_lengths[b]`` is padding.
* Grouped-query: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* ``scale`` defaults to ``head_dim ** -0.5``; a given ``scale`` is used as is, in
  the forward and in the gradients.

Rules the rubric (``grading.checks``) judges, each by a named check:

* The output has ``q``'s shape and its dtype equals ``q.dtype`` (output-shape-dtype).
* A query row with no visible key yields exact zeros, and its dQ is exactly zero
  (empty-rows).
* dK and dV are exactly zero for keys that no query sees: padding, and keys in the
  future of every row (gradients, and every check that takes gradients).
* Padded K/V slots (``j >= kv_lengths[b]``) may hold any *finite* values; they change
  neither the output nor a gradient (padding-leak fills them with large finite values).
  NaN or Inf there is outside the contract: the reference computes ``0 * V`` for them.
* Precision: logits, softmax statistics and accumulation in fp32. Probabilities (and,
  in the backward, P and dS) may be rounded to the input dtype before a matmul, and
  each query head's dK/dV contribution may be rounded to the input dtype before the
  sum over its group; the result is judged against a float64 truth with a bound set by
  the reference's own error (``grading.tolerance``).
* ``jax.grad`` works; the same inputs give the same bits (determinism); different
  inputs get their own answers (no result kept by shape).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class Dims(NamedTuple):
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None = None) -> Dims:
    """Validate shapes and dtypes against the contract; return the problem's dimensions.

    Raises ``ValueError`` (``TypeError`` for dtypes) with a message naming the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, len, heads, head_dim], got shape {tuple(x.shape)}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, q_len, hq, d = q.shape
    kb, kv_len, hk, kd = k.shape
    if kb != batch or kd != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim"
        )
    if hk == 0 or hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    if kv_lengths is not None:
        if tuple(kv_lengths.shape) != (batch,):
            raise ValueError(f"kv_lengths must have shape [batch]=({batch},), got {tuple(kv_lengths.shape)}")
        if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise TypeError(f"kv_lengths must be an integer array, got {kv_lengths.dtype}")
    return Dims(batch, q_len, kv_len, hq, hk, d)


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: ``head_dim ** -0.5`` unless given."""
    return head_dim ** -0.5 if scale is None else float(scale)


def visible(q_pos: jax.Array, k_pos: jax.Array, q_len: int, kv_len: int, causal: bool,
            kv_length: jax.Array | None) -> jax.Array:
    """Boolean visibility of key positions ``k_pos`` to query positions ``q_pos`` (broadcasting).

    Works on iotas inside a kernel as well as on whole index grids outside one.
    """
    ok = k_pos < kv_len
    if causal:
        ok = ok & (k_pos <= q_pos + (kv_len - q_len))
    if kv_length is not None:
        ok = ok & (k_pos < kv_length)
    return ok


def visibility_mask(q_len: int, kv_len: int, causal: bool, kv_lengths: jax.Array | None) -> jax.Array:
    """``[batch or 1, q_len, kv_len]`` boolean mask of the keys each query may see."""
    q_pos = jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    if kv_lengths is None:
        return visible(q_pos, k_pos, q_len, kv_len, causal, None)[None]
    return visible(q_pos[None], k_pos[None], q_len, kv_len, causal, kv_lengths[:, None, None])
