"""Flash attention for GPU (Triton): forward, dQ and dK/dV kernels, side by side.

Triton programs run in parallel and cannot carry state across grid steps, so each program owns
one output tile and loops over the other sequence inside the kernel (``lax.fori_loop``), with
power-of-two tiles. Views ``[batch, seq, heads, head_dim]`` (dK/dV: ``[batch, seq, kv_heads,
group, head_dim]``); row statistics fp32 ``[batch, kv_heads, group, q_pad]``. Lowered to Triton
IR by the tests; never compiled or run on a GPU from this repository.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernel_src import backend
from kernel_src.flash.plan import (F32, Plan, finish, first_query_block, key_in_range,
                                   num_key_blocks, online_softmax_step, score_grads, scores,
                                   visible_tile)


def _columns(x: jax.Array, width: int) -> jax.Array:
    """Row statistics ``[rows, 1]`` broadcast to ``[rows, width]``."""
    return jnp.broadcast_to(x, (x.shape[0], width))



def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: Plan):
    """Forward of one (batch, q head, query block) program.

    lengths_ref: int32 ``[batch_pad]``. q_ref, o_ref: ``[block_q, head_dim]``; k_ref, v_ref:
    ``[kv_pad, head_dim]`` of kv head ``q head // group``; lse_ref: fp32 ``[block_q]``.
    """
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k
    length = lengths_ref[b]
    q = q_ref[...]

    def body(ki, carry):
        keys = pl.ds(ki * block_k, block_k)
        mask = visible_tile(qi, ki, block_q, block_k, length, plan)
        s = scores(q, k_ref[keys, :], mask, plan.scale)
        return online_softmax_step(s, v_ref[keys, :], *carry, _columns)

    init = (jnp.full((block_q, 1), -jnp.inf, F32), jnp.zeros((block_q, 1), F32),
            jnp.zeros(q.shape, F32))
    n = num_key_blocks(qi, length, block_q, block_k, plan)
    out, lse = finish(*lax.fori_loop(0, n, body, init), _columns)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.squeeze(lse, 1)


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, *,
                      plan: Plan):
    """dQ of one (batch, q head, query block) program; shapes as in the forward, di like lse."""
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k_dq
    length = lengths_ref[b]
    q, do = q_ref[...], do_ref[...]
    lse, di = lse_ref[...][:, None], di_ref[...][:, None]

    def body(ki, dq):
        keys = pl.ds(ki * block_k, block_k)
        k = k_ref[keys, :]
        mask = visible_tile(qi, ki, block_q, block_k, length, plan)
        _, ds = score_grads(q, k, v_ref[keys, :], do, lse, di, mask, plan.scale, _columns)
        return dq + lax.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

    n = num_key_blocks(qi, length, block_q, block_k, plan)
    dq_ref[...] = lax.fori_loop(0, n, body, jnp.zeros(q.shape, F32)).astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                       *, plan: Plan):
    """dK, dV of one (batch, kv head, key block) program, summed over the group's q heads.

    q_ref, do_ref: ``[q_pad, group, head_dim]``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, head_dim]``; lse_ref, di_ref: fp32 ``[group, q_pad]``.
    """
    b, ki = pl.program_id(0), pl.program_id(2)
    block_k, block_q = k_ref.shape[0], plan.blocks.block_q_dkv
    q_pad = q_ref.shape[0]
    length = lengths_ref[b]
    k, v = k_ref[...], v_ref[...]
    num_q_blocks = q_pad // block_q
    first = first_query_block(ki, block_q, block_k, num_q_blocks, plan)
    stop = jnp.where(key_in_range(ki, length, block_k), num_q_blocks, first)
    grads = (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    for g in range(plan.group):
        def body(qi, carry, g=g):
            dk, dv = carry
            rows = pl.ds(qi * block_q, block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, di = lse_ref[g, rows][:, None], di_ref[g, rows][:, None]
            mask = visible_tile(qi, ki, block_q, block_k, length, plan)
            p, ds = score_grads(q, k, v, do, lse, di, mask, plan.scale, _columns)
            return (dk + lax.dot(ds.astype(q.dtype).T, q, preferred_element_type=F32),
                    dv + lax.dot(p.astype(do.dtype).T, do, preferred_element_type=F32))
        grads = lax.fori_loop(first, stop, body, grads)
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


def forward(q, k, v, lengths, plan: Plan):
    """``(out [b, q_pad, hq*d], lse [b, kv_heads, group, q_pad] fp32)`` from ``[b, seq_pad, heads*d]``."""
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, bq = plan.num_q_heads, plan.num_kv_heads, plan.blocks.block_q
    d = q.shape[2] // hq
    tile, keys, stat = _query_specs(plan, bq, d, kv_pad)
    out, lse = _call(
        functools.partial(_forward_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[pl.BlockSpec(lengths.shape, lambda b, h, i: (0,)), tile, keys, keys],
        out_specs=[tile, stat],
        out_shape=[jax.ShapeDtypeStruct((batch, q_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((batch, hk, plan.group, q_pad), F32)],
        plan=plan,
    )(lengths, q.reshape(batch, q_pad, hq, d), k.reshape(batch, kv_pad, hk, d),
      v.reshape(batch, kv_pad, hk, d))
    return out.reshape(q.shape), lse


def _backward_kernels(q, k, v, lengths, lse, di, do, plan: Plan):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v``; lse and di fp32 ``[b, kv_heads, group, q_pad]``."""
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, group = plan.num_q_heads, plan.num_kv_heads, plan.group
    d = q.shape[2] // hq
    q4, do4 = q.reshape(batch, q_pad, hq, d), do.reshape(batch, q_pad, hq, d)
    k4, v4 = k.reshape(batch, kv_pad, hk, d), v.reshape(batch, kv_pad, hk, d)
    lengths_spec = pl.BlockSpec(lengths.shape, lambda b, h, i: (0,))

    bq = plan.blocks.block_q_dq
    tile, keys, stat = _query_specs(plan, bq, d, kv_pad)
    dq = _call(
        functools.partial(_dq_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[lengths_spec, tile, keys, keys, tile, stat, stat], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype), plan=plan,
    )(lengths, q4, k4, v4, do4, lse, di)

    # (batch, kv head, key block) grid: the kv head's whole group of query heads, one key tile.
    bk = plan.blocks.block_k_dkv
    group_rows = pl.BlockSpec((None, q_pad, None, group, d), lambda b, h, j: (b, 0, h, 0, 0))
    group_stat = pl.BlockSpec((None, None, group, q_pad), lambda b, h, j: (b, h, 0, 0))
    key_tile = pl.BlockSpec((None, bk, None, d), lambda b, h, j: (b, j, h, 0))
    grouped = (batch, q_pad, hk, group, d)
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan), (batch, hk, kv_pad // bk),
        in_specs=[lengths_spec, group_rows, key_tile, key_tile, group_rows, group_stat,
                  group_stat],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(k4.shape, k.dtype),
                   jax.ShapeDtypeStruct(v4.shape, v.dtype)],
        plan=plan,
    )(lengths, q.reshape(grouped), k4, v4, do.reshape(grouped), lse, di)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)



def backward(q, k, v, lengths, out, lse, do, plan: Plan):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v`` from the forward's ``out`` and ``lse``.

    ``di = rowsum(dO ⊙ O)`` per (row, head), fp32, laid out like ``lse``.
    """
    batch, q_pad, _ = q.shape
    di = jnp.sum(out.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1)
                 * do.astype(F32).reshape(batch, q_pad, plan.num_q_heads, -1), axis=-1)
    di = di.reshape(batch, q_pad, plan.num_kv_heads, plan.group).transpose(0, 2, 3, 1)
    return _backward_kernels(q, k, v, lengths, lse, di, do, plan)
