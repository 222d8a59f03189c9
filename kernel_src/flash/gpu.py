"""Flash attention for GPU (Triton): forward, dQ and dK/dV kernels, side by side.

Triton programs run in parallel and cannot carry state across grid steps, so each program owns
one output tile and loops over the other sequence inside the kernel (``lax.fori_loop``), with
power-of-two tiles. Views ``[batch, seq, heads, head_dim]`` (dK/dV: ``[batch, seq, kv_heads,
group, head_dim]``); row statistics fp32 ``[batch, kv_heads, group, q_pad]``. Lowered to Triton
IR by the tests; never compiled or run on a GPU from this repository.

Each loop runs over the block range its program needs (``block_skipping.key_block_range``,
``block_skipping.query_block_range``: a window's blocks, not every block), so a skipped block is
never loaded. With segment ids each program also reads its row of the needed-block table
(``block_skipping.needed_blocks``: the blocks' id ranges overlap) and a block whose entry is 0 is
passed over (``lax.cond``) before it is loaded; the tile's mask compares the ids themselves. A query
head's sink starts its rows' running max and sum (``plan.initial_stats``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernel_src import backend
from kernel_src.flash.block_skipping import (key_block_range, needed_blocks, query_block_range,
                                             visible_tile)
from kernel_src.flash.plan import (F32, Plan, finish, initial_stats, next_power_of_two,
                                   online_softmax_step, score_grads, scores)


def _columns(x: jax.Array, width: int) -> jax.Array:
    """Row statistics ``[rows, 1]`` broadcast to ``[rows, width]``."""
    return jnp.broadcast_to(x, (x.shape[0], width))


def _split(refs, *counts):
    """``refs`` cut into consecutive groups of ``counts``, then the rest."""
    out, at = [], 0
    for n in counts:
        out.append(refs[at:at + n])
        at += n
    return (*out, refs[at:])


def _walk(lo, hi, needed_ref, body, init):
    """``body(block, carry)`` over blocks ``[lo, hi)``, with segment ids (``needed_ref``, the
    program's row of the needed-block table) only over the blocks it marks."""
    if needed_ref is None:
        return lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)

    def maybe(block, carry):
        return lax.cond(needed_ref[block] != 0, body, lambda _, c: c, block, carry)
    return lax.fori_loop(lo, jnp.maximum(hi, lo), maybe, init)


def _forward_kernel(lengths_ref, *refs, plan: Plan):
    """Forward of one (batch, q head, query block) program.

    lengths_ref: int32 ``[batch_pad]``; with sinks, sinks_ref fp32 ``[hq_pad]``. q_ref, o_ref:
    ``[block_q, head_dim]``; k_ref, v_ref: ``[kv_pad, head_dim]`` of kv head ``q head // group``;
    with segment ids int32 ``[block_q]``, ``[kv_pad]`` and the needed key blocks ``[nk_pad]``;
    lse_ref: fp32 ``[block_q]``.
    """
    sinks, (q_ref, k_ref, v_ref), ids, (o_ref, lse_ref), _ = _split(
        refs, int(plan.sinks), 3, 3 * plan.segments, 2)
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k
    length = lengths_ref[b]
    q = q_ref[...]
    q_ids = ids[0][...][:, None] if ids else None

    def body(ki, carry):
        keys = pl.ds(ki * block_k, block_k)
        kv_ids = ids[1][keys][None, :] if ids else None
        mask = visible_tile(qi, ki, block_q, block_k, length, plan, q_ids=q_ids, kv_ids=kv_ids)
        s = scores(q, k_ref[keys, :], mask, plan)
        return online_softmax_step(s, v_ref[keys, :], *carry, _columns)

    m, l = initial_stats(sinks[0][h] if sinks else None, (block_q, 1))
    lo, hi = key_block_range(qi, length, block_q, block_k, plan)
    carry = _walk(lo, hi, ids[2] if ids else None, body, (m, l, jnp.zeros(q.shape, F32)))
    out, lse = finish(*carry, _columns)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.squeeze(lse, 1)


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, plan: Plan):
    """dQ of one (batch, q head, query block) program; shapes as in the forward, di like lse."""
    ids, (dq_ref,), _ = _split(refs, 3 * plan.segments, 1)
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k_dq
    length = lengths_ref[b]
    q, do = q_ref[...], do_ref[...]
    lse, di = lse_ref[...][:, None], di_ref[...][:, None]
    q_ids = ids[0][...][:, None] if ids else None

    def body(ki, dq):
        keys = pl.ds(ki * block_k, block_k)
        k = k_ref[keys, :]
        kv_ids = ids[1][keys][None, :] if ids else None
        mask = visible_tile(qi, ki, block_q, block_k, length, plan, q_ids=q_ids, kv_ids=kv_ids)
        _, ds = score_grads(q, k, v_ref[keys, :], do, lse, di, mask, plan, _columns)
        return dq + lax.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

    lo, hi = key_block_range(qi, length, block_q, block_k, plan)
    dq = _walk(lo, hi, ids[2] if ids else None, body, jnp.zeros(q.shape, F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, plan: Plan):
    """dK, dV of one (batch, kv head, key block) program, summed over the group's q heads.

    q_ref, do_ref: ``[q_pad, group, head_dim]``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, head_dim]``; lse_ref, di_ref: fp32 ``[group, q_pad]``; with segment ids int32
    ``[q_pad]``, ``[block_k]`` and the needed query blocks ``[nq_pad]``.
    """
    ids, (dk_ref, dv_ref), _ = _split(refs, 3 * plan.segments, 2)
    b, ki = pl.program_id(0), pl.program_id(2)
    block_k, block_q = k_ref.shape[0], plan.blocks.block_q_dkv
    length = lengths_ref[b]
    k, v = k_ref[...], v_ref[...]
    kv_ids = ids[1][...][None, :] if ids else None
    lo, hi = query_block_range(ki, length, block_q, block_k, plan)
    grads = (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    for g in range(plan.group):
        def body(qi, carry, g=g):
            dk, dv = carry
            rows = pl.ds(qi * block_q, block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, di = lse_ref[g, rows][:, None], di_ref[g, rows][:, None]
            q_ids = ids[0][rows][:, None] if ids else None
            mask = visible_tile(qi, ki, block_q, block_k, length, plan, q_ids=q_ids,
                                kv_ids=kv_ids)
            p, ds = score_grads(q, k, v, do, lse, di, mask, plan, _columns)
            return (dk + lax.dot(ds.astype(q.dtype).T, q, preferred_element_type=F32),
                    dv + lax.dot(p.astype(do.dtype).T, do, preferred_element_type=F32))
        grads = _walk(lo, hi, ids[2] if ids else None, body, grads)
    dk_ref[...] = grads[0].astype(dk_ref.dtype)
    dv_ref[...] = grads[1].astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, plan: Plan):
    from jax.experimental.pallas import triton as pltriton

    call = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
    )
    return backend.compiled_call(("cuda", "rocm"), call, plan.interpret)


def _query_specs(plan: Plan, block_q: int, d: int, kv_pad: int):
    """Specs of a (batch, q head, query block) grid: a query tile, its kv head's whole K/V, its
    statistics ``[block_q]`` in ``[batch, kv_heads, group, q_pad]``, the key lengths."""
    group = plan.group
    tile = pl.BlockSpec((None, block_q, None, d), lambda b, h, i: (b, i, h, 0))
    keys = pl.BlockSpec((None, kv_pad, None, d), lambda b, h, i: (b, 0, lax.div(h, group), 0))
    stat = pl.BlockSpec((None, None, None, block_q),
                        lambda b, h, i: (b, lax.div(h, group), lax.rem(h, group), i))
    return tile, keys, stat


def _whole(x):
    """The spec of an array every program reads whole."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _pad_last(x, size: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _needed(lengths, ids, block_q: int, block_k: int, plan: Plan, by_key: bool):
    """int32 ``[batch, outer blocks, inner blocks padded to a power of two]`` of
    ``block_skipping.needed_blocks`` (lengths: the real batch's)."""
    q_ids, kv_ids = ids
    needed = needed_blocks(lengths[:q_ids.shape[0]], q_ids, kv_ids, block_q, block_k, plan,
                           by_key).astype(jnp.int32)
    return _pad_last(needed, next_power_of_two(needed.shape[-1]))


def _query_ids(plan: Plan, lengths, ids, block_q: int, block_k: int, kv_pad: int):
    """``(specs, arrays)`` of a query-block program's segment ids: its rows' ``[block_q]``,
    every key's ``[kv_pad]`` and its row of needed key blocks (none without segment ids)."""
    if not plan.segments:
        return [], []
    q_ids, kv_ids = ids
    needed = _needed(lengths, ids, block_q, block_k, plan, by_key=False)
    return ([pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
             pl.BlockSpec((None, kv_pad), lambda b, h, i: (b, 0)),
             pl.BlockSpec((None, None, needed.shape[-1]), lambda b, h, i: (b, i, 0))],
            [q_ids, kv_ids, needed])


def forward(q, k, v, lengths, plan: Plan, ids=None, sinks=None):
    """``(out [b, q_pad, hq*d], lse [b, kv_heads, group, q_pad] fp32)`` from ``[b, seq_pad, heads*d]``;
    ``ids``: padded segment ids ``([b, q_pad], [b, kv_pad])``, ``sinks`` fp32 ``[hq]``."""
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, bq = plan.num_q_heads, plan.num_kv_heads, plan.blocks.block_q
    d = q.shape[2] // hq
    tile, keys, stat = _query_specs(plan, bq, d, kv_pad)
    sink_args = [_pad_last(sinks.astype(F32), next_power_of_two(hq))] if plan.sinks else []
    id_specs, id_arrays = _query_ids(plan, lengths, ids, bq, plan.blocks.block_k, kv_pad)
    out, lse = _call(
        functools.partial(_forward_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[_whole(lengths), *map(_whole, sink_args), tile, keys, keys, *id_specs],
        out_specs=[tile, stat],
        out_shape=[jax.ShapeDtypeStruct((batch, q_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((batch, hk, plan.group, q_pad), F32)],
        plan=plan,
    )(lengths, *sink_args, q.reshape(batch, q_pad, hq, d), k.reshape(batch, kv_pad, hk, d),
      v.reshape(batch, kv_pad, hk, d), *id_arrays)
    return out.reshape(q.shape), lse


def _backward_kernels(q, k, v, lengths, lse, di, do, plan: Plan, ids=None):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v``; lse and di fp32 ``[b, kv_heads, group, q_pad]``."""
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, group = plan.num_q_heads, plan.num_kv_heads, plan.group
    d = q.shape[2] // hq
    q4, do4 = q.reshape(batch, q_pad, hq, d), do.reshape(batch, q_pad, hq, d)
    k4, v4 = k.reshape(batch, kv_pad, hk, d), v.reshape(batch, kv_pad, hk, d)
    lengths_spec = _whole(lengths)

    bq = plan.blocks.block_q_dq
    tile, keys, stat = _query_specs(plan, bq, d, kv_pad)
    id_specs, id_arrays = _query_ids(plan, lengths, ids, bq, plan.blocks.block_k_dq, kv_pad)
    dq = _call(
        functools.partial(_dq_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[lengths_spec, tile, keys, keys, tile, stat, stat, *id_specs], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype), plan=plan,
    )(lengths, q4, k4, v4, do4, lse, di, *id_arrays)

    # (batch, kv head, key block) grid: the kv head's whole group of query heads, one key tile.
    bk = plan.blocks.block_k_dkv
    group_rows = pl.BlockSpec((None, q_pad, None, group, d), lambda b, h, j: (b, 0, h, 0, 0))
    group_stat = pl.BlockSpec((None, None, group, q_pad), lambda b, h, j: (b, h, 0, 0))
    key_tile = pl.BlockSpec((None, bk, None, d), lambda b, h, j: (b, j, h, 0))
    id_specs, id_arrays = [], []
    if plan.segments:
        needed = _needed(lengths, ids, plan.blocks.block_q_dkv, bk, plan, by_key=True)
        id_specs = [pl.BlockSpec((None, q_pad), lambda b, h, j: (b, 0)),
                    pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
                    pl.BlockSpec((None, None, needed.shape[-1]), lambda b, h, j: (b, j, 0))]
        id_arrays = [*ids, needed]
    grouped = (batch, q_pad, hk, group, d)
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan), (batch, hk, kv_pad // bk),
        in_specs=[lengths_spec, group_rows, key_tile, key_tile, group_rows, group_stat,
                  group_stat, *id_specs],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(k4.shape, k.dtype),
                   jax.ShapeDtypeStruct(v4.shape, v.dtype)],
        plan=plan,
    )(lengths, q.reshape(grouped), k4, v4, do.reshape(grouped), lse, di, *id_arrays)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def backward(q, k, v, lengths, out, lse, do, plan: Plan, ids=None):
    """``(dq, dk, dv, di)``: the gradients in the layouts of ``q, k, v`` from the forward's
    ``out`` and ``lse``, and ``di = rowsum(dO ⊙ O)`` per (row, head), fp32, laid out like ``lse``.
    """
    batch, q_pad, _ = q.shape
    di = jnp.sum(out.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1)
                 * do.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1), axis=-1)
    di = di.reshape(batch, q_pad, plan.num_kv_heads, plan.group).transpose(0, 2, 3, 1)
    return (*_backward_kernels(q, k, v, lengths, lse, di, do, plan, ids), di)
