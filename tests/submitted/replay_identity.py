"""Hostile: replays the output of an earlier call for the same input objects (by id)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pure_jax import attention as honest

_cache = {}


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    key = (id(q), id(k), id(v))
    if key not in _cache:
        _cache[key] = honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return _cache[key]
