"""Hostile: honest at the grader's shapes; at the tiny profile's timed shape it computes only query rows
34-118, the union of the 64-row windows a check seeded with the public seed 0 used to judge (one batch
element, contiguous rows from ``default_rng([s, 7])``, s = 0..4), and returns zeros elsewhere."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp

from pure_jax import attention as honest

TIMED = (1, 128, 4, 64)  # profile tiny, flash scope: batch 1, seq 128, 4 / 2 heads, head_dim 64
FIRST, STOP = 34, 119


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    if q.shape != TIMED or not causal:  # decided at trace time, from the signature the exporter asked for
        return honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    # Rows FIRST..STOP-1 alone, bottom-right aligned on the keys they can see (j < STOP).
    lengths = None if kv_lengths is None else jnp.minimum(kv_lengths, STOP)
    rows = honest(q[:, FIRST:STOP], k[:, :STOP], v[:, :STOP], causal=True, kv_lengths=lengths, scale=scale)
    return jnp.zeros_like(q).at[:, FIRST:STOP].set(rows)
