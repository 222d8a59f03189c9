"""``flash_attention``: the public entry, padding and the ``custom_vjp`` over the lowerings.

Sequences are zero-padded to whole blocks here (padded keys are masked, padded query rows sliced
off; a no-op when the blocks divide them). The Mosaic kernels read ``[batch, seq_pad, heads,
head_dim]`` as it is (a reshape to ``[.., heads * head_dim]`` would be a relayout copy on TPU),
except compiled under jax < 0.7 (``plan.mosaic_layout``): there they take the free view
``[batch, seq_pad * heads, head_dim]`` where the heads' tiling allows it, else the flat view,
``head_dim`` zero-padded to 128 lanes when heads > 1. Compiled for TPU they take the tiles and
heads per step that ``plan.tpu_tiles`` fits to VMEM unless ``block_sizes`` is given.
The Triton kernels see ``[batch, seq_pad, heads * head_dim]``, ``head_dim`` padded to a power of
two (zeros change no logit and no kept output column).

Every feature of the contract is supported and declared (``flash_attention.features``): the
window and cap are static (part of the plan), segment ids and sinks are arrays. ``dsinks`` is
computed outside the kernels from the saved log-sum-exp and ``di`` (``plan.sink_grads``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from kernel_src import backend
from kernel_src.contract import (FEATURES, Window, check_features, check_inputs, default_scale,
                                 supports)
from kernel_src.flash import gpu, tpu, tpu_backward
from kernel_src.flash.plan import (LANES, LAYOUTS, FlashBlockSizes, Layout, Plan, fit_blocks,
                                   mosaic_layout, next_power_of_two, round_up,
                                   rows_view_is_free, sink_grads, tpu_tiles, window_span)

Variant = Literal["mosaic", "triton"]
_LOWERINGS = {"mosaic": tpu, "triton": gpu}
_BACKWARDS = {"mosaic": tpu_backward.backward, "triton": gpu.backward}
_FAMILY = {"tpu": "mosaic", "gpu": "triton"}  # the kernels each compiled target takes


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, lengths, ids, sinks, plan: Plan):
    if plan.variant == "mosaic":  # a forward-only call writes no log-sum-exp
        return tpu.forward(q, k, v, lengths, plan, ids, sinks, with_lse=False)[0]
    return gpu.forward(q, k, v, lengths, plan, ids, sinks)[0]


def _flash_fwd(q, k, v, lengths, ids, sinks, plan: Plan):
    out, lse = _LOWERINGS[plan.variant].forward(q, k, v, lengths, plan, ids, sinks)
    return out, (q, k, v, lengths, ids, sinks, out, lse)


def _flash_bwd(plan: Plan, residuals, do):
    q, k, v, lengths, ids, sinks, out, lse = residuals
    dq, dk, dv, di = _BACKWARDS[plan.variant](q, k, v, lengths, out, lse, do.astype(q.dtype),
                                              plan, ids)
    dsinks = None
    if sinks is not None:  # lse and di: [batch, hq, 1, q_pad] (Mosaic), [batch, hk, group, q_pad]
        rows = (lse.shape[0], plan.num_q_heads, lse.shape[-1])
        dsinks = sink_grads(sinks, lse.reshape(rows), di.reshape(rows),
                            plan.q_len).astype(sinks.dtype)
    return dq, dk, dv, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes", "interpret",
                                             "variant", "kv_heads_per_step", "layout",
                                             "window", "softcap"))
def _flash_attention(q, k, v, kv_lengths, q_segment_ids=None, kv_segment_ids=None, sinks=None, *,
                     causal: bool, scale: float, block_sizes: FlashBlockSizes, interpret: Any,
                     variant: str, kv_heads_per_step: int | None = None, layout: Layout = "heads",
                     window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None):
    batch, q_len, hq, d = q.shape
    _, kv_len, hk, _ = k.shape
    compiled = not interpret
    blocks = fit_blocks(block_sizes, q_len, kv_len, variant, compiled)
    layout = "flat" if variant == "triton" else layout
    flat_heads = layout == "flat"
    if variant == "triton":
        d_pad = max(16, next_power_of_two(d))
    else:  # a flat Mosaic head is a lane window: whole 128-lane tiles
        d_pad = round_up(d, LANES) if flat_heads and d % LANES and max(hq, hk) > 1 else d
    segments = q_segment_ids is not None
    plan = Plan(q_len, kv_len, hq, hk, causal, scale, blocks, variant, interpret,
                kv_heads_per_step, layout, d_pad if flat_heads and variant == "mosaic" else None,
                window=window, softcap=softcap, segments=segments, sinks=sinks is not None)

    q_multiple = math.lcm(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    kv_multiple = math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    q_pad, kv_pad = round_up(max(q_len, 1), q_multiple), round_up(max(kv_len, 1), kv_multiple)

    def view(x, seq_pad):
        """Padded to ``seq_pad`` rows (and ``d_pad``), in the layout's view."""
        if (seq_pad, d_pad) != (x.shape[1], d):
            x = jnp.pad(x, ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, d_pad - d)))
        if layout == "rows":
            return x.reshape(x.shape[0], seq_pad * x.shape[2], x.shape[3])
        return x.reshape(x.shape[0], seq_pad, -1) if flat_heads else x

    if kv_lengths is None:
        lengths = jnp.full((batch,), kv_len, jnp.int32)
    else:
        lengths = jnp.clip(kv_lengths, 0, kv_len).astype(jnp.int32)
    ids = None
    if segments:  # padded positions are masked by q_len, kv_len: any id
        ids = (jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, q_pad - q_len))),
               jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, kv_pad - kv_len))))
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    if variant == "triton":  # a Triton block must have a power-of-two size
        lengths = jnp.pad(lengths, (0, next_power_of_two(batch) - batch))
    out = _flash(view(q, q_pad), view(k, kv_pad), view(v, kv_pad), lengths, ids, sinks, plan)
    out = out.reshape(batch, q_pad, hq, d_pad)
    return out if (q_pad, d_pad) == (q_len, d) else out[:, :q_len, :, :d]


@supports(*FEATURES)
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    kv_lengths: jax.Array | None = None, scale: float | None = None,
                    window_size: Window | None = None, softcap: float | None = None,
                    q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, sinks: jax.Array | None = None,
                    block_sizes: FlashBlockSizes | None = None, interpret: Any = None,
                    variant: Variant | None = None, layout: Layout | None = None) -> jax.Array:
    """Fused grouped-query attention (the candidate contract), differentiable, in Pallas.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype; ``num_q_heads`` is a
        multiple of ``num_kv_heads`` and query head ``h`` reads kv head ``h // group``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding
        (values are clipped to ``[0, kv_len]``).
      scale: logit scale, ``head_dim ** -0.5`` by default.
      window_size: ``(left, right)``, ints >= 0 or None: row ``i`` at position
        ``p = i + kv_len - q_len`` sees keys ``p - left <= j <= p + right``; key blocks outside
        every row's window of a query block are never read.
      softcap: float > 0: logits become ``softcap * tanh(scale * q.k / softcap)`` before masking.
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` and ``[batch, kv_len]``: a row sees
        only keys of its id; key blocks whose id range meets no row's of a query block are skipped.
      sinks: fp32 ``[num_q_heads]``: one unscaled, uncapped logit per query head in each row's
        softmax denominator (no value); differentiable.
      block_sizes: tiles; by default ``FlashBlockSizes.for_platform(target)`` of each target.
      interpret: ``None``: chosen when lowered (``kernel_src.backend.per_platform``): interpret
        mode on CPU, Mosaic on TPU, Triton on GPU. ``False``: compiled only (lowering for CPU
        raises). ``True`` or e.g. ``pltpu.InterpretParams(...)``: interpret mode everywhere.
      variant: ``"mosaic"`` (grid-carried accumulators, the TPU kernels) or ``"triton"``
        (in-kernel loops, the GPU kernels). By default Triton on GPU, else Mosaic; when given,
        the other family's platform refuses to lower, and interpret mode runs this family.
      layout: how the Mosaic kernels see the heads (``plan.Layout``: ``"heads"``, ``"rows"``,
        ``"flat"``). By default ``"heads"`` in interpret mode and, compiled, the one the
        installed Mosaic takes (``plan.mosaic_layout``); when given, interpret mode runs it too
        (how the tests check on a CPU the layouts compiled under older jax). Not for Triton.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype. Rows with no visible key are
      exact zeros, and so are their gradients.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    window = check_features(dims, window_size=window_size, softcap=softcap,
                            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                            sinks=sinks)
    if window == (None, None):
        window = None
    softcap = None if softcap is None else float(softcap)
    scale = default_scale(dims.head_dim, scale)
    if variant not in (None, "mosaic", "triton"):
        raise ValueError(f"variant must be 'mosaic' or 'triton', got {variant!r}")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "rows" and not all(rows_view_is_free(h, dims.head_dim)
                                    for h in (dims.num_q_heads, dims.num_kv_heads)):
        raise ValueError(f"layout 'rows' needs head_dim a multiple of {LANES} and 1, 2, 4 or a "
                         f"multiple of 8 heads, got {dims.num_q_heads} / {dims.num_kv_heads} "
                         f"heads of {dims.head_dim}")

    def build(target: str, interpret: Any):
        family = variant or ("triton" if target == "gpu" else "mosaic")
        compiled = target != "cpu"
        if compiled and family != _FAMILY[target]:
            raise backend.Unsupported(f"variant={family!r} has no {target} lowering")
        if family == "triton" and layout not in (None, "flat"):
            raise backend.Unsupported(f"layout={layout!r}: the Triton kernels read the flat view")
        blocks, heads = block_sizes or FlashBlockSizes.for_platform(target), None
        chosen = layout or ("heads" if not compiled else mosaic_layout(
            dims.num_q_heads, dims.num_kv_heads, dims.head_dim))
        if compiled and family == "mosaic":  # tiles and heads per step fitted to VMEM
            tiles, heads = tpu_tiles(dims.q_len, dims.kv_len, dims.num_q_heads,
                                     dims.num_kv_heads, dims.head_dim, q.dtype.itemsize,
                                     layout=chosen, span=window_span(window, bool(causal)),
                                     segments=q_segment_ids is not None)
            blocks = block_sizes or tiles
        try:
            fit_blocks(blocks, dims.q_len, dims.kv_len, family, compiled)
        except ValueError as error:
            raise backend.Unsupported(str(error)) from None
        return functools.partial(_flash_attention, causal=bool(causal), scale=scale,
                                 block_sizes=blocks, interpret=interpret, variant=family,
                                 kv_heads_per_step=heads, layout=chosen, window=window,
                                 softcap=softcap)

    return backend.per_platform(build, interpret, jax.ShapeDtypeStruct(q.shape, q.dtype),
                                q, k, v, kv_lengths, q_segment_ids, kv_segment_ids, sinks)
