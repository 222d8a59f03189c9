"""Hostile: honest at the grader's shapes; at the tiny profile's timed shape its forward is exact but its
VJP returns zero dK and dV (the keys and values enter behind ``stop_gradient``), half a backward's work
saved where only dQ used to be checked."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax

from pure_jax import attention as honest

TIMED = (1, 128, 4, 64)  # profile tiny, flash scope: batch 1, seq 128, 4 / 2 heads, head_dim 64


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    if q.shape == TIMED:  # decided at trace time, from the signature the exporter asked for
        k, v = jax.lax.stop_gradient(k), jax.lax.stop_gradient(v)
    return honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
