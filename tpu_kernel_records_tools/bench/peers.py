"""JAX's own Pallas TPU attention kernels, as the static plan's peers (``bench.plan``).

Each peer is a program ``(q, k, v[, ct]) -> out`` (forward) or ``-> (dq, dk, dv)`` (forward +
backward, the VJP given the output's cotangent) on the layout its kernels take, ``[batch,
heads, seq, head_dim]``, causal, at the plan's shapes (no transposes are charged to them):

* ``splash-512``: splash attention, ``make_splash_mha`` with a causal mask per query head, K/V of
  ``num_kv_heads`` heads (native grouped-query: query head ``h`` reads kv head ``h // group``),
  vmapped over the batch, every tile 512 (or the sequence, if shorter);
* ``splash-default``: the same with ``BlockSizes.get_default()`` (128 tiles);
* ``jax-flash``: ``jax.experimental.pallas.ops.tpu.flash_attention`` with its default tiles; it has
  no grouped-query attention, so K/V are repeated to the query heads inside the program (an XLA
  op, counted outside its kernels; its gradient a reduce over the group).

Splash applies no softmax scale (callers fold it into the query projection), so none is applied.

With a ``window`` (the contract's ``window_size=(left, right)``, causal), splash takes a
``LocalMask((seq, seq), window_size=(left, right), offset=0)`` per query head in place of the
``CausalMask`` (the window's right bound of 0 is the causal mask; block-sparsity computed ahead, so
blocks outside every row's window are skipped). JAX's Pallas flash attention has no window: it has
no windowed program (``WINDOWED``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

PEERS = ("splash-512", "splash-default", "jax-flash")
WINDOWED = ("splash-512", "splash-default")  # the peers that take a window (LocalMask)


def _splash(seq: int, num_q_heads: int, block: int | None, window: tuple[int, int] | None = None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = sk.BlockSizes.get_default()
    if block is not None:
        b = min(block, seq)
        sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    if window is None:
        head = sm.CausalMask((seq, seq))
    else:
        left, right = window
        if left is None or right != 0:
            raise ValueError(f"a causal window is (left, 0) with left an int, got {window!r}")
        head = sm.LocalMask((seq, seq), window_size=(int(left), 0), offset=0)
    mask = sm.MultiHeadMask([head for _ in range(num_q_heads)])
    kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    return jax.vmap(kernel)


def _jax_flash(group: int):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    def attend(q, k, v):
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        return fa.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5)
    return attend


def attention(peer: str, seq: int, num_q_heads: int, num_kv_heads: int,
              window: tuple[int, int] | None = None) -> Callable[..., Any]:
    """``(q [b, hq, s, d], k, v [b, hk, s, d]) -> out`` of one peer, causal (and ``window``:
    ``(left, 0)``, only for the ``WINDOWED`` peers)."""
    if window is not None and peer not in WINDOWED:
        raise ValueError(f"peer {peer!r} has no window; windowed peers: {WINDOWED}")
    if peer == "splash-512":
        return _splash(seq, num_q_heads, 512, window)
    if peer == "splash-default":
        return _splash(seq, num_q_heads, None, window)
    if peer == "jax-flash":
        return _jax_flash(num_q_heads // num_kv_heads)
    raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")


def program(peer: str, seq: int, num_q_heads: int, num_kv_heads: int, mode: str,
            window: tuple[int, int] | None = None):
    """The peer's forward ``(q, k, v) -> out``, or for ``fwd+bwd`` ``(q, k, v, ct) -> (dq, dk, dv)``."""
    attend = attention(peer, seq, num_q_heads, num_kv_heads, window)
    if mode == "fwd":
        return attend

    def forward_backward(q, k, v, ct):
        _, pullback = jax.vjp(attend, q, k, v)
        return pullback(ct)
    return forward_backward


def arguments(batch: int, seq: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype,
              mode: str, make_struct: Callable[..., Any] = jax.ShapeDtypeStruct) -> tuple:
    """Abstract ``(q, k, v[, ct])`` in the peers' layout ``[batch, heads, seq, head_dim]``."""
    q = make_struct((batch, num_q_heads, seq, head_dim), dtype)
    kv = make_struct((batch, num_kv_heads, seq, head_dim), dtype)
    return (q, kv, kv) + ((q,) if mode == "fwd+bwd" else ())
