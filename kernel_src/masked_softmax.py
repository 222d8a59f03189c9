"""Masked softmax over attention logits as a Pallas kernel, with an explicit Pallas backward.

Layout: logits ``[batch, heads, q_len, kv_len]``, the key axis last so that keys fill the 128 lanes
of a TPU vreg and query rows its 8 sublanes. One grid step owns ``block_q`` query rows of one
(batch, head) and the whole, padded key width: a softmax row needs every key before it can be
normalised. The mask (bottom-right causal, ``kv_lengths`` padding, lane padding) is built inside
the kernel from iotas and the per-batch key length, never read from a mask array in memory.

Lowering, chosen per platform when lowered (``kernel_src.backend.per_platform``): interpret mode
on CPU, Mosaic on TPU (key lengths arrive by scalar prefetch into SMEM). On GPU the same kernels
go through Pallas' Triton lowering with power-of-two tiles and the key lengths as an ordinary
input; that path is only checked to lower (tests/test_tpu_lowering.py) and has never been
compiled or run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.contract import visible

LANES = 128
SUBLANES = 8
# Finite stand-in for -inf: masked logits minus any real row maximum stay finite, exp() gives 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Most fp32 elements one TPU block may hold (1 MiB), so double-buffered blocks fit scoped VMEM.
_TPU_BLOCK_ELEMENTS = 256 * 1024


@dataclasses.dataclass(frozen=True)
class SoftmaxBlockSizes:
    """Tile sizes of the masked-softmax kernels.

    Attributes:
      block_q: query rows per grid step, a multiple of 8 (TPU sublanes); 16-bit inputs round it up
        to 16 (two rows per sublane). Clamped to the (rounded-up) query length.
      block_k: key-lane tile, a multiple of 128 (TPU lanes). The key width is padded to a multiple
        of it and one grid step spans all key tiles of its rows.
    """

    block_q: int
    block_k: int

    def __post_init__(self):
        if self.block_q <= 0 or self.block_q % SUBLANES:
            raise ValueError(f"block_q must be a positive multiple of {SUBLANES}, got {self.block_q}")
        if self.block_k <= 0 or self.block_k % LANES:
            raise ValueError(f"block_k must be a positive multiple of {LANES}, got {self.block_k}")

    @classmethod
    def for_platform(cls, platform: str | None = None) -> SoftmaxBlockSizes:
        """Defaults for ``"tpu"``, ``"gpu"`` or ``"cpu"`` (the default backend's when ``None``).

        CPU runs in interpret mode, whose cost grows with grid steps, so it takes tall row blocks.
        """
        platform = platform or backend.platform()
        if platform == "tpu":
            return cls(block_q=128, block_k=LANES)
        if platform == "gpu":
            return cls(block_q=16, block_k=LANES)
        return cls(block_q=1024, block_k=LANES)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call: the unpadded problem and its padded tiling."""

    q_len: int
    kv_len: int
    causal: bool
    block_q: int
    dtype: Any
    gpu: bool
    interpret: Any


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _plan(logits: jax.Array, causal: bool, target: str, interpret: Any, blocks: SoftmaxBlockSizes
          ) -> tuple[_Plan, int, int]:
    """The call's plan for ``target`` (``backend.TARGETS``) and its padded ``(q_len, kv_len)``."""
    _, _, q_len, kv_len = logits.shape
    gpu = target == "gpu"
    kv_pad = _round_up(max(kv_len, 1), blocks.block_k)
    row_multiple = SUBLANES * max(1, 4 // jnp.dtype(logits.dtype).itemsize)
    block_q = min(_round_up(blocks.block_q, row_multiple), _round_up(max(q_len, 1), row_multiple))
    if gpu:  # Triton tiles must be powers of two.
        kv_pad = _next_power_of_two(kv_pad)
        block_q = _next_power_of_two(block_q)
    elif not interpret:
        fitting = _TPU_BLOCK_ELEMENTS // kv_pad // row_multiple * row_multiple
        block_q = max(row_multiple, min(block_q, fitting))
    plan = _Plan(q_len, kv_len, causal, block_q, jnp.dtype(logits.dtype), gpu, interpret)
    return plan, _round_up(q_len, block_q), kv_pad


def _forward_kernel(lengths_ref, logits_ref, probs_ref, *, q_len: int, kv_len: int, causal: bool):
    """Masked softmax of one row block.

    lengths_ref: int32 ``[batch]`` key lengths (SMEM on TPU). logits_ref: ``[block_q, kv_pad]``
    logits of one (batch, head, row block), any float dtype. probs_ref: the same block, fp32.
    """
    block_q, width = probs_ref.shape
    q_pos = pl.program_id(2) * block_q + lax.broadcasted_iota(jnp.int32, (block_q, width), 0)
    k_pos = lax.broadcasted_iota(jnp.int32, (block_q, width), 1)
    seen = visible(q_pos, k_pos, q_len, kv_len, causal, lengths_ref[pl.program_id(0)])
    logits = jnp.where(seen, logits_ref[...].astype(jnp.float32), MASK_VALUE)
    row_max = jnp.max(logits, axis=1, keepdims=True)
    unnormalised = jnp.where(seen, jnp.exp(logits - row_max), 0.0)
    total = jnp.sum(unnormalised, axis=1, keepdims=True)
    probs_ref[...] = unnormalised / jnp.where(total > 0.0, total, 1.0)


def _backward_kernel(probs_ref, dprobs_ref, dlogits_ref):
    """Softmax backward of one row block: ``dS = P * (dP - rowsum(dP * P))``.

    probs_ref, dprobs_ref: fp32 ``[block_q, kv_pad]``. dlogits_ref: the same block in the logits'
    dtype. Masked and padded keys have ``P == 0``, so their gradient is exactly zero.
    """
    probs = probs_ref[...]
    dprobs = dprobs_ref[...]
    row_dot = jnp.sum(dprobs * probs, axis=1, keepdims=True)
    dlogits_ref[...] = (probs * (dprobs - row_dot)).astype(dlogits_ref.dtype)


def _row_blocks(shape: tuple[int, ...], plan: _Plan, scalar_prefetch: bool):
    batch, heads, q_pad, kv_pad = shape
    grid = (batch, heads, q_pad // plan.block_q)
    if scalar_prefetch:
        spec = pl.BlockSpec((None, None, plan.block_q, kv_pad), lambda b, h, i, _lengths: (b, h, i, 0))
    else:
        spec = pl.BlockSpec((None, None, plan.block_q, kv_pad), lambda b, h, i: (b, h, i, 0))
    return grid, spec


def _lowered(call, plan: _Plan):
    """A compiled call lowered only for its platform (see ``backend.lowered_only_for``)."""
    return backend.compiled_call(("cuda", "rocm") if plan.gpu else ("tpu",), call, plan.interpret)


def _compiler_params(plan: _Plan):
    if plan.gpu:  # naming Triton picks its lowering on every JAX (newer ones default to none)
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _forward_call(logits: jax.Array, lengths: jax.Array, plan: _Plan) -> jax.Array:
    kernel = functools.partial(_forward_kernel, q_len=plan.q_len, kv_len=plan.kv_len, causal=plan.causal)
    out_shape = jax.ShapeDtypeStruct(logits.shape, jnp.float32)
    if plan.gpu:
        grid, spec = _row_blocks(logits.shape, plan, scalar_prefetch=False)
        lengths = jnp.pad(lengths, (0, _next_power_of_two(lengths.shape[0]) - lengths.shape[0]))
        call = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=[pl.BlockSpec(), spec],
                              out_specs=spec, compiler_params=_compiler_params(plan),
                              interpret=plan.interpret)
        return _lowered(call, plan)(lengths, logits)
    grid, spec = _row_blocks(logits.shape, plan, scalar_prefetch=True)
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=[spec],
                                             out_specs=spec)
    call = pl.pallas_call(kernel, out_shape=out_shape, grid_spec=grid_spec,
                          compiler_params=_compiler_params(plan), interpret=plan.interpret)
    return _lowered(call, plan)(lengths, logits)


def _backward_call(probs: jax.Array, dprobs: jax.Array, plan: _Plan) -> jax.Array:
    grid, spec = _row_blocks(probs.shape, plan, scalar_prefetch=False)
    call = pl.pallas_call(_backward_kernel, out_shape=jax.ShapeDtypeStruct(probs.shape, plan.dtype),
                          grid=grid, in_specs=[spec, spec], out_specs=spec,
                          compiler_params=_compiler_params(plan), interpret=plan.interpret)
    return _lowered(call, plan)(probs, dprobs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _padded_softmax(logits: jax.Array, lengths: jax.Array, plan: _Plan) -> jax.Array:
    return _forward_call(logits, lengths, plan)


def _padded_softmax_fwd(logits, lengths, plan):
    probs = _forward_call(logits, lengths, plan)
    return probs, probs


def _padded_softmax_bwd(plan, probs, dprobs):
    return _backward_call(probs, dprobs, plan), None


_padded_softmax.defvjp(_padded_softmax_fwd, _padded_softmax_bwd)


def masked_softmax(logits: jax.Array, *, causal: bool = False, kv_lengths: jax.Array | None = None,
                   interpret: Any = None, block_sizes: SoftmaxBlockSizes | None = None) -> jax.Array:
    """Masked softmax over the key axis, computed by the Pallas kernels above.

    Args:
      logits: ``[batch, heads, q_len, kv_len]``, any float dtype.
      causal: bottom-right aligned causal mask: query ``i`` sees key ``j <= i + kv_len - q_len``.
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding.
      interpret: ``None``: chosen when lowered (interpret mode on CPU, Mosaic on TPU, Triton on
        GPU); ``False``: compiled only (lowering for CPU raises); ``True`` or a
        ``pltpu.InterpretParams``: interpret mode everywhere.
      block_sizes: tiling; by default ``SoftmaxBlockSizes.for_platform(target)`` of each target.

    Returns:
      fp32 probabilities ``[batch, heads, q_len, kv_len]``; rows with no visible key are exact
      zeros. Differentiable through a Pallas backward kernel; fully masked rows get zero gradient.
    """
    if logits.ndim != 4:
        raise ValueError(f"logits must be 4-D [batch, heads, q_len, kv_len], got shape {tuple(logits.shape)}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must be a float array, got {logits.dtype}")
    batch, _, q_len, kv_len = logits.shape
    if kv_lengths is None:
        lengths = jnp.full((batch,), kv_len, jnp.int32)
    else:
        if tuple(kv_lengths.shape) != (batch,):
            raise ValueError(f"kv_lengths must have shape [batch]=({batch},), got {tuple(kv_lengths.shape)}")
        if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise TypeError(f"kv_lengths must be an integer array, got {kv_lengths.dtype}")
        lengths = kv_lengths.astype(jnp.int32)

    def build(target: str, interpret: Any):
        blocks = block_sizes or SoftmaxBlockSizes.for_platform(target)
        plan, q_pad, kv_pad = _plan(logits, causal, target, interpret, blocks)

        def run(logits, lengths):
            if (q_pad, kv_pad) != (q_len, kv_len):
                logits = jnp.pad(logits, ((0, 0), (0, 0), (0, q_pad - q_len), (0, kv_pad - kv_len)))
            return _padded_softmax(logits, lengths, plan)[:, :, :q_len, :kv_len]
        return run

    return backend.per_platform(build, interpret, jax.ShapeDtypeStruct(logits.shape, jnp.float32),
                                logits, lengths)
