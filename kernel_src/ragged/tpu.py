"""Ragged paged attention for TPU (Mosaic): one call per serving step, rows and pages DMA'd by hand.

Grid ``(items, steps)``: the item axis (``plan`` module docstring: at most ``item_rows`` rows of
one sequence) is "parallel", the step axis "arbitrary" and carries the online softmax in VMEM
scratch. Step ``t`` of an item covers ``pages_per_step`` consecutive entries of its sequence's
page table; the static number of steps is that of a full table, and an item computes only the
steps holding keys in its ``plan.key_range`` (window, causal and length skipping), walked from
the first of them, so every later step does nothing (``pl.when``) and issues no DMA.

Scalar prefetch (SMEM): the work list (int32 ``[items]`` each: sequence, kv length, q_len, first
row ``j0``, its row of q ``first``, its ``rows``), the page table flattened to ``[max_seqs *
pages_per_sequence]``, with a quantized pool fp32 ``[2]`` (``k_scale``, ``v_scale``) and with
sinks fp32 ``[num_q_heads]``. The table is not split: it must fit SMEM with the rest (1 MiB up to
v6e: 64 sequences of 2,048 entries).

Rows. ``q`` and the output stay in HBM (``pl.ANY``), ``[num_tokens, hq, d]``. Step 0 of an item
that sees any key copies exactly its ``rows`` rows of q into a VMEM buffer ``[item_rows, hq, d]``
(``copy_rows``: one static-size copy per set bit of ``rows``) and lays them out as tiles
``[sub_tiles, kv heads, rows_pad, d]``, ``block_q`` rows a sub-tile as
``kernel_src.paged.plan.to_rows`` lays them; the last step writes each sub-tile's output rows
into that buffer and copies exactly ``rows`` rows of it out. The padding rows past the last
sequence's are items of no keys (``plan.zero_padding``): they read nothing and write zeros. So q
is read once and each output row written once, by DMA; nothing runs in XLA but the work list.

DMA, as ``kernel_src.paged.tpu``'s layout "heads" (its ``walk``): the pools stay in HBM
(``pl.ANY``); each page ``[page_size, kv heads, head_dim]`` a step reaches is one async copy per
pool, in the pool's dtype (int8 and fp8 pages move 1 byte a number), into a VMEM buffer ``[2,
keys_per_step, kv heads, head_dim]``, the next step's copies landing in one slot while the step
computes on the other. A copied page is dequantized in VMEM (``float32(stored) * scale``,
rounded to q's dtype) before its matmuls. Buffer slots no copy of this step wrote and slots past
``end`` are masked in the logits (``where``) and zeroed in V, so neither NaN nor stale data
reaches ``P·V``.

Tiles: a step walks the kv heads in a static loop, each against the item's live sub-tiles (a
runtime count, ``ceil(rows / block_q)``: a decode item computes one) that see keys of the step
(causal skipping per sub-tile: compute only), each sub-tile its group's query heads and
``block_q`` rows as one ``[rows_pad, head_dim]`` tile; running max and sum fp32 lane-replicated
``[sub_tiles, kv heads, rows_pad, 128]``, the accumulator fp32 ``[sub_tiles, kv heads, rows_pad,
d]``.

Traffic: an item reads each page it reaches once, whole, for all its rows; a decode row's item is
its whole sequence, so a decode step reads every visible page once (plus at most one page per
sequence); a prompt of ``n`` rows reads its pages up to ``ceil(n / item_rows)`` times (causally
fewer); q's rows of real sequences are read once and every output row written once.
Compiled under jax >= 0.7 only (layout "heads"; no "rows" fallback for older Mosaic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.flash.plan import F32, LANES, finish, online_softmax_step, scores
from kernel_src.flash.tpu import _lanes
from kernel_src.paged import tpu as paged_tpu
from kernel_src.paged.plan import div_up, row_sinks
from kernel_src.ragged.plan import RaggedPlan, dequantize, key_range, visible


def copy_rows(rows, src_at, dst_at, sem, most: int, action) -> None:
    """``action`` on the copies of rows ``[0, rows)`` (``rows <= most``, traced): one copy of
    ``2 ** b`` rows per set bit ``b``, largest first; ``src_at(offset, size)`` and
    ``dst_at(offset, size)`` give each end's ref."""
    for b in reversed(range(most.bit_length())):
        size = 1 << b
        offset = lax.shift_left(lax.shift_right_logical(rows, b + 1), b + 1)

        @pl.when(lax.bitwise_and(lax.shift_right_logical(rows, b), 1) == 1)
        def _copy():
            action(pltpu.make_async_copy(src_at(offset, size), dst_at(offset, size), sem))


def _kernel(seq_ref, len_ref, qlen_ref, j0_ref, first_ref, rows_ref, table_ref, *refs,
            plan: RaggedPlan, pages_per_step: int):
    """One (item, step) of the grid; the refs are described in the module docstring."""
    scales_ref = refs[0] if plan.quantized else None
    refs = refs[int(plan.quantized):]
    sinks_ref = refs[0] if plan.sinks else None
    refs = refs[int(plan.sinks):]
    (q_hbm, k_hbm, v_hbm, o_hbm, k_buf, v_buf, sems, row_buf, q_tiles, row_sems, m_scratch,
     l_scratch, acc_scratch) = refs
    w, t = pl.program_id(0), pl.program_id(1)
    keys, rows_pad, bq, g = pages_per_step * plan.page_size, plan.rows_pad, plan.block_q, plan.group
    seq, length, q_len, j0 = seq_ref[w], len_ref[w], qlen_ref[w], j0_ref[w]
    first, rows = first_ref[w], rows_ref[w]
    most = min(plan.item_rows, plan.num_tokens)  # rows an item may have
    live = div_up(rows, bq)  # sub-tiles holding rows of the item
    start, end = key_range(length, q_len, j0, plan)
    k_scale = scales_ref[0] if scales_ref is not None else None
    v_scale = scales_ref[1] if scales_ref is not None else None

    def each_sub_tile(body):
        lax.fori_loop(0, live, lambda s, carry: (body(s), carry)[1], 0)

    def hbm_rows(ref):
        return lambda offset, size: ref.at[pl.ds(first + offset, size)]

    def buf_rows(offset, size):
        return row_buf.at[pl.ds(offset, size)]

    def init():
        @pl.when(end > start)  # padding and empty items read no q
        def _rows_in():
            for action in (lambda c: c.start(), lambda c: c.wait()):
                copy_rows(rows, hbm_rows(q_hbm), buf_rows, row_sems.at[0], most, action)

            def tile(s):
                for h in range(plan.num_q_heads):
                    q_tiles[s, h // g, pl.ds((h % g) * bq, bq)] = row_buf[pl.ds(s * bq, bq), h]
            each_sub_tile(tile)
        tile_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, LANES), 0)

        def stats(s):
            for j in range(plan.num_kv_heads):
                if sinks_ref is not None:
                    m_scratch[s, j], l_scratch[s, j] = row_sinks(lambda h: sinks_ref[h], j,
                                                                 tile_rows, plan)
                else:
                    m_scratch[s, j] = jnp.full((rows_pad, LANES), -jnp.inf, F32)
                    l_scratch[s, j] = jnp.zeros((rows_pad, LANES), F32)
                acc_scratch[s, j] = jnp.zeros(acc_scratch.shape[2:], F32)
        each_sub_tile(stats)

    def compute(slot, block, clean):
        key0 = block * keys
        tile_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 0)
        tile_keys = key0 + lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 1)

        def head(j: int):
            k = dequantize(k_buf[slot, :, j, :], k_scale, q_tiles.dtype)
            v = clean(dequantize(v_buf[slot, :, j, :], v_scale, q_tiles.dtype))

            def sub_tile(s):
                sub_j0 = j0 + s * bq
                sub_start, sub_end = key_range(length, q_len, sub_j0, plan, bq)

                @pl.when((sub_start < key0 + keys) & (sub_end > key0))
                def _fold():
                    mask = visible(tile_rows, tile_keys, length, q_len, sub_j0, plan)
                    m, l, acc = online_softmax_step(scores(q_tiles[s, j], k, mask, plan), v,
                                                    m_scratch[s, j], l_scratch[s, j],
                                                    acc_scratch[s, j], _lanes)
                    m_scratch[s, j], l_scratch[s, j], acc_scratch[s, j] = m, l, acc
            each_sub_tile(sub_tile)
        for j in range(plan.num_kv_heads):  # one region per head, as paged.tpu
            pl.when(length >= 0)(functools.partial(head, j))

    def store():
        def out_rows(s):
            for j in range(plan.num_kv_heads):
                out, _ = finish(m_scratch[s, j], l_scratch[s, j], acc_scratch[s, j], _lanes)
                for i in range(g):
                    row_buf[pl.ds(s * bq, bq), j * g + i] = out[i * bq:(i + 1) * bq].astype(
                        row_buf.dtype)
        each_sub_tile(out_rows)
        for action in (lambda c: c.start(), lambda c: c.wait()):
            copy_rows(rows, buf_rows, hbm_rows(o_hbm), row_sems.at[1], most, action)

    paged_tpu.walk(t, start, end, lambda i: table_ref[seq * plan.pages_per_sequence + i],
                   pages_per_step, plan.page_size,
                   (k_hbm, v_hbm, k_buf, v_buf, sems, m_scratch, l_scratch, acc_scratch), sinks_ref,
                   None, plan, compute, init=init, store=store)


def state_bytes(plan: RaggedPlan, itemsize: int) -> int:
    """VMEM of an item's rows and statistics: the row buffer ``[item_rows, hq, d]`` and tiles
    ``[sub_tiles, hk, rows_pad, d]`` in q's dtype (``itemsize``), running max and sum
    ``[sub_tiles, hk, rows_pad, 128]`` and accumulator ``[sub_tiles, hk, rows_pad, d]`` in fp32
    (sublanes and lanes padded to whole tiles)."""
    d = -(-plan.head_dim // LANES) * LANES
    sublanes = 32 // itemsize
    heads = -(-plan.num_q_heads // sublanes) * sublanes
    tiles = plan.sub_tiles * plan.num_kv_heads * plan.rows_pad
    return plan.item_rows * heads * d * itemsize + tiles * d * itemsize + tiles * (2 * LANES + d) * 4


def fit_sub_tiles(plan: RaggedPlan, budget: int, itemsize: int) -> int:
    """``plan.sub_tiles``, halved until ``state_bytes`` fits ``budget`` (at least 1)."""
    sub_tiles = plan.sub_tiles
    while sub_tiles > 1 and state_bytes(dataclasses.replace(plan, sub_tiles=sub_tiles), itemsize) > budget:
        sub_tiles //= 2
    return sub_tiles


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


def forward(q, k_pages, v_pages, items, page_indices, scales, sinks, plan: RaggedPlan,
            pages_per_step: int, vmem_limit: int):
    """``out [num_tokens, hq, d]`` (q's dtype; padding rows zeros) from ``q`` in the same shape,
    the pools ``[num_pages, page_size, hk, d]``, the work list (``plan.Items``, with
    ``plan.zero_padding``), int32 ``page_indices [max_seqs, pages_per_sequence]``, fp32 ``scales
    [2]`` (``plan.quantized``) and fp32 ``sinks [hq]`` (``plan.sinks``)."""
    hk, rows_pad, d = plan.num_kv_heads, plan.rows_pad, plan.head_dim
    keys = pages_per_step * plan.page_size
    steps = -(-plan.pages_per_sequence // pages_per_step)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    prefetch = tuple(items) + (page_indices.reshape(-1),)
    prefetch += (scales,) * plan.quantized + (sinks,) * plan.sinks
    tiles = (plan.sub_tiles, hk, rows_pad)
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, pages_per_step=pages_per_step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(plan.items, steps),
            in_specs=[anywhere] * 3, out_specs=anywhere,
            scratch_shapes=[pltpu.VMEM((2, keys, hk, d), k_pages.dtype),
                            pltpu.VMEM((2, keys, hk, d), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((plan.item_rows, plan.num_q_heads, d), q.dtype),
                            pltpu.VMEM((*tiles, d), q.dtype),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((*tiles, LANES), F32),
                            pltpu.VMEM((*tiles, LANES), F32),
                            pltpu.VMEM((*tiles, d), F32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        cost_estimate=_least_cost(plan, k_pages.dtype.itemsize, q.dtype.itemsize),
        interpret=plan.interpret,
    )
    call = backend.compiled_call(("tpu",), call, plan.interpret)
    return call(*prefetch, q, k_pages, v_pages)
