"""Allocates far more memory than a worker may have (64 GiB of NumPy, then of JAX)."""

import jax.numpy as jnp
import numpy as np


def numpy_hog(q, k, v, **kwargs):
    hog = np.ones(8 << 30, np.float64)  # 64 GiB
    return jnp.zeros(q.shape, q.dtype) + float(hog[0])


def jax_hog(q, k, v, **kwargs):
    hog = jnp.ones((16 << 30,), jnp.float32)  # 64 GiB
    return jnp.zeros(q.shape, q.dtype) + hog[0]
