"""``ragged_paged_attention_tpu`` and ``ragged_paged_attention_triton``: the public entries.

Both take the ragged contract's arguments (``kernel_src.contract``), check them, cut the batch
into work items (``plan.schedule``) and run the family's kernel (interpret mode on CPU, the
compiled kernel on its own platform, refused on the other). The Mosaic kernel reads q's rows and
writes the output's itself; for the Triton kernel each item's rows are gathered as
``kernel_src.paged.plan.to_rows`` tiles (``plan.gather_tiles``) and gathered back
(``plan.scatter_tiles``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kernel_src import backend
from kernel_src.contract import (RAGGED_FEATURES, RaggedDims, Window, check_ragged_features,
                                 check_ragged_inputs, default_scale, supports)
from kernel_src.flash.plan import next_power_of_two, vmem_limits
from kernel_src.paged import tpu as paged_tpu
from kernel_src.paged.plan import tile_rows
from kernel_src.ragged import gpu, tpu
from kernel_src.ragged.plan import RaggedBlockSizes, RaggedPlan, gather_tiles, scatter_tiles, schedule


@functools.partial(jax.jit, static_argnames=("plan", "family", "block_sizes", "vmem_limit"))
def _ragged(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, scales, sinks, *,
            plan: RaggedPlan, family: str, block_sizes: RaggedBlockSizes, vmem_limit: int):
    items = schedule(cu_q_lens, kv_lengths, num_seqs, plan)
    table = page_indices.astype(jnp.int32)
    sinks = None if sinks is None else sinks.astype(jnp.float32)
    if family == "mosaic":
        pages = _mosaic_pages(plan, block_sizes, k_pages.dtype.itemsize)
        return tpu.forward(q, k_pages, v_pages, items, table, scales, sinks, plan, pages,
                           vmem_limit)
    block_k = min(block_sizes.block_k, max(16, next_power_of_two(plan.max_len)))
    out = gpu.forward(gather_tiles(q, items, plan), k_pages, v_pages, items, table, scales, sinks,
                      plan, block_k)
    return scatter_tiles(out, items, plan)


def _mosaic_pages(plan: RaggedPlan, block_sizes: RaggedBlockSizes, itemsize: int) -> int:
    """Pages per Mosaic step: the block sizes', compiled fewer where the buffers are short of VMEM
    (``paged.tpu.fit_pages``)."""
    pages = block_sizes.pages(plan.page_size, plan.pages_per_sequence)
    if plan.interpret:
        return pages
    return paged_tpu.fit_pages(pages, plan.page_size, plan.num_kv_heads, plan.head_dim, itemsize)


def _mosaic_sub_tiles(plan: RaggedPlan, block_sizes: RaggedBlockSizes, pool_itemsize: int,
                      itemsize: int) -> int:
    """Sub-tiles per Mosaic item: the block sizes', no more than the call's rows need, compiled
    fewer where the item's state and the page buffers exceed the VMEM budget (``tpu.fit_sub_tiles``)."""
    plan = dataclasses.replace(plan, sub_tiles=min(block_sizes.sub_tiles,
                                                   -(-plan.num_tokens // plan.block_q)))
    if plan.interpret:
        return plan.sub_tiles
    keys = _mosaic_pages(plan, block_sizes, pool_itemsize) * plan.page_size
    buffers = paged_tpu.buffer_bytes(keys, plan.num_kv_heads, plan.head_dim, pool_itemsize)
    return tpu.fit_sub_tiles(plan, vmem_limits()[1] - buffers, itemsize)


def ragged_plan(family: str, dims: RaggedDims, itemsize: int, target: str, interpret: Any, *,
                causal: bool = True, scale: float | None = None, window: Window | None = None,
                softcap: float | None = None, sinks: bool = False,
                block_sizes: RaggedBlockSizes | None = None) -> tuple[RaggedPlan, RaggedBlockSizes]:
    """The static plan of a call of ``dims`` (q's ``itemsize`` bytes a number) by ``family``
    ("mosaic" or "triton") lowered for ``target`` ("tpu", "gpu", "cpu"), and its block sizes
    (``RaggedBlockSizes.for_step``'s unless given): what the kernel runs with, for the static
    plan's models too."""
    chosen = block_sizes or RaggedBlockSizes.for_step(target, dims.num_tokens, dims.max_seqs)
    block_q = min(chosen.block_q, dims.num_tokens)
    plan = RaggedPlan(dims.num_tokens, dims.max_seqs, dims.num_q_heads, dims.num_kv_heads,
                      dims.head_dim, dims.page_size, dims.pages_per_sequence, dims.num_pages,
                      bool(causal), default_scale(dims.head_dim, scale), interpret,
                      block_q=block_q, rows_pad=tile_rows(dims.group * block_q, family),
                      window=window, softcap=None if softcap is None else float(softcap),
                      sinks=sinks, quantized=dims.quantized, zero_padding=family == "mosaic")
    if family == "mosaic":
        pool_itemsize = jnp.dtype(dims.kv_dtype).itemsize
        plan = dataclasses.replace(plan, sub_tiles=_mosaic_sub_tiles(plan, chosen, pool_itemsize,
                                                                     itemsize))
    return plan, chosen


def _ragged_attention(family: str, q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens,
                      num_seqs, scale, causal, window_size, softcap, sinks, k_scale, v_scale,
                      block_sizes, interpret):
    dims = check_ragged_inputs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs,
                               k_scale, v_scale)
    window = check_ragged_features(dims, window_size=window_size, softcap=softcap, sinks=sinks)
    window = None if window == (None, None) else window
    if dims.num_tokens == 0:
        return jnp.zeros_like(q)
    quantized = dims.quantized
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()),
                        jnp.asarray(v_scale, jnp.float32).reshape(())]) if quantized else None
    home = {"mosaic": "tpu", "triton": "gpu"}[family]

    def build(target: str, interpret: Any):
        if target != "cpu" and target != home:
            raise backend.Unsupported(f"the {family} ragged kernel has no {target} lowering")
        plan, chosen = ragged_plan(family, dims, q.dtype.itemsize, target, interpret,
                                   causal=causal, scale=scale, window=window, softcap=softcap,
                                   sinks=sinks is not None, block_sizes=block_sizes)
        return functools.partial(_ragged, plan=plan, family=family, block_sizes=chosen,
                                 vmem_limit=vmem_limits()[0])

    return backend.per_platform(build, interpret, jax.ShapeDtypeStruct(q.shape, q.dtype),
                                q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens,
                                num_seqs, scales, sinks)


_ARGS_DOC = """
    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``, bf16 or fp32: the new rows of every sequence
        one after another; rows past ``cu_q_lens[num_seqs[0]]`` are padding (any value).
      k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``: q's dtype, or both
        int8 or both float8_e4m3fn with ``k_scale`` and ``v_scale`` (feature "quantized_kv");
        query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
      kv_lengths: int32 ``[max_seqs]``: key ``t < kv_lengths[i]`` of sequence ``i`` is
        ``k_pages[page_indices[i, t // page_size], t % page_size]``.
      page_indices: int32 ``[max_seqs, pages_per_sequence]``.
      cu_q_lens: int32 ``[max_seqs + 1]``: sequence ``i < num_seqs[0]`` owns rows
        ``cu_q_lens[i] <= r < cu_q_lens[i + 1]``, its last ``q_len_i`` keys' positions: row
        ``cu_q_lens[i] + j`` sits at ``kv_lengths[i] - q_len_i + j``.
      num_seqs: int32 ``[1]``: the sequences of this step; later entries of the per-sequence
        arrays are never read.
      scale: logit scale, ``head_dim ** -0.5`` by default.
      causal: bottom-right causal (default): a row sees keys ``t <= position``.
      window_size: ``(left, right)``, ints >= 0 or None: keys ``position - left <= t <=
        position + right`` only (a model's ``sliding_window=W`` is ``(W - 1, 0)``).
      softcap: float > 0: logits become ``softcap * tanh(scale * q.k / softcap)``.
      sinks: fp32 ``[num_q_heads]``: one unscaled logit per query head in each row's
        denominator, with no value.
      k_scale, v_scale: with a quantized pool, Python floats or fp32 0-d arrays (may be
        traced): a key is ``float32(stored) * k_scale``, a value ``* v_scale``.
      block_sizes: ``RaggedBlockSizes`` (rows per tile and tiles per work item, keys per step);
        ``RaggedBlockSizes.for_step``'s by default.
      interpret: ``None``: interpret mode on CPU, compiled on the family's platform, refused
        on the other; ``True`` (or interpret params): interpret mode everywhere; ``False``:
        compiled only.

    Returns:
      ``[num_tokens, num_q_heads, head_dim]`` in q's dtype; padding rows are zeros.
"""


@supports(*RAGGED_FEATURES)
def ragged_paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                               kv_lengths: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array,
                               scale: float | None = None, causal: bool = True,
                               window_size: Window | None = None, softcap: float | None = None,
                               sinks: jax.Array | None = None, k_scale: Any = None,
                               v_scale: Any = None, block_sizes: RaggedBlockSizes | None = None,
                               interpret: Any = None) -> jax.Array:
    return _ragged_attention("mosaic", q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens,
                             num_seqs, scale, causal, window_size, softcap, sinks, k_scale,
                             v_scale, block_sizes, interpret)


@supports(*RAGGED_FEATURES)
def ragged_paged_attention_triton(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                                  kv_lengths: jax.Array, page_indices: jax.Array,
                                  cu_q_lens: jax.Array, num_seqs: jax.Array,
                                  scale: float | None = None, causal: bool = True,
                                  window_size: Window | None = None,
                                  softcap: float | None = None, sinks: jax.Array | None = None,
                                  k_scale: Any = None, v_scale: Any = None,
                                  block_sizes: RaggedBlockSizes | None = None,
                                  interpret: Any = None) -> jax.Array:
    return _ragged_attention("triton", q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens,
                             num_seqs, scale, causal, window_size, softcap, sinks, k_scale,
                             v_scale, block_sizes, interpret)


ragged_paged_attention_tpu.__doc__ = (
    "Ragged paged attention (the ragged contract), forward only: the Mosaic kernel, one call "
    "over a whole serving step.\n" + _ARGS_DOC)
ragged_paged_attention_triton.__doc__ = (
    "Ragged paged attention (the ragged contract), forward only: the Triton kernel; "
    "``block_sizes.block_k`` keys per loop iteration.\n" + _ARGS_DOC)
