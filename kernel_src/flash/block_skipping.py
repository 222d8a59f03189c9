"""Block skipping: which key blocks a query block needs, which query blocks a key block needs,
and with segment ids the per-block id ranges and tables of needed blocks.

Block skipping. Key block ``ki`` is needed by query block ``qi`` iff it holds a key some real row
of ``qi`` may see (bottom-right causal, ``kv_lengths``, the window). Those blocks are a range
``[lo, hi)`` (``key_block_range``: a prefix without a left window bound), and symmetrically the
query blocks needing key block ``ki`` are a range (``query_block_range``). A grid or loop walks
only that range: its static length (``max_key_steps``) is the widest range over the query blocks,
so a 4,096-key window over 32k keys has about an eighth of the key steps of the plain grid. With
segment ids the blocks are further thinned by each block's id range (``needed_key_blocks``:
the minimum and maximum id of every block, computed outside the kernels; two blocks whose ranges
do not overlap cannot hold an equal pair), which is exact for packed documents (sorted ids).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel_src.contract import visible
from kernel_src.flash.plan import Plan


# --------------------------------------------------------------------------------------------
# Block skipping: which key blocks a query block needs and which query blocks a key block needs
# (shared by every kernel, index map and table). Each function takes Python ints, NumPy arrays or
# traced int32 scalars alike. Integer division is lax.div on non-negative values: Mosaic lowers
# `//` on traced ints via sign().


def _xp(*values):
    """NumPy for Python ints and NumPy values (the tests' and static plans' counts, no compile per
    shape), ``jax.numpy`` for anything traced or on a device."""
    return np if all(isinstance(x, (int, np.integer, np.ndarray)) for x in values) else jnp


def _div(xp, x, d: int):
    """``x // d`` for ``x >= 0``: lax.div when traced (Mosaic lowers ``//`` via sign())."""
    if xp is np:
        return np.asarray(x) // d
    x = jnp.asarray(x)
    return lax.div(x, jnp.asarray(d, x.dtype))


def key_block_range(qi, length, block_q: int, block_k: int, plan: Plan):
    """``(lo, hi)``: key blocks ``[lo, hi)`` hold every key a real row of query block ``qi`` may
    see (bottom-right causal, ``length``, the window); ``hi == lo`` when they hold none."""
    xp = _xp(qi, length)
    left, right = plan.reach
    first = qi * block_q  # the block's first row, and its last real one
    last = xp.minimum((qi + 1) * block_q, plan.q_len) - 1
    start = xp.zeros_like(first)
    if left is not None:
        start = xp.maximum(first + plan.offset - left, 0)
    end = xp.minimum(length, plan.kv_len)
    if right is not None:
        end = xp.minimum(end, last + plan.offset + right + 1)
    empty = (last < first) | (end <= start)
    lo = _div(xp, start, block_k)
    hi = _div(xp, xp.maximum(end, 0) + (block_k - 1), block_k)
    return lo, xp.where(empty, lo, hi)


def query_block_range(ki, length, block_q: int, block_k: int, plan: Plan):
    """``(lo, hi)``: query blocks ``[lo, hi)`` hold every real row that may see a key of key block
    ``ki`` (none past ``length``); ``hi == lo`` (the last real query block) when they hold none."""
    xp = _xp(ki, length)
    left, right = plan.reach
    first = ki * block_k  # the block's first key, and its last one before the length
    last = xp.minimum(xp.minimum((ki + 1) * block_k, length), plan.kv_len) - 1
    start = xp.zeros_like(first)
    if right is not None:  # row i sees key j only if j <= i + offset + right
        start = xp.maximum(first - plan.offset - right, 0)
    end = xp.full_like(first, plan.q_len)
    if left is not None:  # and only if j >= i + offset - left
        end = xp.minimum(end, last - plan.offset + left + 1)
    empty = (last < first) | (end <= start)
    lo = _div(xp, start, block_q)
    hi = _div(xp, xp.maximum(end, 0) + (block_q - 1), block_q)
    # none: the last real query block, where a causal walk ends, so the key blocks past the length
    # that follow it re-use its tiles (no new DMA)
    none = (max(plan.q_len, 1) - 1) // block_q
    return xp.where(empty, none, lo), xp.where(empty, none, hi)


def range_steps(lo, hi):
    """Blocks in ``[lo, hi)``: the computing steps of a walk over it."""
    return _xp(lo, hi).maximum(hi - lo, 0)


def range_block(lo, hi, step, num_blocks: int):
    """The block step ``step`` of a walk over ``[lo, hi)`` reads: ``lo + step``, and the last
    block of the range for the steps past it (so they fetch nothing new), within the array."""
    xp = _xp(lo, hi, step)
    last = xp.maximum(range_steps(lo, hi) - 1, 0)
    return xp.clip(lo + xp.minimum(step, last), 0, num_blocks - 1)


def max_key_steps(block_q: int, block_k: int, num_q_blocks: int, num_k_blocks: int,
                  plan: Plan) -> int:
    """The widest key range over the query blocks (every key valid): the static length of a key
    walk. ``num_k_blocks`` without a window bound; about ``(left + right + block_q) / block_k``
    with one."""
    lo, hi = key_block_range(np.arange(num_q_blocks), plan.kv_len, block_q, block_k, plan)
    widest = int(np.max(range_steps(lo, hi), initial=0))
    return max(1, min(num_k_blocks, widest))


def max_query_steps(block_q: int, block_k: int, num_q_blocks: int, num_k_blocks: int,
                    plan: Plan) -> int:
    """The widest query range over the key blocks: the static length of a query walk."""
    lo, hi = query_block_range(np.arange(num_k_blocks), plan.kv_len, block_q, block_k, plan)
    widest = int(np.max(range_steps(lo, hi), initial=0))
    return max(1, min(num_q_blocks, widest))


def whole_tile(qi, ki, block_q: int, block_k: int, length, plan: Plan, same_ids=None):
    """True when every (query, key) pair of the tile is visible and no query row is padding:
    no mask cuts it, so its kernels may skip the iota compares and ``where``s. With segment ids
    ``same_ids`` must say that every row and key of the two blocks holds one and the same id
    (``segment_bounds``); without it such a tile is never whole."""
    if plan.segments and same_ids is None:
        return False
    left, right = plan.reach
    key_end = (ki + 1) * block_k
    whole = (key_end <= length) & ((qi + 1) * block_q <= plan.q_len)
    if right is not None:  # the tile's last key is visible to its first row
        whole = whole & (key_end - 1 <= qi * block_q + plan.offset + right)
    if left is not None:  # and its first key to its last row
        whole = whole & (ki * block_k >= (qi + 1) * block_q - 1 + plan.offset - left)
    return whole & same_ids if plan.segments else whole


def visible_tile(qi, ki, block_q: int, block_k: int, length, plan: Plan,
                 transposed: bool = False, q_ids=None, kv_ids=None):
    """``[block_q, block_k]`` visibility of one (query block, key block) tile, from iotas;
    ``[block_k, block_q]`` if ``transposed``. ``q_ids``, ``kv_ids``: the rows' and keys' segment
    ids, broadcasting against the tile (``plan.segments``). Padded query rows see no key."""
    shape, q_axis = ((block_k, block_q), 1) if transposed else ((block_q, block_k), 0)
    q_pos = qi * block_q + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = ki * block_k + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    ok = visible(q_pos, k_pos, plan.q_len, plan.kv_len, plan.causal, length, plan.window,
                 q_ids, kv_ids)
    if plan.q_len % block_q:  # a partly padded query block exists (wholly padded ones never run)
        ok = ok & (q_pos < plan.q_len)
    return ok


# --------------------------------------------------------------------------------------------
# Segment ids: per-block id ranges and the tables of needed blocks (XLA, outside the kernels).

_ID_MAX, _ID_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min


def block_id_bounds(ids, valid_len: int, block: int):
    """``(min, max)`` int32 ``[batch, blocks]`` of the ids of each block of ``ids``
    (``[batch, pad]``), positions from ``valid_len`` on left out (a block of none: max < min)."""
    xp = _xp(ids)
    batch, pad = ids.shape
    valid = xp.arange(pad)[None, :] < valid_len
    lo = xp.where(valid, ids, _ID_MAX).reshape(batch, pad // block, block).min(axis=-1)
    hi = xp.where(valid, ids, _ID_MIN).reshape(batch, pad // block, block).max(axis=-1)
    return lo.astype(np.int32), hi.astype(np.int32)


def segment_bounds(q_ids, kv_ids, block_q: int, block_k: int, plan: Plan):
    """``(q_lo, q_hi, k_lo, k_hi)``: int32 ``[batch, blocks]`` id ranges of the query blocks and
    key blocks of the padded ids ``[batch, q_pad]``, ``[batch, kv_pad]`` (``block_id_bounds``)."""
    return (*block_id_bounds(q_ids, plan.q_len, block_q),
            *block_id_bounds(kv_ids, plan.kv_len, block_k))


def needed_blocks(lengths, q_ids, kv_ids, block_q: int, block_k: int, plan: Plan,
                  by_key: bool = False, bounds=None):
    """Bool ``[batch, query blocks, key blocks]`` (``by_key``: ``[batch, key blocks, query
    blocks]``): the pair is in its range (``key_block_range``, or ``query_block_range`` by key)
    and, with segment ids (``[batch, q_pad]``, ``[batch, kv_pad]``), the two blocks' id ranges
    overlap (``bounds``: ``segment_bounds``'s, if already computed)."""
    xp = _xp(lengths, q_ids, kv_ids)
    nq, nk = q_ids.shape[1] // block_q, kv_ids.shape[1] // block_k
    length = lengths[:, None, None]
    if by_key:
        ki, qi = xp.arange(nk)[None, :, None], xp.arange(nq)[None, None, :]
        lo, hi = query_block_range(ki, length, block_q, block_k, plan)
        need = (qi >= lo) & (qi < hi)
    else:
        qi, ki = xp.arange(nq)[None, :, None], xp.arange(nk)[None, None, :]
        lo, hi = key_block_range(qi, length, block_q, block_k, plan)
        need = (ki >= lo) & (ki < hi)
    q_lo, q_hi, k_lo, k_hi = bounds or segment_bounds(q_ids, kv_ids, block_q, block_k, plan)
    if by_key:
        q_lo, q_hi, k_lo, k_hi = q_lo[:, None, :], q_hi[:, None, :], k_lo[:, :, None], k_hi[:, :, None]
    else:
        q_lo, q_hi, k_lo, k_hi = q_lo[:, :, None], q_hi[:, :, None], k_lo[:, None, :], k_hi[:, None, :]
    return need & (q_lo <= k_hi) & (k_lo <= q_hi)


def block_table(needed, steps: int):
    """``(table, count)`` of a bool ``[batch, outer, inner]``: int32 ``[batch, outer, steps]``
    holding each outer block's needed inner blocks in increasing order, then its last needed block
    again (block 0 if none), and int32 ``[batch, outer]`` how many are needed (at most ``steps``)."""
    xp = _xp(needed)
    inner = needed.shape[-1]
    index = xp.arange(inner, dtype=np.int32)
    order = xp.sort(xp.where(needed, index, inner + index), axis=-1) % inner
    count = xp.sum(needed, axis=-1, dtype=np.int32)
    order = order[..., :steps]
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    table = xp.where(xp.arange(steps) < count[..., None], order, last)
    return table.astype(np.int32), count
