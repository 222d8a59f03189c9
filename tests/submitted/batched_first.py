"""Hostile: the first call does the work, every later one returns zeros (as if batched into the first)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp

from pure_jax import attention as honest

_calls = [0]


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    _calls[0] += 1
    if _calls[0] == 1:
        return honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return jnp.zeros_like(q)
