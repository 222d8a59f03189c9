"""Flash attention for TPU (Mosaic): the forward kernel and the grids, specs and calls it shares
with the dQ and dK/dV kernels (``kernel_src.flash.tpu_backward``).

Layout. The kernels read and write the contract layout ``[batch, seq, heads, head_dim]`` as it
is: a block is ``(rows, heads of the step, head_dim)``, its last two dims the heads and
``head_dim`` that XLA's tiled TPU layout keeps together, so no relayout copy runs around a
kernel (a reshape to ``[batch, seq, heads * head_dim]`` would be one on TPU). A grid step holds
``plan.kv_head_block`` kv heads (all of them, or a multiple of 8) with their whole groups of
query heads and walks them in a static loop: each K/V tile is fetched once for its group.
Compiled under jax < 0.7 they read the same bytes as ``[batch, seq * heads, head_dim]``
(layout "rows", every head in each step; see ``heads.Heads``), or, where that view is not free,
the flat view (``plan.Layout``).

Grids carry the accumulators across their last ("arbitrary") axes in VMEM scratch, one slot per
head. Running row statistics (max, sum) are fp32 and lane-replicated ``[rows, 128]`` in VMEM; the
log-sum-exp and ``di`` that go through HBM are lane-dense fp32 ``[batch, heads, 1, q_pad]`` (one
float per row). The dQ kernel computes ``di = rowsum(dO ⊙ O)`` itself (reading ``O`` once per
query block) and writes it for the dK/dV kernel, which computes the transposed scores ``K·Qᵀ``
directly, so those rows broadcast along its lanes and neither ``P`` nor ``dS`` is transposed.
The last grid axis walks only the blocks an outer block needs (``Walk``): a range of them,
starting where a window starts, whose static length is the widest such range, or with segment
ids a scalar-prefetched table of the blocks whose id ranges overlap. A step past what its outer
block needs computes nothing (``pl.when``) and its index maps repeat the block of the last
computing step, so the pipeline issues no new DMA for it (the trick of JAX's flash and splash
kernels); a tile no mask cuts (``whole_tile``) skips the iota compares and ``where``s.
``kv_lengths`` (and the tables, and the sinks) arrive by scalar prefetch (SMEM).

Features: the window and segment ids are in the tiles' masks (segment ids as int32 blocks, the
outer side's lane-replicated ``[rows, 128]``, the inner side's a ``[1, rows]`` row, as in JAX's
splash attention), the soft-cap in the logits (``plan.logits``) and its slope in ``dS``; each
query head's sink starts its rows' running max and sum (``plan.initial_stats``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.flash.block_skipping import (block_table, key_block_range, max_key_steps,
                                             max_query_steps, needed_blocks, query_block_range,
                                             range_block, range_steps, segment_bounds,
                                             visible_tile, whole_tile)
from kernel_src.flash.heads import WORD, Heads, needs_words
from kernel_src.flash.plan import (F32, LANES, Plan, finish, initial_stats, online_softmax_step,
                                   scores, vmem_limits)

def _lanes(x: jax.Array, width: int) -> jax.Array:
    """Lane-replicated row statistics ``[rows, 128]`` as ``[rows, width]``."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    if width % LANES == 0:
        if hasattr(pltpu, "repeat"):  # jax <= 0.6: the Mosaic lane-tiling op
            return pltpu.repeat(x, width // LANES, axis=1)
        return jnp.tile(x, (1, width // LANES))
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _row(x: jax.Array) -> jax.Array:
    """Lane-replicated statistics ``[rows, 128]`` as one lane-dense row ``[1, rows]``."""
    return x.T[:1, :]


def _column(x: jax.Array) -> jax.Array:
    """A lane-dense row ``[1, rows]`` as lane-replicated statistics ``[rows, 128]``."""
    return jnp.broadcast_to(x, (LANES, x.shape[1])).T


def _cut(x: jax.Array, whole, visible: Callable[[], jax.Array], fill: float) -> jax.Array:
    """``x`` with ``fill`` where the tile's mask (``visible()``) is false; a tile no mask cuts
    (``whole``) skips the iota compares and the ``where``. Only this small step is branched, so
    the tile maths is compiled once. ``whole`` False (segment ids): always cut."""
    if whole is False:
        return jnp.where(visible(), x, fill)
    return lax.cond(whole, lambda x: x, lambda x: jnp.where(visible(), x, fill), x)


def _each_head(heads, length, body) -> None:
    """``body(h)`` for each static ``h``, each in its own region: a ``pl.when`` on ``length >= 0``
    (always true: lengths are clipped to ``[0, kv_len]``). Mosaic then schedules one head's tile
    maths at a time, which halves its compile time and the VMEM its temporaries take, against
    one basic block holding every head of the step."""
    for h in heads:
        pl.when(length >= 0)(functools.partial(body, h))


def _split_words(refs, count: int):
    """``(other refs, word scratches)``: the last ``count`` refs are the 32-bit copies."""
    return (refs[:len(refs) - count], refs[len(refs) - count:]) if count else (refs, ())


# The most bytes of SMEM a block table and its counts may take (SMEM holds 1 MiB on TPUs up to
# v6e, shared with the other scalar-prefetched arrays); past it the walk keeps its ranges and
# passes over id-disjoint blocks without the table (no compute, but their DMA).
TABLE_BYTES = 256 * 2 ** 10


class Walk:
    """How the last grid axis of a kernel walks the inner blocks one outer block needs.

    Forward and dQ (``by_key=False``): the outer block is a query block, the walk its key range
    (``block_skipping.key_block_range``); dK/dV: a key block walking its query range. Step ``s``
    reads block ``lo + s``; the steps past the range repeat its last block (so no new DMA is
    issued) and compute nothing. ``steps``, the grid's length, is the widest range: with a window
    about ``(window + outer block) / inner block``, not every inner block.

    With segment ids the id ranges of the query and key blocks are scalar-prefetched
    (``block_skipping.segment_bounds``): a tile whose two blocks hold one and the same id is whole,
    and the blocks come from a table (``block_skipping.block_table``, flat): each outer block's
    needed blocks (in its range, the id ranges of the two blocks overlapping), in order, then the
    last again, so an id-disjoint block is neither computed nor fetched. Where the table would
    take more than ``TABLE_BYTES`` of SMEM the walk keeps its range and computes no step whose
    blocks' id ranges are disjoint (their DMA still runs).

    Scalar prefetch: ``lengths``; with segment ids the bounds ``q_lo, q_hi, k_lo, k_hi``; with a
    table the table and the counts.
    """

    def __init__(self, plan: Plan, block_q: int, block_k: int, num_q_blocks: int,
                 num_k_blocks: int, by_key: bool, batch: int = 1):
        self.plan, self.block_q, self.block_k, self.by_key = plan, block_q, block_k, by_key
        self.num_q_blocks, self.num_k_blocks = num_q_blocks, num_k_blocks
        self.num_outer, self.num_inner = ((num_k_blocks, num_q_blocks) if by_key
                                          else (num_q_blocks, num_k_blocks))
        widest = max_query_steps if by_key else max_key_steps
        self.steps = widest(block_q, block_k, num_q_blocks, num_k_blocks, plan)
        self.segments = plan.segments
        self.table = plan.segments and batch * self.num_outer * (self.steps + 1) * 4 <= TABLE_BYTES
        self.num_prefetch = 1 + 4 * self.segments + 2 * self.table

    def arrays(self, lengths, ids) -> tuple:
        """The scalar-prefetch arrays (``ids``: the padded ``[batch, q_pad]``, ``[batch, kv_pad]``
        segment ids, or None)."""
        if not self.segments:
            return (lengths,)
        bounds = segment_bounds(*ids, self.block_q, self.block_k, self.plan)
        flat = tuple(bound.reshape(-1) for bound in bounds)
        if not self.table:
            return (lengths, *flat)
        needed = needed_blocks(lengths, *ids, self.block_q, self.block_k, self.plan, self.by_key,
                               bounds)
        table, count = block_table(needed, self.steps)
        return (lengths, *flat, table.reshape(-1), count.reshape(-1))

    def _range(self, outer, length):
        find = query_block_range if self.by_key else key_block_range
        return find(outer, length, self.block_q, self.block_k, self.plan)

    def _bounds(self, b, qi, ki, pre):
        """The id ranges ``(q_lo, q_hi, k_lo, k_hi)`` of query block ``qi`` and key block ``ki``."""
        return (pre[1][b * self.num_q_blocks + qi], pre[2][b * self.num_q_blocks + qi],
                pre[3][b * self.num_k_blocks + ki], pre[4][b * self.num_k_blocks + ki])

    def block(self, b, outer, step, pre):
        """The inner block step ``step`` of outer block ``outer`` reads (``pre``: the prefetched
        refs, lengths first)."""
        if self.table:
            return pre[5][(b * self.num_outer + outer) * self.steps + step]
        lo, hi = self._range(outer, pre[0][b])
        return range_block(lo, hi, step, self.num_inner)

    def computes(self, b, outer, step, pre):
        """Whether step ``step`` of outer block ``outer`` computes."""
        if self.table:
            return step < pre[6][b * self.num_outer + outer]
        running = step < range_steps(*self._range(outer, pre[0][b]))
        if not self.segments:
            return running
        inner = self.block(b, outer, step, pre)
        qi, ki = (inner, outer) if self.by_key else (outer, inner)
        q_lo, q_hi, k_lo, k_hi = self._bounds(b, qi, ki, pre)
        return running & (q_lo <= k_hi) & (k_lo <= q_hi)

    def whole(self, b, qi, ki, pre):
        """``block_skipping.whole_tile`` of the tile (query block ``qi``, key block ``ki``): with
        segment ids only where both blocks hold one and the same id."""
        same = None
        if self.segments:
            q_lo, q_hi, k_lo, k_hi = self._bounds(b, qi, ki, pre)
            same = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        return whole_tile(qi, ki, self.block_q, self.block_k, pre[0][b], self.plan, same)


def _split(refs, *counts):
    """``refs`` cut into consecutive groups of ``counts``, then the rest."""
    out, at = [], 0
    for n in counts:
        out.append(refs[at:at + n])
        at += n
    return (*out, refs[at:])


def _ids_tile(ids, transposed: bool, block_q: int, block_k: int):
    """``(q_ids, kv_ids)`` broadcasting against a tile from the id refs ``(q-side, kv-side)``:
    the outer side's lane-replicated ``[rows, 128]`` widened to the tile, the inner side's
    ``[1, rows]`` row. None without segment ids."""
    if not ids:
        return None, None
    q_ref, kv_ref = ids
    if transposed:  # [block_k, block_q]: keys down the sublanes
        return q_ref[...], _lanes(kv_ref[...], block_q)
    return _lanes(q_ref[...], block_k), kv_ref[...]


def _forward_kernel(*refs, plan: Plan, walk: Walk, with_lse: bool):
    """Forward of one (batch, kv-head block, query block, key step) grid step.

    Scalar prefetch (SMEM): ``walk``'s (int32 ``[batch]`` key lengths first), then, with sinks,
    fp32 ``[q heads]``. q_ref, o_ref: ``[block_q, q heads, d]`` (o in the input dtype); k_ref,
    v_ref: ``[block_k, kv heads, d]`` (other layouts: ``heads.Heads``); with segment ids int32
    ``[block_q, 128]`` (lane-replicated) and ``[1, block_k]``; then, ``with_lse`` only, lse_ref:
    fp32 ``[q heads, 1, block_q]``. Scratch per query head: fp32 running max and sum
    ``[q heads, block_q, 128]``, accumulator ``[q heads, block_q, d]``; then the 32-bit copies
    of q, k, v (layout "rows", 16 bits).
    """
    pre, sinks, (q_ref, k_ref, v_ref), ids, (o_ref,), refs = _split(
        refs, walk.num_prefetch, int(plan.sinks), 3, 2 * plan.segments, 1)
    refs, words = _split_words(refs, 3 * needs_words(plan, q_ref.dtype))
    lse_ref, (m_scratch, l_scratch, acc_scratch) = (refs[0], refs[1:]) if with_lse else (None, refs)
    q, k, v = (Heads(ref, n, plan, w) for ref, n, w in zip(
        (q_ref, k_ref, v_ref), (plan.q_head_block, plan.kv_head_block, plan.kv_head_block),
        words or (None,) * 3))
    b, j, qi, step = (pl.program_id(i) for i in range(4))
    block_q, block_k = q.rows, k.rows
    length = pre[0][b]
    ki = walk.block(b, qi, step, pre)

    @pl.when(step == 0)
    def _start():
        if sinks:
            for h in range(plan.q_head_block):
                sink = sinks[0][j * plan.q_head_block + h]
                m_scratch[h], l_scratch[h] = initial_stats(sink, m_scratch.shape[1:])
        else:
            m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, F32)
            l_scratch[...] = jnp.zeros(l_scratch.shape, F32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, F32)
        q.copy_words()

    @pl.when(walk.computes(b, qi, step, pre))
    def _step():
        whole = walk.whole(b, qi, ki, pre)
        k.copy_words()
        v.copy_words()

        def mask():
            q_ids, kv_ids = _ids_tile(ids, False, block_q, block_k)
            return visible_tile(qi, ki, block_q, block_k, length, plan, q_ids=q_ids, kv_ids=kv_ids)

        def head(h: int):
            j = h // plan.group  # its kv head in the block
            s = _cut(scores(q.load(h), k.load(j), None, plan), whole, mask, -jnp.inf)
            m, l, acc = online_softmax_step(s, v.load(j), m_scratch[h], l_scratch[h],
                                            acc_scratch[h], _lanes)
            m_scratch[h], l_scratch[h], acc_scratch[h] = m, l, acc
        _each_head(range(plan.q_head_block), length, head)

    @pl.when(step == walk.steps - 1)
    def _store():
        def out_of(h: int) -> jax.Array:  # writes head h's log-sum-exp on the way
            out, lse = finish(m_scratch[h], l_scratch[h], acc_scratch[h], _lanes)
            if with_lse:
                lse_ref[h] = _row(lse)
            return out
        Heads(o_ref, plan.q_head_block, plan, q.words).store(out_of)


def _visible_pairs(plan: Plan) -> int:
    """(query, key) pairs one query head of one sequence may see, every key valid (segment ids,
    runtime values, hide none here)."""
    left, right = plan.reach
    if left is None and right is None:
        return plan.q_len * plan.kv_len
    pairs = 0
    for i in range(plan.q_len):  # bottom-right: row i at position i + offset
        p = i + plan.offset
        lo = 0 if left is None else max(0, p - left)
        hi = plan.kv_len - 1 if right is None else min(plan.kv_len - 1, p + right)
        pairs += max(0, hi - lo + 1)
    return pairs


def _least_cost(plan: Plan, matmuls: int, head_dim: int, arrays, out_shape) -> pl.CostEstimate:
    """A kernel's least work, declared so XLA's cost analysis counts it (else it counts nothing).

    FLOPs: ``matmuls`` products of width ``head_dim`` over the visible pairs of every query head
    (causal counts about half, a window its width; ``kv_lengths`` are runtime values, so every
    key counts), one ``exp`` per pair, and every operand read once and every result written once
    (bytes).
    """
    batch = arrays[0].shape[0]
    pairs = batch * plan.num_q_heads * _visible_pairs(plan)
    nbytes = sum(x.size * x.dtype.itemsize for x in (*arrays, *jax.tree.leaves(out_shape)))
    return pl.CostEstimate(flops=2 * matmuls * head_dim * pairs, transcendentals=pairs,
                           bytes_accessed=nbytes)


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, plan: Plan, semantics,
          matmuls: int, words=(), num_prefetch: int = 1):
    """The pallas_call of ``kernel``, declaring ``matmuls`` products per visible pair; fp32
    ``scratch`` shapes, then 32-bit ``words`` shapes (``heads.needs_words``). Its first
    ``num_prefetch`` arguments (the key lengths first) are scalar-prefetched; the next is q."""

    def call(*args):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=num_prefetch, grid=grid, in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=[*(pltpu.VMEM(shape, F32) for shape in scratch),
                                *(pltpu.VMEM(shape, WORD) for shape in words)]),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                 vmem_limit_bytes=vmem_limits()[0]),
            cost_estimate=_least_cost(plan, matmuls, _head_dim(args[num_prefetch], plan), args,
                                      out_shape),
            interpret=plan.interpret,
        )(*args)
    return backend.compiled_call(("tpu",), call, plan.interpret)


def query_side_maps(walk: Walk):
    """Index maps of the (batch, kv-head block, qi, key step) grids: query-side tiles (the
    kv-head block's query heads), and K/V tiles of the walk's key blocks (a step past the range
    re-uses the last needed one: no DMA). Each takes the scalar-prefetch refs after the grid
    indices."""

    def q_map(b, j, qi, step, *pre):
        return b, qi, j, 0

    def kv_map(b, j, qi, step, *pre):
        return b, walk.block(b, qi, step, pre), j, 0

    return q_map, kv_map


def key_side_maps(walk: Walk):
    """Index maps of the dK/dV grid (batch, kv-head block, ki, query step): K/V tiles, and
    query-side tiles of the walk's query blocks (a step past the range re-uses the last one)."""

    def q_map(b, j, ki, step, *pre):
        return b, walk.block(b, ki, step, pre), j, 0

    def kv_map(b, j, ki, step, *pre):
        return b, ki, j, 0

    return q_map, kv_map


def _head_dim(x: jax.Array, plan: Plan) -> int:
    return {"heads": x.shape[-1], "rows": x.shape[-1], "flat": plan.flat_head_dim}[plan.layout]


def _seq_len(x: jax.Array, heads: int, plan: Plan) -> int:
    """Sequence rows of an array in the plan's layout (``rows``: ``seq * heads`` of them)."""
    return x.shape[1] // (heads if plan.layout == "rows" else 1)


def _words(plan: Plan, dtype, block_q: int, block_k: int, d: int, q_side: int, kv_side: int):
    """Shapes of the 32-bit copies of ``q_side`` query-side and ``kv_side`` K/V-side blocks."""
    if not needs_words(plan, dtype):
        return []
    q_rows, kv_rows = block_q * plan.q_head_block // 2, block_k * plan.kv_head_block // 2
    return [(q_rows, d)] * q_side + [(kv_rows, d)] * kv_side


def _specs(plan: Plan, q_map, kv_map, block_q: int, block_k: int, head_dim: int):
    """BlockSpecs of the query-side tiles ``(block_q, q heads, d)``, K/V-side tiles
    ``(block_k, kv heads, d)`` (layout "flat": ``(rows, heads * d)``, "rows":
    ``(rows * heads, d)``) and lane-dense statistics ``(q heads, 1, block_q)`` of a step."""
    q_heads, kv_heads = plan.q_head_block, plan.kv_head_block

    def stat_map(*indices):
        b, qi, j, _ = q_map(*indices)
        return b, j, 0, qi
    stat = pl.BlockSpec((None, q_heads, 1, block_q), stat_map)
    if plan.layout == "heads":
        return (pl.BlockSpec((None, block_q, q_heads, head_dim), q_map),
                pl.BlockSpec((None, block_k, kv_heads, head_dim), kv_map), stat)

    def flat(index_map):  # (b, row block, head block): "rows" has one head block, all heads
        return lambda *indices: index_map(*indices)[:3]
    if plan.layout == "rows":
        return (pl.BlockSpec((None, block_q * q_heads, head_dim), flat(q_map)),
                pl.BlockSpec((None, block_k * kv_heads, head_dim), flat(kv_map)), stat)
    return (pl.BlockSpec((None, block_q, q_heads * head_dim), flat(q_map)),
            pl.BlockSpec((None, block_k, kv_heads * head_dim), flat(kv_map)), stat)


def _id_inputs(plan: Plan, ids, q_map, kv_map, block_q: int, block_k: int, by_key: bool):
    """``(specs, arrays)`` of the segment ids a kernel reads (none without them): the outer
    side's ids lane-replicated ``[batch, pad, 128]`` (blocks ``(rows, 128)``), the inner side's
    as rows ``[batch, 1, pad]`` (blocks ``(1, rows)``); query side first."""
    if not plan.segments:
        return [], []
    q_ids, kv_ids = ids

    def lanes(x):
        return jnp.broadcast_to(x[:, :, None], (*x.shape, LANES))

    q_block = lambda *i: (q_map(*i)[0], q_map(*i)[1], 0)  # noqa: E731  (b, qi, 0)
    kv_block = lambda *i: (kv_map(*i)[0], kv_map(*i)[1], 0)  # noqa: E731  (b, ki, 0)
    as_row = lambda index_map: lambda *i: (index_map(*i)[0], 0, index_map(*i)[1])  # noqa: E731
    if by_key:
        return ([pl.BlockSpec((None, 1, block_q), as_row(q_block)),
                 pl.BlockSpec((None, block_k, LANES), kv_block)],
                [q_ids[:, None, :], lanes(kv_ids)])
    return ([pl.BlockSpec((None, block_q, LANES), q_block),
             pl.BlockSpec((None, 1, block_k), as_row(kv_block))],
            [lanes(q_ids), kv_ids[:, None, :]])


def forward(q, k, v, lengths, plan: Plan, ids=None, sinks=None, with_lse: bool = True):
    """``(out [b, q_pad, hq, d], lse [b, hq, 1, q_pad] fp32)`` from ``[b, seq_pad, heads, d]``
    (layout "flat": ``[b, seq_pad, heads * d]`` in and out; "rows": ``[b, seq_pad * heads, d]``).

    ``ids``: padded segment ids ``([b, q_pad], [b, kv_pad])`` int32 (``plan.segments``);
    ``sinks``: fp32 ``[hq]`` (``plan.sinks``). ``with_lse=False`` (a forward-only call) writes no
    log-sum-exp: lse is ``None``.
    """
    batch, d = q.shape[0], _head_dim(q, plan)
    q_pad, kv_pad = _seq_len(q, plan.num_q_heads, plan), _seq_len(k, plan.num_kv_heads, plan)
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    q_heads = plan.kv_head_block * plan.group
    walk = Walk(plan, bq, bk, q_pad // bq, kv_pad // bk, by_key=False, batch=batch)
    grid = (batch, plan.num_kv_heads // plan.kv_head_block, q_pad // bq, walk.steps)
    q_map, kv_map = query_side_maps(walk)
    q_spec, kv_spec, stat_spec = _specs(plan, q_map, kv_map, bq, bk, d)
    id_specs, id_arrays = _id_inputs(plan, ids, q_map, kv_map, bq, bk, by_key=False)
    prefetch = (*walk.arrays(lengths, ids), *((sinks.astype(F32),) if plan.sinks else ()))
    kernel = functools.partial(_forward_kernel, plan=plan, walk=walk, with_lse=with_lse)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, plan.num_q_heads, 1, q_pad), F32)]
    results = _call(
        kernel, grid, in_specs=[q_spec, kv_spec, kv_spec, *id_specs],
        out_specs=[q_spec, stat_spec][:1 + with_lse], out_shape=out_shape[:1 + with_lse],
        scratch=[(q_heads, bq, LANES), (q_heads, bq, LANES), (q_heads, bq, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=2,
        words=_words(plan, q.dtype, bq, bk, d, 1, 2), num_prefetch=len(prefetch),
    )(*prefetch, q, k, v, *id_arrays)
    return (results[0], results[1] if with_lse else None)
