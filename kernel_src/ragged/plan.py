"""What both ragged lowerings share: block sizes, the call's plan, the work list, the mask.

Work items. The ragged batch is cut, outside the kernels (XLA), into work items of at most
``block_q`` consecutive rows of one sequence: sequence ``i`` (of the first ``num_seqs[0]``) gives
``ceil(q_len_i / block_q)`` of them, an empty one none. Their number is bounded statically by
``ceil(num_tokens / block_q) + min(max_seqs, num_tokens)`` (``RaggedPlan.items``); the items past
the last real one have length 0 and compute nothing. Per item four int32 scalars describe it
(``Items``): its sequence (for the page table), the sequence's ``kv_length`` and ``q_len`` and
``j0``, the index of its first row among the sequence's new rows.

Rows. An item's rows are gathered from ``q`` into a ``[block_q, num_q_heads, head_dim]`` block
(rows of no sequence are zeros, so a NaN in a padding row of ``q`` is never read by a kernel),
which is the paged kernels' ``[batch, q_len, hq, d]`` with ``batch = items`` and ``q_len =
block_q``, laid out as ``kernel_src.paged.plan.to_rows`` lays it (one tile of ``group * block_q``
rows per kv head) by one gather (``gather_tiles``); the output comes back by one gather too
(``scatter_tiles``; rows of no sequence come out zeros). Row ``i`` of an item sits at position
``kv_length - q_len + j0 + i``.

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


@dataclasses.dataclass(frozen=True)
class RaggedBlockSizes(PagedBlockSizes):
    """``PagedBlockSizes``'s keys per step (Mosaic: pages per grid step; Triton: ``block_k`` keys
    per loop iteration) and the rows of one work item; they change speed, not results.

    Attributes:
      block_q: rows (new tokens) of one sequence per work item, >= 1. A decode row takes an
        item alone, so a large ``block_q`` pads decode batches; a small one re-reads a long
        prompt's pages once per item.
    """

    block_q: int = 16

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.block_q, int) or isinstance(self.block_q, bool) or self.block_q < 1:
            raise ValueError(f"block_q must be an int >= 1, got {self.block_q!r}")

    @classmethod
    def for_step(cls, platform: str, num_tokens: int, max_seqs: int) -> RaggedBlockSizes:
        """``for_platform``'s sizes for a call of ``num_tokens`` rows of q and ``max_seqs`` table
        rows. On TPU ``block_q`` is the tokens per sequence slot, ``num_tokens / max_seqs`` rounded
        up to a power of two in ``[16, 64]``: each decode row takes an item alone, so the padded
        tiles' traffic grows with ``block_q`` times the sequences, while a prompt's pages are read
        once per item (untuned). Elsewhere 16."""
        sizes = cls.for_platform(platform)
        if platform != "tpu":
            return sizes
        per_slot = -(-num_tokens // max(max_seqs, 1))
        return dataclasses.replace(sizes, block_q=min(64, max(16, 1 << (per_slot - 1).bit_length())))


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
    block_q: int
    rows_pad: int  # rows of a tile, padded (``paged.plan.tile_rows``)
    window: Window | None = None
    softcap: float | None = None
    sinks: bool = False
    quantized: bool = False

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
    def items(self) -> int:
        """The static number of work items: enough for any ragged batch of these sizes."""
        return -(-self.num_tokens // self.block_q) + min(self.max_seqs, self.num_tokens)


class Items(NamedTuple):
    """The work list, int32 ``[items]`` each (``schedule``), and the rows it covers."""

    seq: jax.Array  # the item's sequence (a row of the page table)
    length: jax.Array  # the sequence's kv_length; 0 for an item past the last
    q_len: jax.Array  # the sequence's new rows; 0 for an item past the last
    j0: jax.Array  # the item's first row among them
    tokens: jax.Array  # int32 [items, block_q]: the row of q each item row reads
    real: jax.Array  # bool [items, block_q]: whether it is a row of the sequence


def schedule(cu_q_lens, kv_lengths, num_seqs, plan: RaggedPlan) -> Items:
    """The work items of a ragged batch (module docstring). Entries at or past ``num_seqs[0]``
    are never read; lengths are clipped to the table, ``cu_q_lens`` to ``[0, num_tokens]``."""
    s, t, bq = plan.max_seqs, plan.num_tokens, plan.block_q
    n = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, s)
    seq_real = jnp.arange(s) < n
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, t)
    starts, ends = cu[:s], jnp.maximum(cu[1:s + 1], cu[:s])
    q_lens = jnp.where(seq_real, ends - starts, 0)
    lengths = jnp.where(seq_real, jnp.clip(kv_lengths.astype(jnp.int32), 0, plan.max_len), 0)
    last = jnp.cumsum(div_up(q_lens, bq))  # one past each sequence's last item
    w = jnp.arange(plan.items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(last, w, side="right"), s - 1).astype(jnp.int32)
    item_real = w < last[-1]
    j0 = (w - (last[seq] - div_up(q_lens[seq], bq))) * bq
    q_len = jnp.where(item_real, q_lens[seq], 0)
    j = j0[:, None] + jnp.arange(bq, dtype=jnp.int32)
    return Items(seq, jnp.where(item_real, lengths[seq], 0), q_len, jnp.where(item_real, j0, 0),
                 jnp.clip(starts[seq][:, None] + j, 0, t - 1), j < q_len[:, None])


def _tile_sources(items: Items, plan: RaggedPlan):
    """``((token, head), real)``, ``[items, hk, rows_pad]`` each: the row and query head of ``q``
    each tile row reads, as ``kernel_src.paged.plan.to_rows`` lays a tile out, and whether it is
    a row of a sequence."""
    rows = jnp.arange(plan.rows_pad, dtype=jnp.int32)
    g, i = row_index(rows, plan)
    i = jnp.minimum(i, plan.block_q - 1)  # padded rows past the group's: any in-range row
    heads = jnp.arange(plan.num_kv_heads, dtype=jnp.int32)[:, None] * plan.group + g
    tokens = jnp.broadcast_to(items.tokens[:, None, i], (items.tokens.shape[0], *heads.shape))
    real = items.real[:, None, i] & (rows < plan.rows)
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
    rows = jnp.where(items.real, items.tokens, t).reshape(-1)  # past the end: dropped
    w = jnp.broadcast_to(jnp.arange(items.real.shape[0], dtype=jnp.int32)[:, None], items.real.shape)
    item = jnp.zeros(t, jnp.int32).at[rows].set(w.reshape(-1), mode="drop")
    i = jnp.zeros(t, jnp.int32).at[rows].set(jnp.tile(jnp.arange(bq, dtype=jnp.int32), w.shape[0]),
                                             mode="drop")
    real = jnp.zeros(t, bool).at[rows].set(True, mode="drop")
    h = jnp.arange(plan.num_q_heads, dtype=jnp.int32)
    out = tiles[item[:, None], (h // plan.group)[None], (h % plan.group) * bq + i[:, None]]
    return jnp.where(real[:, None, None], out, jnp.zeros((), tiles.dtype))


def key_range(length, q_len, j0, plan: RaggedPlan):
    """``(start, end)``: the keys any row of an item may see (module docstring); ``end <= start``
    when it sees none."""
    first = length - q_len + j0  # the item's first row's position
    last = first + jnp.minimum(q_len - j0, plan.block_q) - 1
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

