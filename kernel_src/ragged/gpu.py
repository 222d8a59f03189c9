"""Ragged paged attention for GPU (Triton): each program gathers its keys through the page table.

Grid ``(items, kv heads)``: one program owns one kv head of one work item (``plan`` module
docstring: at most ``block_q`` rows of one sequence), its group's query heads and the item's
rows as one ``[rows_pad, d_pad]`` tile (rows and ``head_dim`` padded to powers of two >= 16, as
Triton's blocks and ``dot`` need), and loops over blocks of ``block_k`` consecutive keys from the
block of the item's first visible key to the one holding its last (``plan.key_range``: window,
causal and length skipping).

Gather, as ``kernel_src.paged.gpu`` (its ``gather_walk``): the pools seen as ``[num_pages *
page_size, kv heads * head_dim]`` (a free reshape); key ``t`` of the item's sequence is row
``page_indices[seq, t // page_size] * page_size + t % page_size``, loaded with one masked gather
per block (any page size). Keys outside ``[start, end)`` are masked in the loads (their table
entries and slots are never read; they load as zeros) and in the logits. Quantized pools are
loaded as stored (1 byte a number) and dequantized in registers: ``float32(stored) * scale``,
rounded to q's dtype. Lowered to Triton IR by the tests; never compiled or run on a GPU from
this repository.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernel_src import backend
from kernel_src.flash.plan import next_power_of_two
from kernel_src.paged.gpu import _masked_load, _pad_to, _whole, gather_walk
from kernel_src.ragged.plan import RaggedPlan, dequantize, key_range, visible


def _kernel(seq_ref, len_ref, qlen_ref, j0_ref, table_ref, *refs, plan: RaggedPlan,
            block_k: int, stored):
    """One (item, kv head) program. The item arrays int32 ``[items_pad]``; table_ref int32
    ``[max_seqs_pad, table_pad]``; then fp32 scales ``[2]`` (quantized) and sinks ``[hq_pad]``
    (sinks); q_ref, o_ref ``[rows_pad, d_pad]``; k_ref, v_ref ``[num_pages * page_size, hk * d]``."""
    scales_ref = refs[0] if plan.quantized else None
    refs = refs[int(plan.quantized):]
    sinks_ref = refs[0] if plan.sinks else None
    q_ref, k_ref, v_ref, o_ref = refs[int(plan.sinks):]
    w = pl.program_id(0)
    seq, length, q_len, j0 = seq_ref[w], len_ref[w], qlen_ref[w], j0_ref[w]
    start, end = key_range(length, q_len, j0, plan)
    scale = (None, None) if scales_ref is None else (scales_ref[0], scales_ref[1])

    def convert(x, which):
        return dequantize(lax.bitcast_convert_type(x, stored), scale[which], q_ref.dtype)
    gather_walk(start, end, lambda entry, real: _masked_load(table_ref, (seq, entry), real),
                lambda rows, keys: visible(rows, keys, length, q_len, j0, plan),
                (q_ref, k_ref, v_ref, o_ref), sinks_ref, plan, block_k, convert)


def forward(q_rows, k_pages, v_pages, items, page_indices, scales, sinks, plan: RaggedPlan,
            block_k: int):
    """``out_rows [items, hk, rows_pad, d]`` (q's dtype) from ``q_rows`` in the same layout, the
    pools ``[num_pages, page_size, hk, d]``, the work list (``plan.Items``), int32
    ``page_indices [max_seqs, pages_per_sequence]``, fp32 ``scales [2]`` (``plan.quantized``)
    and fp32 ``sinks [hq]`` (``plan.sinks``)."""
    from jax.experimental.pallas import triton as pltriton

    num_items, hk, rows_pad, d = q_rows.shape
    d_pad = max(16, next_power_of_two(d))
    items_pad = next_power_of_two(num_items)
    work = [_pad_to(x, (items_pad,)) for x in (items.seq, items.length, items.q_len, items.j0)]
    table = _pad_to(page_indices, tuple(map(next_power_of_two, page_indices.shape)))
    flat = (k_pages.shape[0] * plan.page_size, hk * d)
    # Triton's masked load fills with an int: fp8 pages travel as their bytes (a free bitcast)
    carried = jnp.uint8 if k_pages.dtype == jnp.float8_e4m3fn else k_pages.dtype
    k_flat, v_flat = (lax.bitcast_convert_type(x.reshape(flat), carried) for x in (k_pages, v_pages))
    extra = [scales] if plan.quantized else []
    if plan.sinks:
        extra.append(_pad_to(sinks, (next_power_of_two(sinks.shape[0]),)))
    tile = pl.BlockSpec((None, None, rows_pad, d_pad), lambda w, j: (w, j, 0, 0))
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, block_k=block_k, stored=k_pages.dtype),
        grid=(num_items, hk),
        in_specs=[*map(_whole, work), _whole(table), *map(_whole, extra), tile, _whole(k_flat),
                  _whole(v_flat)],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((num_items, hk, rows_pad, d_pad), q_rows.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
    )
    call = backend.compiled_call(("cuda", "rocm"), call, plan.interpret)
    out = call(*work, table, *extra, _pad_to(q_rows, (num_items, hk, rows_pad, d_pad)), k_flat,
               v_flat)
    return out[..., :d]
