"""Paged attention for TPU (Mosaic): pages DMA'd by hand through a scalar-prefetched page table.

Grid ``(batch, steps)``: the batch axis is "parallel", the step axis "arbitrary" and carries
the online softmax in VMEM scratch. Step ``t`` of sequence ``b`` covers ``pages_per_step``
consecutive entries of its page table, ``keys_per_step = pages_per_step * page_size`` keys; the
static number of steps is that of a full table, and a sequence computes only the steps that hold
keys some row may see (``[first_key, length)``, ``plan.first_key``), walked from the first of
them, so every later step does nothing (``pl.when``) and issues no DMA.

Scalar prefetch (SMEM): int32 ``kv_lengths [batch]``, the page table flattened to
``[batch * pages_per_sequence]`` and, with sinks, fp32 ``[num_q_heads]``. A table past
``TABLE_BYTES`` is split into several calls over slices of the batch (SMEM holds 1 MiB up to
v6e; one sequence of 131,072 keys in pages of 16 takes 32 KiB).

DMA. ``k_pages`` and ``v_pages`` stay in HBM (``pl.ANY``); each page ``[page_size, kv heads,
head_dim]`` is contiguous there and is one async copy into a VMEM buffer ``[2, keys_per_step,
kv heads, head_dim]`` (layout "heads"; "rows": ``[2, keys_per_step * kv heads, d]``, below;
two slots: the step computes on one while the next step's pages land in the other). A step
copies only the pages its sequence reaches (``[first_key // page_size, ceil(length /
page_size))``): a table entry past a sequence's last page is never read as an
address, and a page beyond it never copied. The first computing step of a sequence starts its
own copies (no prefetch crosses sequences, so the batch axis may split across cores).
Slots of the buffer that no copy of this step wrote (past the last page, before the window's
first page) hold an earlier step's or uninitialized data, and the slots past the length in the
last page whatever the pool holds: their logits are masked (``where``) and, on the steps that
hold such keys, their V rows replaced by zeros, so ``0 * NaN`` never reaches ``P·V``.

Tiles. All kv heads of a page arrive together; a step walks them in a static loop, each with its
whole group of query heads and new rows as one ``[rows_pad, head_dim]`` tile (``plan.to_rows``):
``q_ref [kv heads, rows_pad, d]``, logits ``[rows_pad, keys_per_step]``. Running max and sum
are fp32 lane-replicated ``[kv heads, rows_pad, 128]``, the accumulator fp32 ``[kv heads,
rows_pad, d]``; the output block is written once, after the last step. A head is read out of
the buffer by ``heads.Heads`` (``kernel_src.flash.heads``, shared with the flash kernels), in
one of two layouts (``mosaic_layout``; both give the same bits, interpreted):

* "heads" (jax >= 0.7, and one kv head): the pool as it is, a head ``buf[slot, :, j, :]``.
* "rows" (jax < 0.7, whose Mosaic cannot take one head, a second-minor index, out of a block:
  "Unsupported implicit dim change"): the pool viewed as ``[num_pages, page_size * kv heads,
  d]`` (``rows_view``: free in XLA for d a multiple of 128 and 2, 4 or a multiple of 8 kv
  heads; otherwise a copy of the pool, d zero-padded to whole lanes, since that Mosaic slices
  no buffer with a lane-partial last dim), a head every ``kv heads``-th row of the slot, a
  strided load, through a 32-bit copy of the slot for 16-bit data (so 1 or an even number of
  kv heads there). Lanes past head_dim are dropped before any math.

Compiled for v5e (deviceless), the tests' shapes (Llama-3-8B decode: bf16, 8 kv heads, d 128,
pages of 16; one kv head in fp32 with every feature; 4 kv heads of d 64 in pages of 24) compile
under jax 0.10 (libtpu 0.0.42, "heads") and jax 0.6.2 (libtpu 0.0.17: "rows", one kv head
"heads").

Traffic: each page a sequence reaches is copied once per sequence, whole (the last page's slots
past the length too), so K and V are read once, plus at most one page per sequence (layout
"rows" where its view is no free one: plus XLA's copy of both pools, padded, each call).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.flash.heads import WORD, Heads
from kernel_src.flash.plan import (F32, HEADS_IN_PLACE, LANES, finish, online_softmax_step,
                                   round_up, scores)
from kernel_src.flash.tpu import _lanes
from kernel_src.paged.plan import (PagedPlan, div_up, first_key, row_sinks, visible)

# The most bytes of SMEM the flattened page table of one call may take; a larger table is
# split over the batch (``forward``).
TABLE_BYTES = 256 * 2 ** 10
# VMEM the K/V buffers (two slots each) may take compiled; pages per step shrink to fit.
BUFFER_BYTES = 16 * 2 ** 20
_SUBLANE_BYTES = 32  # a VMEM tile holds 8 rows of 32 bits, 16 of 16 bits
# How the K/V buffers hold the kv heads (the module docstring): "heads" ``[keys, kv heads, d]``
# (a head ``buf[:, j, :]``) or "rows" ``[keys * kv heads, d]`` (a head every kv heads-th row).
LAYOUTS = ("heads", "rows")


def mosaic_layout(num_kv_heads: int, itemsize: int) -> str:
    """The layout compiled kernels take under the installed jax: "heads" where its Mosaic takes
    one head out of a block (jax >= 0.7), and for one kv head (the block is the head); "rows"
    under older jax, except 16-bit data with an odd number of kv heads, which has no 32-bit head
    pairs (``heads.Heads``): "heads" there, which that Mosaic cannot compile."""
    if HEADS_IN_PLACE or num_kv_heads == 1 or (itemsize < 4 and num_kv_heads % 2):
        return "heads"
    return "rows"


def buffer_bytes(keys_per_step: int, num_kv_heads: int, head_dim: int, itemsize: int,
                 layout: str = "heads") -> int:
    """VMEM of the K and V buffers, two slots each. "heads": ``[keys, kv heads, d]`` tiled on
    its last two dims, the heads padded to whole sublane tiles (8 in fp32, 16 in bf16). "rows":
    ``[keys * kv heads, d]``, d padded to whole lanes, plus in 16 bits one 32-bit copy of a slot
    of each (``heads.Heads.copy_words``)."""
    if layout == "rows":
        slot = keys_per_step * num_kv_heads * round_up(head_dim, LANES) * itemsize
        return (4 + 2 * (itemsize < 4 and num_kv_heads > 1)) * slot  # words: a slot's bytes
    sublanes = _SUBLANE_BYTES // itemsize
    heads = -(-num_kv_heads // sublanes) * sublanes
    return 4 * keys_per_step * heads * head_dim * itemsize


def fit_pages(pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              itemsize: int, layout: str = "heads") -> int:
    """``pages`` per step, halved until the buffers fit ``BUFFER_BYTES`` (at least 1)."""
    while pages > 1 and buffer_bytes(pages * page_size, num_kv_heads, head_dim,
                                     itemsize, layout) > BUFFER_BYTES:
        pages //= 2
    return pages


def _words(plan: PagedPlan, keys: int, dtype) -> tuple[int, int] | None:
    """The shape of the 32-bit copy of one K (or V) buffer slot, where the layout reads heads
    through one ("rows", 16 bits, several kv heads: ``heads.Heads``); ``None`` elsewhere."""
    hk = plan.num_kv_heads
    if plan.layout != "rows" or hk == 1 or jnp.dtype(dtype).itemsize == 4:
        return None
    return (keys * hk * jnp.dtype(dtype).itemsize // 4, buffer_dim(plan))


def buffer_dim(plan: PagedPlan) -> int:
    """The last dim of the K/V buffers: head_dim, in layout "rows" padded to whole lanes (the
    Mosaic of jax < 0.7 slices no VMEM buffer whose last dim is not a multiple of 128)."""
    return round_up(plan.head_dim, LANES) if plan.layout == "rows" else plan.head_dim


def _kernel(lengths_ref, table_ref, *refs, plan: PagedPlan, pages_per_step: int):
    """One (sequence, step) of the grid; the refs are described in the module docstring."""
    sinks_ref = refs[0] if plan.sinks else None
    refs = refs[int(plan.sinks):]
    q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, m_scratch, l_scratch, acc_scratch = refs[:10]
    k_words, v_words = refs[10:] or (None, None)
    b, t = pl.program_id(0), pl.program_id(1)
    page_size, keys = plan.page_size, pages_per_step * plan.page_size
    rows_pad, hk = plan.rows_pad, plan.num_kv_heads

    length = lengths_ref[b]
    page_rows = page_size * (hk if plan.layout == "rows" else 1)  # buffer rows of one page

    def compute(slot, block, clean):
        key0 = block * keys
        tile_rows = lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 0)
        tile_keys = key0 + lax.broadcasted_iota(jnp.int32, (rows_pad, keys), 1)
        mask = visible(tile_rows, tile_keys, length, plan)
        d = plan.head_dim
        k_heads, v_heads = (Heads(buf.at[slot], hk, plan, words)
                            for buf, words in ((k_buf, k_words), (v_buf, v_words)))
        k_heads.copy_words()
        v_heads.copy_words()

        def head(j: int):
            s = scores(q_ref[j], k_heads.load(j)[:, :d], mask, plan)
            v = clean(v_heads.load(j)[:, :d])
            m, l, acc = online_softmax_step(s, v, m_scratch[j], l_scratch[j], acc_scratch[j],
                                            _lanes)
            m_scratch[j], l_scratch[j], acc_scratch[j] = m, l, acc
        for j in range(hk):  # one region per head: Mosaic schedules one head's tile at a time
            pl.when(length >= 0)(functools.partial(head, j))

    walk(t, first_key(length, plan), length, lambda i: table_ref[b * plan.pages_per_sequence + i],
         pages_per_step, page_rows, (k_hbm, v_hbm, k_buf, v_buf, sems, m_scratch, l_scratch,
                                     acc_scratch), sinks_ref, o_ref, plan, compute)


def walk(t, start, end, table_at, pages_per_step: int, page_rows: int, refs, sinks_ref, o_ref,
         plan, compute, init=None, store=None) -> None:
    """Grid step ``t`` of one tile's walk over its keys ``[start, end)``, steps of
    ``pages_per_step`` table entries (``table_at(i)``: the page of entry ``i``), as the module
    docstring describes: step 0 starts the first copies and the statistics (with the sinks:
    ``row_sinks``; ``init()`` instead where given); a step that computes starts the next one's
    copies, waits for its own and calls ``compute(slot, block, clean)``, ``clean(v)`` zeroing the
    rows of a ``[keys, d]`` V tile that no copy of this step wrote or that lie at or past ``end``;
    the last grid step stores the rows into ``o_ref`` (``store()`` instead where given).
    ``refs``: ``(k_hbm, v_hbm, k_buf, v_buf, sems, m, l, acc)``; ``page_rows``: the buffer rows
    of one page."""
    k_hbm, v_hbm, k_buf, v_buf, sems, m_scratch, l_scratch, acc_scratch = refs
    page_size, keys = plan.page_size, pages_per_step * plan.page_size
    end = jnp.maximum(end, 0)
    first_step = lax.div(start, keys)
    count = jnp.where(end > start, div_up(end, keys) - first_step, 0)  # steps that compute
    first_page, end_page = lax.div(start, page_size), div_up(end, page_size)

    def each_page(block, slot, action):
        """``action`` on the K and V copy of every page of step block ``block`` that the
        tile reaches, into buffer slot ``slot``."""
        page0 = block * pages_per_step
        lo = jnp.clip(first_page - page0, 0, pages_per_step)
        hi = jnp.clip(end_page - page0, lo, pages_per_step)

        def copy(i, carry):
            page = table_at(page0 + i)
            at = pl.ds(i * page_rows, page_rows)
            action(pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, at], sems.at[0, slot]))
            action(pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, at], sems.at[1, slot]))
            return carry
        lax.fori_loop(lo, hi, copy, 0)

    def start_stats():
        if sinks_ref is not None:
            rows = lax.broadcasted_iota(jnp.int32, (plan.rows_pad, LANES), 0)
            for j in range(plan.num_kv_heads):
                m_scratch[j], l_scratch[j] = row_sinks(lambda h: sinks_ref[h], j, rows, plan)
        else:
            m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, F32)
            l_scratch[...] = jnp.zeros(l_scratch.shape, F32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, F32)

    def store_rows():
        for j in range(plan.num_kv_heads):
            out, _ = finish(m_scratch[j], l_scratch[j], acc_scratch[j], _lanes)
            o_ref[j] = out.astype(o_ref.dtype)

    @pl.when(t == 0)
    def _start():
        @pl.when(count > 0)
        def _first_copies():
            each_page(first_step, 0, lambda c: c.start())
        (init or start_stats)()

    @pl.when(t < count)
    def _step():
        slot = lax.rem(t, 2)
        block = first_step + t

        @pl.when(t + 1 < count)
        def _next_copies():
            each_page(block + 1, 1 - slot, lambda c: c.start())

        each_page(block, slot, lambda c: c.wait())
        key0 = block * keys
        # every V row of this step was copied from a page the tile reaches, below the end
        whole = (key0 >= first_page * page_size) & (key0 + keys <= end)

        def clean(v):
            v_keys = key0 + lax.broadcasted_iota(jnp.int32, v.shape, 0)
            real = (v_keys >= first_page * page_size) & (v_keys < end)
            return lax.cond(whole, lambda v: v, lambda v: jnp.where(real, v, 0).astype(v.dtype), v)
        compute(slot, block, clean)

    pl.when(t == pl.num_programs(1) - 1)(store or store_rows)


def _least_cost(plan: PagedPlan, batch: int, itemsize: int) -> pl.CostEstimate:
    """The kernel's least work for XLA's cost analysis: every slot of every table entry's page
    read once per sequence (lengths are runtime values: full tables count; layout "rows": d
    padded to whole lanes), two matmuls per
    (row, key) pair, q read and the output written once."""
    keys = batch * plan.max_len
    pairs = keys * plan.num_q_heads * plan.q_len
    kv = 2 * keys * plan.num_kv_heads * buffer_dim(plan) * itemsize
    rows = 2 * batch * plan.num_q_heads * plan.q_len * plan.head_dim * itemsize
    return pl.CostEstimate(flops=4 * plan.head_dim * pairs, transcendentals=pairs,
                           bytes_accessed=kv + rows + batch * plan.pages_per_sequence * 4)


def _call(plan: PagedPlan, pages_per_step: int, batch: int, dtype, vmem_limit: int):
    """The pallas_call over ``batch`` sequences: ``(lengths, table, [sinks], q_rows, k_pages,
    v_pages) -> out_rows``."""
    hk, rows_pad, d = plan.num_kv_heads, plan.rows_pad, plan.head_dim
    keys = pages_per_step * plan.page_size
    steps = -(-plan.pages_per_sequence // pages_per_step)
    rows_spec = pl.BlockSpec((None, hk, rows_pad, d), lambda b, t, *_: (b, 0, 0, 0))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    slot = (keys * hk, buffer_dim(plan)) if plan.layout == "rows" else (keys, hk, d)
    words = _words(plan, keys, dtype)
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, pages_per_step=pages_per_step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 + int(plan.sinks), grid=(batch, steps),
            in_specs=[rows_spec, anywhere, anywhere], out_specs=rows_spec,
            scratch_shapes=[pltpu.VMEM((2, *slot), dtype),
                            pltpu.VMEM((2, *slot), dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((hk, rows_pad, LANES), F32),
                            pltpu.VMEM((hk, rows_pad, LANES), F32),
                            pltpu.VMEM((hk, rows_pad, d), F32),
                            *([pltpu.VMEM(words, WORD)] * 2 if words else [])]),
        out_shape=jax.ShapeDtypeStruct((batch, hk, rows_pad, d), dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        cost_estimate=_least_cost(plan, batch, jnp.dtype(dtype).itemsize),
        interpret=plan.interpret,
    )
    return backend.compiled_call(("tpu",), call, plan.interpret)


def rows_view(pages: jax.Array, plan: PagedPlan) -> jax.Array:
    """A pool ``[num_pages, page_size, hk, d]`` as layout "rows" reads it: ``[num_pages,
    page_size * hk, buffer_dim]``. A free view in XLA where d is a multiple of 128 and the kv
    heads fill their sublane tiles (``flash.plan.rows_view_is_free``); a copy of the pool
    otherwise (d padded with zeros to whole lanes)."""
    d_pad = buffer_dim(plan)
    if d_pad != plan.head_dim:
        pages = jnp.pad(pages, ((0, 0),) * 3 + ((0, d_pad - plan.head_dim),))
    return pages.reshape(pages.shape[0], -1, d_pad)


def forward(q_rows, k_pages, v_pages, lengths, page_indices, sinks, plan: PagedPlan,
            pages_per_step: int, vmem_limit: int):
    """``out_rows [batch, hk, rows_pad, d]`` (the input dtype) from ``q_rows`` in the same
    layout (``plan.to_rows``), the pools ``[num_pages, page_size, hk, d]``, int32 ``lengths
    [batch]`` (clipped), int32 ``page_indices [batch, pages_per_sequence]`` and fp32 ``sinks
    [hq]`` (``plan.sinks``). Batches whose table exceeds ``TABLE_BYTES`` run in slices."""
    batch = q_rows.shape[0]
    if plan.layout == "rows":
        k_pages, v_pages = (rows_view(x, plan) for x in (k_pages, v_pages))
    chunk = max(1, min(batch, TABLE_BYTES // (4 * plan.pages_per_sequence)))
    outs = []
    for lo in range(0, batch, chunk):
        hi = min(batch, lo + chunk)
        prefetch = (lengths[lo:hi], page_indices[lo:hi].reshape(-1))
        if plan.sinks:
            prefetch += (sinks,)
        call = _call(plan, pages_per_step, hi - lo, q_rows.dtype, vmem_limit)
        outs.append(call(*prefetch, q_rows[lo:hi], k_pages, v_pages))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
