"""What both ragged lowerings share: block sizes, the call's plan, the work list, the mask.

Work items. The ragged batch is cut, outside the kernels (XLA), into work items of at most
``item_rows = block_q * sub_tiles`` consecutive rows of one sequence: sequence ``i`` (of the first
``num_seqs[0]``) gives ``ceil(q_len_i / item_rows)`` of them, an empty one none. With
``zero_padding`` (Mosaic) the padding rows past ``cu_q_lens[num_seqs[0]]`` form items too, of no
keys, whose rows the kernel writes as zeros. Their number is bounded statically by
``ceil(num_tokens / item_rows) + min(max_seqs, num_tokens) + zero_padding`` (``RaggedPlan.items``);
the items past the last real one have no rows and compute nothing. Per item six int32 scalars
describe it (``Items``): its sequence (for the page table), the sequence's ``kv_length`` and
``q_len``, ``j0``, the index of its first row among the sequence's new rows, ``first``, that row's
row of ``q``, and ``rows``, how many it has.

Rows. Mosaic copies an item's rows of ``q [num_tokens, hq, d]`` into VMEM itself and its output
rows back (``kernel_src.ragged.tpu``), ``block_q`` rows a sub-tile. Triton takes each item's rows
gathered into a ``[block_q, num_q_heads, head_dim]`` block (``gather_tiles``; ``sub_tiles`` is 1
there; rows of no sequence are zeros, so a NaN in a padding row of ``q`` is never read by a
kernel), which is the paged kernels' ``[batch, q_len, hq, d]`` with ``batch = items`` and ``q_len
= block_q``, laid out as ``kernel_src.paged.plan.to_rows`` lays it (one tile of ``group * block_q``
rows per kv head); its output comes back by one gather too (``scatter_tiles``; rows of no sequence
come out zeros). Row ``i`` of an item sits at position ``kv_length - q_len + j0 + i``.

Keys. The keys an item's rows may see are ``[start, end)`` (``key_range``): ``start`` is 0, or
with a left window bound its first row's ``position - left``; ``end`` is the length, or under
``causal`` its last row's position + 1 (or, not causal, with a right bound ``position + right +
1``). Kernels read only the pages holding those keys: a decode row reads its sequence's pages
once; a chunk of prefill does not read the pages past its last row.

Dequantizing (``quantized``): int8 or float8_e4m3fn pools; a key is ``float32(stored) *
k_scale`` (a value ``* v_scale``), rounded to ``q``'s dtype before the matmuls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kernel_src import contract
from kernel_src.contract import Window
from kernel_src.paged.plan import PagedBlockSizes, div_up, row_index


# Rows of one Mosaic work item by default (``RaggedBlockSizes.for_step``): a prompt's pages are read
# once per item, and each of its sub-tiles holds its statistics in VMEM.
ITEM_ROWS = 512


@dataclasses.dataclass(frozen=True)
class RaggedBlockSizes(PagedBlockSizes):
    """``PagedBlockSizes``'s keys per step (Mosaic: pages per grid step; Triton: ``block_k`` keys
    per loop iteration) and the rows of one work item; they change speed, not results.

    Attributes:
      block_q: rows (new tokens) of one sequence per tile, >= 1. A decode row takes a tile
        alone, so a large ``block_q`` pads decode rows' tiles.
      sub_tiles: Mosaic: tiles of ``block_q`` rows per work item, >= 1 (Triton: 1 always). An
        item reads its pages once for all its rows, so a long prompt's pages are read once per
        ``block_q * sub_tiles`` rows; its statistics take VMEM per sub-tile.
    """

    block_q: int = 16
    sub_tiles: int = 1

    def __post_init__(self):
        super().__post_init__()
        for name in ("block_q", "sub_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_step(cls, platform: str, num_tokens: int, max_seqs: int) -> RaggedBlockSizes:
        """``for_platform``'s sizes for a call of ``num_tokens`` rows of q and ``max_seqs`` table
        rows. On TPU ``block_q`` is the tokens per sequence slot, ``num_tokens / max_seqs`` rounded
        up to a power of two in ``[16, 64]`` (a decode row's tile computes ``block_q`` rows), and
        ``sub_tiles`` makes an item ``ITEM_ROWS`` rows (untuned; compiled, fewer where VMEM is
        short: ``kernel_src.ragged.tpu.fit_sub_tiles``). Elsewhere 16 rows, one tile (on CPU, where
        the Mosaic kernel is interpreted, 4 tiles, so its items of several tiles are exercised)."""
        sizes = cls.for_platform(platform)
        if platform == "cpu":
            return dataclasses.replace(sizes, sub_tiles=4)
        if platform != "tpu":
            return sizes
        per_slot = -(-num_tokens // max(max_seqs, 1))
        block_q = min(64, max(16, 1 << (per_slot - 1).bit_length()))
        return dataclasses.replace(sizes, block_q=block_q, sub_tiles=max(1, ITEM_ROWS // block_q))


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """Static facts of one ragged call: the problem's sizes, its features, how to lower."""

    num_tokens: int
    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    num_pages: int
    causal: bool
    scale: float
    interpret: Any
    block_q: int  # rows of a tile
    rows_pad: int  # rows of a tile, padded (``paged.plan.tile_rows``)
    window: Window | None = None
    softcap: float | None = None
    sinks: bool = False
    quantized: bool = False
    sub_tiles: int = 1  # tiles per work item
    zero_padding: bool = False  # the padding rows are work items of no keys (Mosaic)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_len(self) -> int:
        """Rows per query head in a tile (``block_q``): the name ``paged.plan``'s row helpers
        (``row_index``, ``row_sinks``) read."""
        return self.block_q

    @property
    def rows(self) -> int:
        """Real rows of one kv head's tile: its group's query heads times ``block_q``."""
        return self.group * self.block_q

    @property
    def max_len(self) -> int:
        """The most keys a sequence can hold: its table's pages, full."""
        return self.pages_per_sequence * self.page_size

    @property
    def item_rows(self) -> int:
        """The most rows of one work item: ``sub_tiles`` tiles of ``block_q``."""
        return self.block_q * self.sub_tiles

    @property
    def items(self) -> int:
        """The static number of work items: enough for any ragged batch of these sizes."""
        return (-(-self.num_tokens // self.item_rows) + min(self.max_seqs, self.num_tokens)
                + int(self.zero_padding))


class Items(NamedTuple):
    """The work list, int32 ``[items]`` each (``schedule``)."""

    seq: jax.Array  # the item's sequence (a row of the page table)
    length: jax.Array  # the sequence's kv_length; 0 for an item past the last or of padding
    q_len: jax.Array  # the sequence's new rows; 0 for an item past the last
    j0: jax.Array  # the item's first row among them
    first: jax.Array  # that row's row of q
    rows: jax.Array  # the item's rows; 0 for an item past the last


def schedule(cu_q_lens, kv_lengths, num_seqs, plan: RaggedPlan) -> Items:
    """The work items of a ragged batch (module docstring). Entries at or past ``num_seqs[0]``
    are never read; lengths are clipped to the table, ``cu_q_lens`` to ``[0, num_tokens]``."""
    s, t, size = plan.max_seqs, plan.num_tokens, plan.item_rows
    n = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, s)
    seq_real = jnp.arange(s) < n
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, t)
    starts, ends = cu[:s], jnp.maximum(cu[1:s + 1], cu[:s])
    q_lens = jnp.where(seq_real, ends - starts, 0)
    lengths = jnp.where(seq_real, jnp.clip(kv_lengths.astype(jnp.int32), 0, plan.max_len), 0)
    if plan.zero_padding:  # the rows past the last sequence's: one more sequence, of no keys
        total = jnp.max(jnp.where(seq_real, ends, 0))
        starts, q_lens = jnp.append(starts, total), jnp.append(q_lens, t - total)
        lengths = jnp.append(lengths, 0)
    count = div_up(q_lens, size)
    last = jnp.cumsum(count)  # one past each sequence's last item
    w = jnp.arange(plan.items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(last, w, side="right"), q_lens.shape[0] - 1).astype(jnp.int32)
    item_real = w < last[-1]
    j0 = jnp.where(item_real, (w - (last[seq] - count[seq])) * size, 0)
    q_len = jnp.where(item_real, q_lens[seq], 0)
    return Items(jnp.minimum(seq, s - 1), jnp.where(item_real, lengths[seq], 0), q_len, j0,
                 jnp.clip(starts[seq] + j0, 0, t), jnp.clip(q_len - j0, 0, size))


def item_tokens(items: Items, plan: RaggedPlan):
    """``(tokens, real)``, ``[items, block_q]`` each, of one-tile items (``sub_tiles`` 1): the
    row of q each item row reads (clipped to q) and whether it is a row of the item."""
    i = jnp.arange(plan.block_q, dtype=jnp.int32)
    return (jnp.minimum(items.first[:, None] + i, plan.num_tokens - 1),
            i < items.rows[:, None])


def _tile_sources(items: Items, plan: RaggedPlan):
    """``((token, head), real)``, ``[items, hk, rows_pad]`` each: the row and query head of ``q``
    each tile row reads, as ``kernel_src.paged.plan.to_rows`` lays a tile out, and whether it is
    a row of a sequence."""
    rows = jnp.arange(plan.rows_pad, dtype=jnp.int32)
    g, i = row_index(rows, plan)
    i = jnp.minimum(i, plan.block_q - 1)  # padded rows past the group's: any in-range row
    heads = jnp.arange(plan.num_kv_heads, dtype=jnp.int32)[:, None] * plan.group + g
    item_rows, item_real = item_tokens(items, plan)
    tokens = jnp.broadcast_to(item_rows[:, None, i], (item_rows.shape[0], *heads.shape))
    real = item_real[:, None, i] & (rows < plan.rows)
    return (tokens, jnp.broadcast_to(heads, tokens.shape)), jnp.broadcast_to(real, tokens.shape)


def gather_tiles(q: jax.Array, items: Items, plan: RaggedPlan) -> jax.Array:
    """``q [num_tokens, hq, d]`` as the items' tiles ``[items, hk, rows_pad, d]`` (the paged
    kernels' ``to_rows`` layout) in one gather; zeros where no row of a sequence is, so a NaN in
    a padding row of ``q`` is never read by a kernel."""
    source, real = _tile_sources(items, plan)
    rows = q[source]
    return jnp.where(real[..., None], rows, jnp.zeros((), q.dtype))


def scatter_tiles(tiles: jax.Array, items: Items, plan: RaggedPlan) -> jax.Array:
    """The inverse of ``gather_tiles`` in one gather: ``[items, hk, rows_pad, d]`` to
    ``[num_tokens, hq, d]``, zeros on rows of no sequence (each real row belongs to exactly one
    item and row of it)."""
    t, bq = plan.num_tokens, plan.block_q
    tokens, item_real = item_tokens(items, plan)
    rows = jnp.where(item_real, tokens, t).reshape(-1)  # past the end: dropped
    w = jnp.broadcast_to(jnp.arange(item_real.shape[0], dtype=jnp.int32)[:, None], item_real.shape)
    item = jnp.zeros(t, jnp.int32).at[rows].set(w.reshape(-1), mode="drop")
    i = jnp.zeros(t, jnp.int32).at[rows].set(jnp.tile(jnp.arange(bq, dtype=jnp.int32), w.shape[0]),
                                             mode="drop")
    real = jnp.zeros(t, bool).at[rows].set(True, mode="drop")
    h = jnp.arange(plan.num_q_heads, dtype=jnp.int32)
    out = tiles[item[:, None], (h // plan.group)[None], (h % plan.group) * bq + i[:, None]]
    return jnp.where(real[:, None, None], out, jnp.zeros((), tiles.dtype))


def key_range(length, q_len, j0, plan: RaggedPlan, rows: int | None = None):
    """``(start, end)``: the keys any row of an item may see (module docstring), or of its
    ``rows`` rows from ``j0`` (a sub-tile: ``block_q``); ``end <= start`` when it sees none."""
    first = length - q_len + j0  # the item's first row's position
    last = first + jnp.minimum(q_len - j0, rows or plan.item_rows) - 1
    left, right = plan.window if plan.window is not None else (None, None)
    start = jnp.zeros_like(length) if left is None else jnp.maximum(first - left, 0)
    end = length
    if plan.causal:
        end = jnp.minimum(end, last + 1)
    elif right is not None:
        end = jnp.minimum(end, last + right + 1)
    return start, end


def visible(rows, keys, length, q_len, j0, plan: RaggedPlan):
    """Whether tile rows ``rows`` see keys ``keys`` (int32 arrays broadcasting together) of an
    item (``length``, ``q_len``, ``j0``): the length, bottom-right causal, the window; a padded
    row, or one past the sequence's rows, sees nothing."""
    _, i = row_index(rows, plan)
    position = length - q_len + j0 + i
    ok = (keys < length) & (rows < plan.rows) & (j0 + i < q_len)
    if plan.causal:
        ok = ok & (keys <= position)
    if plan.window is not None:
        left, right = plan.window
        if left is not None:
            ok = ok & (keys >= position - left)
        if right is not None:
            ok = ok & (keys <= position + right)
    return ok


def dequantize(x: jax.Array, scale, dtype) -> jax.Array:
    """Stored keys or values as ``dtype``: ``float32(x) * scale`` rounded to it where ``scale``
    is given (a quantized pool), else ``x`` as it is."""
    if scale is None:
        return x
    return contract.dequantize(x, scale).astype(dtype)

