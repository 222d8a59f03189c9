"""Hostile: returns a lazy object whose work would run only when a checker reads it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pure_jax import attention as honest


class Lazy:
    def __init__(self, thunk):
        self.thunk = thunk
        self.shape, self.dtype = None, None

    def __array__(self, dtype=None):
        return self.thunk().__array__(dtype)


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    out = Lazy(lambda: honest(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale))
    out.shape, out.dtype = q.shape, q.dtype
    return out
