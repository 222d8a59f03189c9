"""``flash_attention``: the public entry, padding and the ``custom_vjp`` over the lowerings.

Sequences are zero-padded to whole blocks here (padded keys are masked, padded query rows sliced
off; a no-op when the blocks divide them). The Mosaic kernels read ``[batch, seq_pad, heads,
head_dim]`` as it is (a reshape would be a relayout copy on TPU), except compiled under jax < 0.7
whose Mosaic cannot (``tpu.HEADS_IN_PLACE``): there they take the flat view below, ``head_dim``
zero-padded to 128 lanes when heads > 1. Compiled for TPU they take the tiles and heads per step
that ``plan.tpu_tiles`` fits to VMEM unless ``block_sizes`` is given.
The Triton kernels see ``[batch, seq_pad, heads * head_dim]``, ``head_dim`` padded to a power of
two (zeros change no logit and no kept output column).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from kernel_src import backend
from kernel_src.contract import check_inputs, default_scale
from kernel_src.flash import gpu, tpu
from kernel_src.flash.plan import (LANES, FlashBlockSizes, Plan, fit_blocks,
                                   next_power_of_two, round_up, tpu_tiles)

Variant = Literal["mosaic", "triton"]
_LOWERINGS = {"mosaic": tpu, "triton": gpu}
_FAMILY = {"tpu": "mosaic", "gpu": "triton"}  # the kernels each compiled target takes


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, lengths, plan: Plan):
    if plan.variant == "mosaic":  # a forward-only call writes no log-sum-exp
        return tpu.forward(q, k, v, lengths, plan, with_lse=False)[0]
    return gpu.forward(q, k, v, lengths, plan)[0]


def _flash_fwd(q, k, v, lengths, plan: Plan):
    out, lse = _LOWERINGS[plan.variant].forward(q, k, v, lengths, plan)
    return out, (q, k, v, lengths, out, lse)


def _flash_bwd(plan: Plan, residuals, do):
    q, k, v, lengths, out, lse = residuals
    dq, dk, dv = _LOWERINGS[plan.variant].backward(q, k, v, lengths, out, lse,
                                                   do.astype(q.dtype), plan)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes", "interpret",
                                             "variant", "kv_heads_per_step"))
def _flash_attention(q, k, v, kv_lengths, *, causal: bool, scale: float,
                     block_sizes: FlashBlockSizes, interpret: Any, variant: str,
                     kv_heads_per_step: int | None = None):
    batch, q_len, hq, d = q.shape
    _, kv_len, hk, _ = k.shape
    compiled = not interpret
    blocks = fit_blocks(block_sizes, q_len, kv_len, variant, compiled)
    flat_heads = variant == "triton" or (compiled and not tpu.HEADS_IN_PLACE)
    if variant == "triton":
        d_pad = max(16, next_power_of_two(d))
    else:  # a flat Mosaic head is a lane window: whole 128-lane tiles
        d_pad = round_up(d, LANES) if flat_heads and d % LANES and max(hq, hk) > 1 else d
    plan = Plan(q_len, kv_len, hq, hk, causal, scale, blocks, variant, interpret,
                kv_heads_per_step, d_pad if flat_heads and variant == "mosaic" else None)

    q_multiple = math.lcm(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    kv_multiple = math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    q_pad, kv_pad = round_up(max(q_len, 1), q_multiple), round_up(max(kv_len, 1), kv_multiple)

    def flat(x, seq_pad):
        """Padded to ``seq_pad`` rows (and ``d_pad``); heads flattened unless read in place."""
        if (seq_pad, d_pad) != (x.shape[1], d):
            x = jnp.pad(x, ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, d_pad - d)))
        return x.reshape(x.shape[0], seq_pad, -1) if flat_heads else x

    if kv_lengths is None:
        lengths = jnp.full((batch,), kv_len, jnp.int32)
    else:
        lengths = jnp.clip(kv_lengths, 0, kv_len).astype(jnp.int32)
    if variant == "triton":  # a Triton block must have a power-of-two size
        lengths = jnp.pad(lengths, (0, next_power_of_two(batch) - batch))
    out = _flash(flat(q, q_pad), flat(k, kv_pad), flat(v, kv_pad), lengths, plan)
    out = out.reshape(batch, q_pad, hq, d_pad)
    return out if (q_pad, d_pad) == (q_len, d) else out[:, :q_len, :, :d]


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    kv_lengths: jax.Array | None = None, scale: float | None = None,
                    block_sizes: FlashBlockSizes | None = None, interpret: Any = None,
                    variant: Variant | None = None) -> jax.Array:
    """Fused grouped-query attention (the candidate contract), differentiable, in Pallas.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype; ``num_q_heads`` is a
        multiple of ``num_kv_heads`` and query head ``h`` reads kv head ``h // group``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding
        (values are clipped to ``[0, kv_len]``).
      scale: logit scale, ``head_dim ** -0.5`` by default.
      block_sizes: tiles; by default ``FlashBlockSizes.for_platform(target)`` of each target.
      interpret: ``None``: chosen when lowered (``kernel_src.backend.per_platform``): interpret
        mode on CPU, Mosaic on TPU, Triton on GPU. ``False``: compiled only (lowering for CPU
        raises). ``True`` or e.g. ``pltpu.InterpretParams(...)``: interpret mode everywhere.
      variant: ``"mosaic"`` (grid-carried accumulators, the TPU kernels) or ``"triton"``
        (in-kernel loops, the GPU kernels). By default Triton on GPU, else Mosaic; when given,
        the other family's platform refuses to lower, and interpret mode runs this family.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype. Rows with no visible key are
      exact zeros, and so are their gradients.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    scale = default_scale(dims.head_dim, scale)
    if variant not in (None, "mosaic", "triton"):
        raise ValueError(f"variant must be 'mosaic' or 'triton', got {variant!r}")

    def build(target: str, interpret: Any):
        family = variant or ("triton" if target == "gpu" else "mosaic")
        compiled = target != "cpu"
        if compiled and family != _FAMILY[target]:
            raise backend.Unsupported(f"variant={family!r} has no {target} lowering")
        blocks, heads = block_sizes or FlashBlockSizes.for_platform(target), None
        if compiled and family == "mosaic":  # tiles and heads per step fitted to VMEM
            tiles, heads = tpu_tiles(dims.q_len, dims.kv_len, dims.num_q_heads,
                                     dims.num_kv_heads, dims.head_dim, q.dtype.itemsize)
            blocks = block_sizes or tiles
        try:
            fit_blocks(blocks, dims.q_len, dims.kv_len, family, compiled)
        except ValueError as error:
            raise backend.Unsupported(str(error)) from None
        return functools.partial(_flash_attention, causal=bool(causal), scale=scale,
                                 block_sizes=blocks, interpret=interpret, variant=family,
                                 kv_heads_per_step=heads)

    return backend.per_platform(build, interpret, jax.ShapeDtypeStruct(q.shape, q.dtype),
                                q, k, v, kv_lengths)
