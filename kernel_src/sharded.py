"""Any contract kernel run under ``shard_map``: batch and kv-head groups split over devices.

A 2-D mesh with axes ``("batch", "heads")`` splits the batch axis and the head axis of q, k, v
and the output the same way. Query heads are contiguous per kv head (query head ``h`` reads kv
head ``h // group``), so the ``i``-th slice of query heads is exactly the group of the ``i``-th
slice of kv heads: every shard is a self-contained grouped-query problem and attention needs no
communication. ``kv_lengths`` follows the batch split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from kernel_src.contract import check_inputs, default_scale

AXES = ("batch", "heads")

Kernel = Callable[..., jax.Array]


def attention_mesh(batch: int, num_kv_heads: int, devices: Sequence[jax.Device] | None = None
                   ) -> Mesh:
    """A ``("batch", "heads")`` mesh over ``devices`` (all by default) that divides the problem.

    Of the factorisations ``len(devices) = n_batch * n_heads`` with ``n_batch | batch`` and
    ``n_heads | num_kv_heads``, the one with the most batch shards. Raises ``ValueError`` when
    none exists.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    for n_batch in range(count, 0, -1):
        n_heads, rest = divmod(count, n_batch)
        if not rest and batch % n_batch == 0 and num_kv_heads % n_heads == 0:
            return Mesh(np.asarray(devices, dtype=object).reshape(n_batch, n_heads), AXES)
    raise ValueError(
        f"{count} devices cannot split batch={batch} x num_kv_heads={num_kv_heads}: need "
        f"n_batch * n_heads = {count} with n_batch dividing {batch} and n_heads dividing "
        f"{num_kv_heads}. Pass mesh=attention_mesh({batch}, {num_kv_heads}, jax.devices()[:n]) "
        f"for a device count n that does.")


def _shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """``shard_map`` without replication checks, on new (``jax.shard_map``) and old JAX."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh, in_specs, out_specs, check_rep=False)


def _check_mesh(mesh: Mesh, batch: int, num_kv_heads: int) -> None:
    extra = [name for name in mesh.axis_names if name not in AXES]
    if extra:
        raise ValueError(f"mesh axes must be among {AXES}, got {tuple(mesh.axis_names)}")
    for name, size in (("batch", batch), ("heads", num_kv_heads)):
        shards = mesh.shape.get(name, 1)
        if size % shards:
            what = "batch" if name == "batch" else "num_kv_heads"
            raise ValueError(f"mesh axis {name!r} has {shards} devices, which does not divide "
                             f"{what}={size}")


@functools.partial(jax.jit, static_argnames=("kernel", "mesh", "causal", "scale"))
def _sharded(kernel: Kernel, q, k, v, kv_lengths, *, mesh: Mesh, causal: bool, scale: float):
    batch_axis = "batch" if "batch" in mesh.axis_names else None
    heads_axis = "heads" if "heads" in mesh.axis_names else None
    tensor = P(batch_axis, None, heads_axis, None)
    if kv_lengths is None:
        def local(q, k, v):
            return kernel(q, k, v, causal=causal, scale=scale)
        return _shard_map(local, mesh, (tensor, tensor, tensor), tensor)(q, k, v)

    def local(q, k, v, kv_lengths):
        return kernel(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return _shard_map(local, mesh, (tensor, tensor, tensor, P(batch_axis)), tensor)(
        q, k, v, kv_lengths)


def sharded_attention(kernel: Kernel, q: jax.Array, k: jax.Array, v: jax.Array, *,
                      mesh: Mesh | None = None, causal: bool = False,
                      kv_lengths: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """``kernel(q, k, v, ...)`` (any candidate-contract kernel) with batch and heads sharded.

    Args:
      kernel: a contract kernel, e.g. ``reference_attention``, ``pallas_attention``,
        ``flash_attention`` (bind extra options with ``functools.partial``; it must be hashable).
      q: ``[batch, q_len, num_q_heads, head_dim]``; k, v: ``[batch, kv_len, num_kv_heads,
        head_dim]``, as in the contract.
      mesh: a mesh with axes among ``("batch", "heads")``; ``"batch"`` must divide ``batch`` and
        ``"heads"`` ``num_kv_heads``. By default ``attention_mesh`` over all devices.
      causal, kv_lengths, scale: as in the contract; the scale is fixed from the global
        ``head_dim`` before sharding.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype, sharded like ``q``.
      Differentiable whenever ``kernel`` is.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    if mesh is None:
        mesh = attention_mesh(dims.batch, dims.num_kv_heads)
    _check_mesh(mesh, dims.batch, dims.num_kv_heads)
    return _sharded(kernel, q, k, v, kv_lengths, mesh=mesh, causal=bool(causal),
                    scale=default_scale(dims.head_dim, scale))
