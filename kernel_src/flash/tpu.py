"""Flash attention for TPU (Mosaic): forward, dQ and dK/dV kernels, side by side.

Layout. The contract layout ``[batch, seq, heads, head_dim]`` is viewed, by a free reshape, as
``[batch, seq, heads * head_dim]``: one head's tile is the ``(block, head_dim)`` window at column
block ``head``, so no transpose is needed, and grouped-query attention is the kv column block
``head // group`` in a ``BlockSpec`` index map: K and V are read in place, never repeated.

Grids carry the accumulators across their last ("arbitrary") axes in VMEM scratch. Running
row statistics (max, sum) are fp32 and lane-replicated ``[rows, 128]`` in VMEM; the log-sum-exp
and ``di`` that go through HBM are lane-dense fp32 ``[batch, heads, 1, q_pad]`` (one float per
row). The dK/dV kernel computes the transposed scores ``K·Qᵀ`` directly, so those rows broadcast
along its lanes and neither ``P`` nor ``dS`` is ever transposed.
A skipped grid step computes nothing (``pl.when``) and its index maps repeat the block of a
computing step, so the pipeline issues no new DMA for it (the trick of JAX's flash and splash
kernels). ``kv_lengths`` arrive by scalar prefetch (SMEM) for the index maps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.flash.plan import (F32, LANES, TRANS_B, Plan, finish, first_query_block,
                                   key_in_range, num_key_blocks, online_softmax_step,
                                   score_grads, scores, visible_tile)


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


def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, *refs, plan: Plan,
                    num_k_blocks: int, with_lse: bool):
    """Forward of one (batch, q head, query block, key block) grid step.

    lengths_ref: int32 ``[batch]`` key lengths (SMEM). q_ref: ``[block_q, head_dim]``; k_ref,
    v_ref: ``[block_k, head_dim]`` of kv head ``q head // group``. o_ref: ``[block_q, head_dim]``
    in the input dtype; then, ``with_lse`` only, lse_ref: fp32 ``[1, block_q]`` log-sum-exp. Scratch: fp32 running max and sum ``[block_q, 128]``, accumulator
    ``[block_q, head_dim]``.
    """
    lse_ref, (m_scratch, l_scratch, acc_scratch) = (refs[0], refs[1:]) if with_lse else (None, refs)
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when(ki == 0)
    def _start():
        m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, F32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, F32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, F32)

    @pl.when(ki < num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        mask = visible_tile(qi, ki, block_q, block_k, length, plan)
        s = scores(q_ref[...], k_ref[...], mask, plan.scale)
        m, l, acc = online_softmax_step(s, v_ref[...], m_scratch[...], l_scratch[...],
                                         acc_scratch[...], _lanes)
        m_scratch[...], l_scratch[...], acc_scratch[...] = m, l, acc

    @pl.when(ki == num_k_blocks - 1)
    def _store():
        out, lse = finish(m_scratch[...], l_scratch[...], acc_scratch[...], _lanes)
        o_ref[...] = out.astype(o_ref.dtype)
        if with_lse:
            lse_ref[...] = _row(lse)


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref,
               dq_scratch, lse_scratch, di_scratch, *, plan: Plan, num_k_blocks: int):
    """dQ of one (batch, q head, query block, key block) grid step.

    q_ref, do_ref: ``[block_q, head_dim]``; k_ref, v_ref: ``[block_k, head_dim]``; lse_ref,
    di_ref: fp32 ``[1, block_q]``, turned once per query block into lane-replicated
    ``[block_q, 128]`` scratch. dq_ref: ``[block_q, head_dim]`` in the input dtype, accumulated
    over key blocks in fp32 ``dq_scratch``.
    """
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when(ki == 0)
    def _start():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, F32)
        lse_scratch[...] = _column(lse_ref[...])
        di_scratch[...] = _column(di_ref[...])

    @pl.when(ki < num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        k = k_ref[...]
        mask = visible_tile(qi, ki, block_q, block_k, length, plan)
        _, ds = score_grads(q_ref[...], k, v_ref[...], do_ref[...], lse_scratch[...],
                            di_scratch[...], mask, plan.scale, _lanes)
        dq_scratch[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

    @pl.when(ki == num_k_blocks - 1)
    def _store():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                       dk_scratch, dv_scratch, *, plan: Plan, num_q_blocks: int):
    """dK and dV of one (batch, kv head, key block, head in group, query block) grid step.

    The query heads of a kv head's group are the second-to-last grid axis, so their
    contributions add up in the fp32 scratch: K and V are never repeated. q_ref, do_ref:
    ``[block_q, head_dim]`` of q head ``kv head * group + g``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, head_dim]``; lse_ref, di_ref: fp32 ``[1, block_q]``. Scores are computed
    transposed, ``[block_k, block_q]``, so ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q`` are plain matmuls.
    """
    b, ki, g, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when((g == 0) & (qi == 0))
    def _start():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, F32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, F32)

    @pl.when(ki < num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        q, do = q_ref[...], do_ref[...]
        mask_t = visible_tile(qi, ki, block_q, block_k, length, plan, transposed=True)
        s_t = lax.dot_general(k_ref[...], q, TRANS_B, preferred_element_type=F32) * plan.scale
        p_t = jnp.where(mask_t, jnp.exp(s_t - lse_ref[...]), 0.0)  # [block_k, block_q]
        dp_t = lax.dot_general(v_ref[...], do, TRANS_B, preferred_element_type=F32)
        ds_t = p_t * (dp_t - di_ref[...]) * plan.scale
        dv_scratch[...] += lax.dot(p_t.astype(do.dtype), do, preferred_element_type=F32)
        dk_scratch[...] += lax.dot(ds_t.astype(q.dtype), q, preferred_element_type=F32)

    @pl.when((g == plan.group - 1) & (qi == num_q_blocks - 1))
    def _store():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _visible_pairs(plan: Plan) -> int:
    """(query, key) pairs one query head of one sequence may see, every key valid."""
    if not plan.causal:
        return plan.q_len * plan.kv_len
    offset = plan.kv_len - plan.q_len  # bottom-right: row i sees keys j <= i + offset
    return sum(min(plan.kv_len, max(0, i + offset + 1)) for i in range(plan.q_len))


def _least_cost(plan: Plan, matmuls: int, head_dim: int, arrays, out_shape) -> pl.CostEstimate:
    """A kernel's least work, declared so XLA's cost analysis counts it (else it counts nothing).

    FLOPs: ``matmuls`` products of width ``head_dim`` over the visible pairs of every query head
    (causal counts about half; ``kv_lengths`` are runtime values, so every key counts), one
    ``exp`` per pair, and every operand read once and every result written once (bytes).
    """
    batch = arrays[0].shape[0]
    pairs = batch * plan.num_q_heads * _visible_pairs(plan)
    nbytes = sum(x.size * x.dtype.itemsize for x in (*arrays, *jax.tree.leaves(out_shape)))
    return pl.CostEstimate(flops=2 * matmuls * head_dim * pairs, transcendentals=pairs,
                           bytes_accessed=nbytes)


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, plan: Plan, semantics,
          matmuls: int):
    """The pallas_call of ``kernel``, declaring ``matmuls`` products per visible pair."""

    def call(lengths, *arrays):
        d = arrays[0].shape[2] // plan.num_q_heads
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM(shape, F32) for shape in scratch]),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            cost_estimate=_least_cost(plan, matmuls, d, (lengths, *arrays), out_shape),
            interpret=plan.interpret,
        )(lengths, *arrays)
    return backend.compiled_call(("tpu",), call, plan.interpret)


def query_side_maps(plan: Plan, block_q: int, block_k: int):
    """Index maps of the (batch, q head, qi, ki) grids: query tiles, and K/V tiles clamped so a
    skipped key block re-uses the last needed one (no DMA)."""

    def q_map(b, h, qi, ki, lengths):
        return b, qi, h

    def kv_map(b, h, qi, ki, lengths):
        n = num_key_blocks(qi, lengths[b], block_q, block_k, plan)
        return b, jnp.minimum(ki, jnp.maximum(n - 1, 0)), lax.div(h, plan.group)

    return q_map, kv_map


def key_side_maps(plan: Plan, block_q: int, block_k: int, num_q_blocks: int):
    """Index maps of the dK/dV grid (batch, kv head, ki, g, qi): K/V tiles, and query-side tiles
    where a skipped step fetches the tile the next needed step uses (no extra DMA)."""

    def q_map(b, h, ki, g, qi, lengths):
        length = lengths[b]
        in_range = key_in_range(ki, length, block_k)
        first = first_query_block(ki, block_q, block_k, num_q_blocks, plan)
        qi = jnp.where(in_range, jnp.maximum(qi, first), num_q_blocks - 1)
        g = jnp.where(in_range, g, plan.group - 1)
        return b, qi, h * plan.group + g

    def kv_map(b, h, ki, g, qi, lengths):
        return b, ki, h

    return q_map, kv_map


def _stat_spec(q_map, block_q: int) -> pl.BlockSpec:
    """Lane-dense row statistics ``[batch, heads, 1, q_pad]`` at the tile ``q_map`` reads."""

    def stat_map(*indices):
        b, qi, h = q_map(*indices)
        return b, h, 0, qi
    return pl.BlockSpec((None, None, 1, block_q), stat_map)


def forward(q, k, v, lengths, plan: Plan, with_lse: bool = True):
    """``(out [b, q_pad, hq*d], lse [b, hq, 1, q_pad] fp32)`` from ``[b, seq_pad, heads*d]``.

    ``with_lse=False`` (a forward-only call) writes no log-sum-exp: lse is ``None``.
    """
    batch, q_pad, _ = q.shape
    kv_pad = k.shape[1]
    d = q.shape[2] // plan.num_q_heads
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    grid = (batch, plan.num_q_heads, q_pad // bq, kv_pad // bk)
    q_map, kv_map = query_side_maps(plan, bq, bk)
    kernel = functools.partial(_forward_kernel, plan=plan, num_k_blocks=grid[3],
                               with_lse=with_lse)
    out_specs = [pl.BlockSpec((None, bq, d), q_map), _stat_spec(q_map, bq)]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, plan.num_q_heads, 1, q_pad), F32)]
    results = _call(
        kernel, grid,
        in_specs=[pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bk, d), kv_map),
                  pl.BlockSpec((None, bk, d), kv_map)],
        out_specs=out_specs[:1 + with_lse], out_shape=out_shape[:1 + with_lse],
        scratch=[(bq, LANES), (bq, LANES), (bq, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=2,
    )(lengths, q, k, v)
    return (results[0], results[1] if with_lse else None)


def _backward_kernels(q, k, v, lengths, lse, di, do, plan: Plan):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v``; lse and di fp32 ``[b, hq, 1, q_pad]``."""
    batch, q_pad, _ = q.shape
    kv_pad = k.shape[1]
    d = q.shape[2] // plan.num_q_heads
    blocks = plan.blocks

    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    grid = (batch, plan.num_q_heads, q_pad // bq, kv_pad // bk)
    q_map, kv_map = query_side_maps(plan, bq, bk)
    q_spec, stat_spec = pl.BlockSpec((None, bq, d), q_map), _stat_spec(q_map, bq)
    kv_spec = pl.BlockSpec((None, bk, d), kv_map)
    dq = _call(
        functools.partial(_dq_kernel, plan=plan, num_k_blocks=grid[3]), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec], out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=[(bq, d), (bq, LANES), (bq, LANES)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=3,
    )(lengths, q, k, v, do, lse, di)

    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    num_q_blocks = q_pad // bq
    grid = (batch, plan.num_kv_heads, kv_pad // bk, plan.group, num_q_blocks)
    q_map, kv_map = key_side_maps(plan, bq, bk, num_q_blocks)
    q_spec, stat_spec = pl.BlockSpec((None, bq, d), q_map), _stat_spec(q_map, bq)
    kv_spec = pl.BlockSpec((None, bk, d), kv_map)
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan, num_q_blocks=num_q_blocks), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[(bk, d), (bk, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), matmuls=4,
    )(lengths, q, k, v, do, lse, di)
    return dq, dk, dv



def backward(q, k, v, lengths, out, lse, do, plan: Plan):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v`` from the forward's ``out`` and ``lse``.

    ``di = rowsum(dO ⊙ O)`` per (row, head), fp32, lane-dense like ``lse``: one XLA reduction.
    """
    batch, q_pad, _ = q.shape
    di = jnp.sum(out.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1)
                 * do.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1), axis=-1)
    di = di.transpose(0, 2, 1).reshape(lse.shape)  # [b, q_pad, hq] -> [b, hq, 1, q_pad]
    return _backward_kernels(q, k, v, lengths, lse, di, do, plan)
