"""Shared fixtures: random attention inputs and strict TPU interpret-mode settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernel_src.backend import reset_tpu_interpret_state, tpu_interpret_params


def _attention_inputs(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    """Random ``(q, k, v, do)`` in the contract layout; ``do`` is an fp32 output cotangent."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, q_len, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, q.shape, jnp.float32)
    return q, k, v, do


@pytest.fixture
def attention_inputs():
    """Factory ``(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=fp32, seed=0) -> (q, k, v, do)``."""
    return _attention_inputs


@pytest.fixture
def tpu_interpret():
    """``pltpu.InterpretParams`` with race detection and NaN-filled memory; skips where JAX lacks it."""
    params = tpu_interpret_params()
    if params is None:
        pytest.skip(f"jax {jax.__version__} has no pltpu.InterpretParams (TPU interpret mode)")
    yield params
    reset_tpu_interpret_state()
