"""Ragged paged attention for TPU (Mosaic): one call per serving step, pages DMA'd by hand.

Grid ``(items, steps)``: the item axis (``plan`` module docstring: at most ``block_q`` rows of
one sequence) is "parallel", the step axis "arbitrary" and carries the online softmax in VMEM
scratch. Step ``t`` of an item covers ``pages_per_step`` consecutive entries of its sequence's
page table; the static number of steps is that of a full table, and an item computes only the
steps holding keys in its ``plan.key_range`` (window, causal and length skipping), walked from
the first of them, so every later step does nothing (``pl.when``) and issues no DMA.

Scalar prefetch (SMEM): the work list (int32 ``[items]`` each: sequence, kv length, q_len, first
row ``j0``), the page table flattened to ``[max_seqs * pages_per_sequence]``, with a quantized
pool fp32 ``[2]`` (``k_scale``, ``v_scale``) and with sinks fp32 ``[num_q_heads]``. The table
is not split: it must fit SMEM with the rest (1 MiB up to v6e: 64 sequences of 2,048 entries).

DMA, as ``kernel_src.paged.tpu``'s layout "heads" (its ``walk``): the pools stay in HBM
(``pl.ANY``); each page ``[page_size, kv heads, head_dim]`` a step reaches is one async copy per
pool, in the pool's dtype (int8 and fp8 pages move 1 byte a number), into a VMEM buffer ``[2,
keys_per_step, kv heads, head_dim]``, the next step's copies landing in one slot while the step
computes on the other. A copied page is dequantized in VMEM (``float32(stored) * scale``,
rounded to q's dtype) before its matmul. Buffer slots no copy of this step wrote and slots past
``end`` are masked in the logits (``where``) and zeroed in V, so neither NaN nor stale data
reaches ``P·V``.

Tiles: a step walks the kv heads in a static loop, each with its group's query heads and the
item's rows as one ``[rows_pad, head_dim]`` tile; running max and sum fp32 lane-replicated
``[kv heads, rows_pad, 128]``, the accumulator fp32 ``[kv heads, rows_pad, d]``.

Traffic: an item reads each page it reaches once, whole; a decode row's item is its whole
sequence, so a decode step reads every visible page once (plus at most one page per sequence);
a prompt of ``n`` rows reads its pages up to ``ceil(n / block_q)`` times (causally fewer).
Compiled under jax >= 0.7 only (layout "heads"; no "rows" fallback for older Mosaic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.flash.plan import F32, LANES, online_softmax_step, scores
from kernel_src.flash.tpu import _lanes
from kernel_src.paged.tpu import walk
from kernel_src.ragged.plan import RaggedPlan, dequantize, key_range, visible


def _kernel(seq_ref, len_ref, qlen_ref, j0_ref, table_ref, *refs, plan: RaggedPlan,
            pages_per_step: int):
    """One (item, step) of the grid; the refs are described in the module docstring."""
    scales_ref = refs[0] if plan.quantized else None
    refs = refs[int(plan.quantized):]
    sinks_ref = refs[0] if plan.sinks else None
    refs = refs[int(plan.sinks):]
    q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, m_scratch, l_scratch, acc_scratch = refs
    w, t = pl.program_id(0), pl.program_id(1)
    keys, rows_pad = pages_per_step * plan.page_size, plan.rows_pad
    seq, length, q_len, j0 = seq_ref[w], len_ref[w], qlen_ref[w], j0_ref[w]
    start, end = key_range(length, q_len, j0, plan)
    k_scale = scales_ref[0] if scales_ref is not None else None
    v_scale = scales_ref[1] if scales_ref is not None else None

    def compute(slot, block, clean):
        key0 = block * keys
        tile_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 0)
        tile_keys = key0 + lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 1)
        mask = visible(tile_rows, tile_keys, length, q_len, j0, plan)

        def head(j: int):
            k = dequantize(k_buf[slot, :, j, :], k_scale, q_ref.dtype)
            v = clean(dequantize(v_buf[slot, :, j, :], v_scale, q_ref.dtype))
            m, l, acc = online_softmax_step(scores(q_ref[j], k, mask, plan), v, m_scratch[j],
                                            l_scratch[j], acc_scratch[j], _lanes)
            m_scratch[j], l_scratch[j], acc_scratch[j] = m, l, acc
        for j in range(plan.num_kv_heads):  # one region per head, as paged.tpu
            pl.when(length >= 0)(functools.partial(head, j))

    walk(t, start, end, lambda i: table_ref[seq * plan.pages_per_sequence + i], pages_per_step,
         plan.page_size, (k_hbm, v_hbm, k_buf, v_buf, sems, m_scratch, l_scratch, acc_scratch),
         sinks_ref, o_ref, plan, compute)


def _least_cost(plan: RaggedPlan, pool_itemsize: int, itemsize: int) -> pl.CostEstimate:
    """The kernel's least work for XLA's cost analysis: every table entry's page read once
    (lengths and the rows' split are runtime values: full tables of ``max_seqs`` sequences
    count), every row against every key of its sequence, q read and the output written once."""
    keys = plan.max_seqs * plan.max_len
    pairs = plan.num_tokens * plan.max_len * plan.num_q_heads
    kv = 2 * keys * plan.num_kv_heads * plan.head_dim * pool_itemsize
    rows = 2 * plan.num_tokens * plan.num_q_heads * plan.head_dim * itemsize
    return pl.CostEstimate(flops=4 * plan.head_dim * pairs, transcendentals=pairs,
                           bytes_accessed=kv + rows + keys // plan.page_size * 4)


def forward(q_rows, k_pages, v_pages, items, page_indices, scales, sinks, plan: RaggedPlan,
            pages_per_step: int, vmem_limit: int):
    """``out_rows [items, hk, rows_pad, d]`` (q's dtype) from ``q_rows`` in the same layout, the
    pools ``[num_pages, page_size, hk, d]``, the work list (``plan.Items``), int32
    ``page_indices [max_seqs, pages_per_sequence]``, fp32 ``scales [2]`` (``plan.quantized``)
    and fp32 ``sinks [hq]`` (``plan.sinks``)."""
    hk, rows_pad, d = plan.num_kv_heads, plan.rows_pad, plan.head_dim
    keys = pages_per_step * plan.page_size
    steps = -(-plan.pages_per_sequence // pages_per_step)
    rows_spec = pl.BlockSpec((None, hk, rows_pad, d), lambda w, t, *_: (w, 0, 0, 0))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    prefetch = (items.seq, items.length, items.q_len, items.j0, page_indices.reshape(-1))
    prefetch += (scales,) * plan.quantized + (sinks,) * plan.sinks
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, pages_per_step=pages_per_step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(plan.items, steps),
            in_specs=[rows_spec, anywhere, anywhere], out_specs=rows_spec,
            scratch_shapes=[pltpu.VMEM((2, keys, hk, d), k_pages.dtype),
                            pltpu.VMEM((2, keys, hk, d), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((hk, rows_pad, LANES), F32),
                            pltpu.VMEM((hk, rows_pad, LANES), F32),
                            pltpu.VMEM((hk, rows_pad, d), F32)]),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        cost_estimate=_least_cost(plan, k_pages.dtype.itemsize, q_rows.dtype.itemsize),
        interpret=plan.interpret,
    )
    call = backend.compiled_call(("tpu",), call, plan.interpret)
    return call(*prefetch, q_rows, k_pages, v_pages)
