"""Paged attention for GPU (Triton): each program gathers its keys through the page table.

Grid ``(batch, kv heads)``: one program owns one kv head of one sequence, its whole group of
query heads and new rows as one ``[rows_pad, d_pad]`` tile (``plan.to_rows``; rows and
``head_dim`` padded to powers of two >= 16, as Triton's blocks and ``dot`` need), and loops
(``lax.fori_loop``) over blocks of ``block_k`` consecutive keys from the block of
``plan.first_key`` to the one holding the last key, so a key past the length is never in a
loop's range but for the last block's tail.

Gather. The pools are seen as ``[num_pages * page_size, kv heads * head_dim]`` (a free reshape),
so key ``j`` of the sequence is row ``page_indices[b, j // page_size] * page_size + j %
page_size``: each block loads its keys' table entries, then its K and V rows, with one masked
gather each (any page size, power of two or not; any ``head_dim``). Keys outside ``[first_key,
length)`` are masked in both: their table entries and pages are never read, and they load as
zeros, so nothing past the length (NaN included) reaches ``P·V``; their logits are masked to
``-inf`` as well. Row statistics are fp32 ``[rows_pad, 1]``. Lowered to Triton IR by the tests;
never compiled or run on a GPU from this repository.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernel_src import backend
from kernel_src.flash.plan import F32, finish, next_power_of_two, online_softmax_step, scores
from kernel_src.paged.plan import PagedPlan, div_up, first_key, row_sinks, visible


def _columns(x: jax.Array, width: int) -> jax.Array:
    """Row statistics ``[rows, 1]`` broadcast to ``[rows, width]``."""
    return jnp.broadcast_to(x, (x.shape[0], width))


def _kernel(lengths_ref, table_ref, *refs, plan: PagedPlan, block_k: int):
    """One (sequence, kv head) program. lengths_ref int32 ``[batch_pad]``; table_ref int32
    ``[batch_pad, table_pad]``; with sinks, sinks_ref fp32 ``[hq_pad]``; q_ref, o_ref
    ``[rows_pad, d_pad]``; k_ref, v_ref the pools ``[num_pages * page_size, hk * d]``."""

    sinks_ref = refs[0] if plan.sinks else None
    q_ref, k_ref, v_ref, o_ref = refs[int(plan.sinks):]
    b = pl.program_id(0)
    length = lengths_ref[b]
    gather_walk(first_key(length, plan), length, lambda entry, real: _masked_load(
        table_ref, (b, entry), real), lambda rows, keys: visible(rows, keys, length, plan),
        (q_ref, k_ref, v_ref, o_ref), sinks_ref, plan, block_k)


def gather_walk(start, end, page_of, visible_of, refs, sinks_ref, plan, block_k: int,
                convert=lambda x, which: x) -> None:
    """The program of kv head ``pl.program_id(1)`` over one tile's keys ``[start, end)``, blocks
    of ``block_k`` gathered through the page table (the module docstring): ``page_of(entries,
    real)`` the pages of table entries (read only where ``real``), ``visible_of(rows, keys)`` the
    mask, ``convert(x, which)`` applied to each gathered K (``which`` 0) and V (1) block.
    ``refs``: ``(q_ref, k_ref, v_ref, o_ref)``; the rows are written to ``o_ref``."""
    q_ref, k_ref, v_ref, o_ref = refs
    j = pl.program_id(1)
    rows_pad, d_pad = q_ref.shape
    d, page_size = plan.head_dim, plan.page_size
    end = jnp.maximum(end, 0)
    q = q_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, (rows_pad, block_k), 0)
    columns = j * d + lax.broadcasted_iota(jnp.int32, (1, d_pad), 1)
    column_real = lax.broadcasted_iota(jnp.int32, (1, d_pad), 1) < d

    def body(block, carry):
        keys = block * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        real = (keys >= start) & (keys < end)  # keys whose page and slot may be read
        page = page_of(jnp.where(real, lax.div(keys, page_size), 0), real)
        row = jnp.where(real, page * page_size + lax.rem(keys, page_size), 0)[:, None]
        load_mask = real[:, None] & column_real
        k, v = (convert(_masked_load(ref, (row, columns), load_mask), which)
                for which, ref in enumerate((k_ref, v_ref)))
        s = scores(q, k, visible_of(rows, keys[None, :]), plan)
        return online_softmax_step(s, v, *carry, _columns)

    if sinks_ref is not None:
        m, l = row_sinks(lambda h: sinks_ref[h], j,
                         lax.broadcasted_iota(jnp.int32, (rows_pad, 1), 0), plan)
    else:
        m = jnp.full((rows_pad, 1), -jnp.inf, F32)
        l = jnp.zeros((rows_pad, 1), F32)
    lo, hi = lax.div(start, block_k), div_up(end, block_k)
    carry = lax.fori_loop(lo, jnp.maximum(hi, lo), body, (m, l, jnp.zeros((rows_pad, d_pad), F32)))
    out, _ = finish(*carry, _columns)
    o_ref[...] = out.astype(o_ref.dtype)


def _masked_load(ref, index, mask):
    """``ref[index]`` where ``mask``, else 0, nothing read where masked: ``triton.load`` of a view since
    jax 0.7, ``pl.load(ref, index)`` before (jax 0.6.2, the Kaggle image's, has no ``triton.load``)."""
    from jax.experimental.pallas import triton as pltriton

    if hasattr(pltriton, "load"):
        return pltriton.load(ref.at[index], mask=mask, other=0)
    return pl.load(ref, index, mask=mask, other=0)


def _whole(x):
    """The spec of an array every program reads whole."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _pad_to(x, shape):
    return jnp.pad(x, [(0, n - s) for s, n in zip(x.shape, shape)])


def forward(q_rows, k_pages, v_pages, lengths, page_indices, sinks, plan: PagedPlan,
            block_k: int):
    """``out_rows [batch, hk, rows_pad, d]`` (the input dtype) from ``q_rows`` in the same layout
    (``plan.to_rows``), the pools ``[num_pages, page_size, hk, d]``, int32 ``lengths [batch]``
    (clipped), int32 ``page_indices [batch, pages_per_sequence]`` and fp32 ``sinks [hq]``."""
    from jax.experimental.pallas import triton as pltriton

    batch, hk, rows_pad, d = q_rows.shape
    d_pad = max(16, next_power_of_two(d))
    batch_pad = next_power_of_two(batch)
    lengths = _pad_to(lengths, (batch_pad,))
    table = _pad_to(page_indices, (batch_pad, next_power_of_two(page_indices.shape[1])))
    flat = (k_pages.shape[0] * plan.page_size, hk * d)
    k_flat, v_flat = k_pages.reshape(flat), v_pages.reshape(flat)
    extra = [_pad_to(sinks, (next_power_of_two(sinks.shape[0]),))] if plan.sinks else []
    tile = pl.BlockSpec((None, None, rows_pad, d_pad), lambda b, j: (b, j, 0, 0))
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, block_k=block_k), grid=(batch, hk),
        in_specs=[_whole(lengths), _whole(table), *map(_whole, extra), tile, _whole(k_flat),
                  _whole(v_flat)],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((batch, hk, rows_pad, d_pad), q_rows.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
    )
    call = backend.compiled_call(("cuda", "rocm"), call, plan.interpret)
    out = call(lengths, table, *extra, _pad_to(q_rows, (batch, hk, rows_pad, d_pad)), k_flat,
               v_flat)
    return out[..., :d]
