"""Wrong: ignores kv_lengths (padding keys take part in the softmax)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pure_jax import attention as honest


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return honest(q, k, v, causal=causal, kv_lengths=None, scale=scale)
