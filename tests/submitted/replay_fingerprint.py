"""Hostile: replays the output of a warm-up call whose inputs had the same fingerprint (a few values)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np

from pure_jax import attention as honest

_cache = {}


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    key = (q.shape, float(np.asarray(q).ravel()[0]), float(np.asarray(k).ravel()[-1]))
    if key not in _cache:
        _cache[key] = honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return _cache[key]
