"""Flash attention for TPU (Mosaic), backward: the dQ and dK/dV kernels and their calls.

Both kernels walk the grids ``kernel_src.flash.tpu`` lays out (``Walk``, its index maps, specs and
``_call``). The dQ kernel computes ``di = rowsum(dO ⊙ O)`` itself (reading ``O`` once per query
block) and writes it for the dK/dV kernel, which computes the transposed scores ``K·Qᵀ``
directly, so those rows broadcast along its lanes and neither ``P`` nor ``dS`` is transposed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernel_src.flash.block_skipping import visible_tile
from kernel_src.flash.heads import Heads
from kernel_src.flash.plan import F32, LANES, TRANS_B, Plan, logit_grads, logits, score_grads
from kernel_src.flash.tpu import (Walk, _call, _column, _cut, _each_head, _head_dim, _id_inputs,
                                  _ids_tile, _lanes, _row, _seq_len, _specs, _split, _words,
                                  key_side_maps, query_side_maps)


def _dq_kernel(*refs, plan: Plan, walk: Walk):
    """dQ (and ``di``) of one (batch, kv-head block, query block, key step) grid step.

    Scalar prefetch: ``walk``'s. q_ref, do_ref, o_ref, dq_ref: ``[block_q, q heads, d]``; k_ref,
    v_ref: ``[block_k, kv heads, d]`` (other layouts: ``heads.Heads``); lse_ref, di_ref: fp32
    ``[q heads, 1, block_q]``; segment ids as in the forward. Once per query block, lse becomes
    lane-replicated ``[block_q, 128]`` scratch and ``di = rowsum(dO ⊙ O)`` is computed (fp32),
    kept likewise and written lane-dense for the dK/dV kernel. dq_ref in the input dtype,
    accumulated over key blocks in fp32 ``dq_scratch [q heads, block_q, d]``. ``words``: 32-bit
    copies of q (O's first, then dQ's on the way out), dO, k, v (layout "rows", 16 bits).
    """
    pre, (q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref), ids, (dq_ref, di_ref), refs = _split(
        refs, walk.num_prefetch, 6, 2 * plan.segments, 2)
    (dq_scratch, lse_scratch, di_scratch), words = refs[:3], refs[3:]
    heads = (plan.q_head_block, plan.q_head_block, plan.kv_head_block, plan.kv_head_block)
    q, do, k, v = (Heads(ref, n, plan, w) for ref, n, w in zip(
        (q_ref, do_ref, k_ref, v_ref), heads, words or (None,) * 4))
    o = Heads(o_ref, plan.q_head_block, plan, q.words)
    b, qi, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q.rows, k.rows
    length = pre[0][b]
    ki = walk.block(b, qi, step, pre)

    @pl.when(step == 0)
    def _start():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, F32)
        o.copy_words()
        do.copy_words()
        for h in range(plan.q_head_block):
            lse_scratch[h] = _column(lse_ref[h])
            di = jnp.sum(o.load(h).astype(F32) * do.load(h).astype(F32), axis=1, keepdims=True)
            di_scratch[h] = jnp.broadcast_to(di, (block_q, LANES))
            di_ref[h] = _row(di_scratch[h])
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
            j = h // plan.group
            k_j = k.load(j)
            _, ds = score_grads(q.load(h), k_j, v.load(j), do.load(h), lse_scratch[h],
                                di_scratch[h], None, plan, _lanes)
            ds = _cut(ds, whole, mask, 0.0)  # dS = P (dP - di): zero where P is
            dq_scratch[h] += lax.dot(ds.astype(k_j.dtype), k_j, preferred_element_type=F32)
        _each_head(range(plan.q_head_block), length, head)

    @pl.when(step == walk.steps - 1)
    def _store():
        Heads(dq_ref, plan.q_head_block, plan, q.words).store(lambda h: dq_scratch[h])


def _dkv_kernel(*refs, plan: Plan, walk: Walk):
    """dK and dV of one (batch, kv-head block, key block, query step) grid step.

    Each kv head's group of query heads is walked inside the step, their contributions adding
    up in the fp32 scratch ``[kv heads, block_k, d]``: K and V are never repeated. Scalar
    prefetch: ``walk``'s. q_ref, do_ref: ``[block_q, q heads, d]``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, kv heads, d]`` (other layouts: ``heads.Heads``); lse_ref, di_ref: fp32
    ``[q heads, 1, block_q]``; with segment ids int32 ``[1, block_q]`` and ``[block_k, 128]``
    (lane-replicated). Scores are computed transposed, ``[block_k, block_q]``, so
    ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q`` are plain matmuls. ``words``: 32-bit copies of q, dO, k
    (then dK's), v (then dV's) (layout "rows", 16 bits).
    """
    pre, (q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref), ids, (dk_ref, dv_ref), refs = _split(
        refs, walk.num_prefetch, 6, 2 * plan.segments, 2)
    (dk_scratch, dv_scratch), words = refs[:2], refs[2:]
    heads = (plan.q_head_block, plan.q_head_block, plan.kv_head_block, plan.kv_head_block)
    q, do, k, v = (Heads(ref, n, plan, w) for ref, n, w in zip(
        (q_ref, do_ref, k_ref, v_ref), heads, words or (None,) * 4))
    b, ki, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q.rows, k.rows
    length = pre[0][b]
    qi = walk.block(b, ki, step, pre)

    @pl.when(step == 0)
    def _start():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, F32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, F32)
        k.copy_words()
        v.copy_words()

    @pl.when(walk.computes(b, ki, step, pre))
    def _step():
        whole = walk.whole(b, qi, ki, pre)
        q.copy_words()
        do.copy_words()

        def mask():
            q_ids, kv_ids = _ids_tile(ids, True, block_q, block_k)
            return visible_tile(qi, ki, block_q, block_k, length, plan, transposed=True,
                                q_ids=q_ids, kv_ids=kv_ids)

        def head(h: int):
            j = h // plan.group
            q_h, do_h = q.load(h), do.load(h)
            s_t, t = logits(k.load(j), q_h, plan)
            p_t = _cut(jnp.exp(s_t - lse_ref[h]), whole, mask, 0.0)  # [block_k, block_q]
            dp_t = lax.dot_general(v.load(j), do_h, TRANS_B, preferred_element_type=F32)
            ds_t = logit_grads(p_t, dp_t, di_ref[h], t, plan)
            dv_scratch[j] += lax.dot(p_t.astype(do_h.dtype), do_h, preferred_element_type=F32)
            dk_scratch[j] += lax.dot(ds_t.astype(q_h.dtype), q_h, preferred_element_type=F32)
        _each_head(range(plan.q_head_block), length, head)

    @pl.when(step == walk.steps - 1)
    def _store():
        Heads(dk_ref, plan.kv_head_block, plan, k.words).store(lambda j: dk_scratch[j])
        Heads(dv_ref, plan.kv_head_block, plan, v.words).store(lambda j: dv_scratch[j])


def backward(q, k, v, lengths, out, lse, do, plan: Plan, ids=None):
    """``(dq, dk, dv, di)`` in the layouts of ``q, k, v`` (``di = rowsum(dO ⊙ O)`` fp32
    ``[b, hq, 1, q_pad]``, like ``lse``) from the forward's ``out`` and ``lse``; ``di`` comes
    from the dQ kernel, so no XLA op runs between."""
    batch, d = q.shape[0], _head_dim(q, plan)
    q_pad, kv_pad = _seq_len(q, plan.num_q_heads, plan), _seq_len(k, plan.num_kv_heads, plan)
    blocks, kv_blocks = plan.blocks, plan.num_kv_heads // plan.kv_head_block
    q_heads, kv_heads = plan.kv_head_block * plan.group, plan.kv_head_block

    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    walk = Walk(plan, bq, bk, q_pad // bq, kv_pad // bk, by_key=False, batch=batch)
    grid = (batch, kv_blocks, q_pad // bq, walk.steps)
    q_map, kv_map = query_side_maps(walk)
    q_spec, kv_spec, stat_spec = _specs(plan, q_map, kv_map, bq, bk, d)
    id_specs, id_arrays = _id_inputs(plan, ids, q_map, kv_map, bq, bk, by_key=False)
    prefetch = walk.arrays(lengths, ids)
    dq, di = _call(
        functools.partial(_dq_kernel, plan=plan, walk=walk), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_spec, stat_spec, *id_specs],
        out_specs=[q_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse.shape, F32)],
        scratch=[(q_heads, bq, d), (q_heads, bq, LANES), (q_heads, bq, LANES)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=3,
        words=_words(plan, q.dtype, bq, bk, d, 2, 2), num_prefetch=len(prefetch),
    )(*prefetch, q, k, v, do, out, lse, *id_arrays)

    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    walk = Walk(plan, bq, bk, q_pad // bq, kv_pad // bk, by_key=True, batch=batch)
    grid = (batch, kv_blocks, kv_pad // bk, walk.steps)
    q_map, kv_map = key_side_maps(walk)
    q_spec, kv_spec, stat_spec = _specs(plan, q_map, kv_map, bq, bk, d)
    id_specs, id_arrays = _id_inputs(plan, ids, q_map, kv_map, bq, bk, by_key=True)
    prefetch = walk.arrays(lengths, ids)
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan, walk=walk), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, *id_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[(kv_heads, bk, d), (kv_heads, bk, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=4,
        words=_words(plan, q.dtype, bq, bk, d, 2, 2), num_prefetch=len(prefetch),
    )(*prefetch, q, k, v, do, lse, di, *id_arrays)
    return dq, dk, dv, di
