"""What both paged lowerings share: block sizes, the call's plan, the row layout, the mask.

Rows. One kv head's whole group of query heads and all ``q_len`` new rows form one tile of
``group * q_len`` rows (``to_rows``): row ``r`` is query head ``r // q_len`` of the group and new
row ``i = r % q_len``, at position ``kv_lengths[b] - q_len + i``. ``q`` is tiny next to the cache
(decode), so this relayout and its inverse (``from_rows``) run in XLA around the kernels.
Rows are padded (``tile_rows``: a multiple of 8 for Mosaic's sublanes, a power of two >= 16
for Triton); a padded row sees no key.

Keys. Key ``j`` of sequence ``b`` is ``k_pages[page_indices[b, j // page_size], j % page_size]``
for ``j < kv_lengths[b]``. The keys any row may see are ``[first_key, length)``: ``first_key``
is 0, or with a left window bound the first row's ``position - left``. Kernels read only the
pages that hold those keys; slots past the length in the last page, and whatever else the pool
holds, may be NaN or Inf: logits there are replaced (``where``, never a multiply by a 0 mask)
and so are the V rows (``0 * NaN`` is NaN), so nothing they hold reaches the accumulator.

Numerics (``kernel_src.flash.plan``'s online softmax, reused): fp32 logits, soft-cap, running
max and sum and accumulator; probabilities rounded to the input dtype before ``P·V``; a sink
starts its rows' running max and sum; a row with no visible key gives exact zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernel_src import backend
from kernel_src.contract import Window
from kernel_src.flash.plan import next_power_of_two, round_up


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """How many keys one step of a paged kernel takes; they change speed, not results.

    Attributes:
      pages_per_step: Mosaic: pages DMA'd into VMEM per grid step (each K and V page one
        async copy, double-buffered). ``None``: ``keys_per_step // page_size`` (at least 1, at
        most ``max_pages_per_step``); compiled, fewer where VMEM is short. Never more than a
        sequence's table holds.
      keys_per_step: Mosaic: the keys a step aims at when ``pages_per_step`` is ``None``.
      max_pages_per_step: Mosaic: a cap on the aimed-at pages (None: none).
      block_k: Triton: keys gathered through the page table per loop iteration, a power of
        two >= 16.
    """

    pages_per_step: int | None = None
    keys_per_step: int = 512
    max_pages_per_step: int | None = None
    block_k: int = 64

    def __post_init__(self):
        for name in ("pages_per_step", "max_pages_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(self.keys_per_step, int) or self.keys_per_step <= 0:
            raise ValueError(f"keys_per_step must be a positive int, got {self.keys_per_step!r}")
        block_k = self.block_k
        if not isinstance(block_k, int) or block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {block_k!r}")

    @classmethod
    def for_platform(cls, platform: str | None = None) -> PagedBlockSizes:
        """Defaults for ``"tpu"``, ``"gpu"`` or ``"cpu"`` (the default backend's when ``None``).

        TPU: 512 keys per step (32 pages of 16, 4 of 128), untuned. GPU: 64 keys per
        iteration. CPU (interpret mode): up to 4,096 keys and 64 pages per Mosaic step. There
        each grid step costs about a copy of the pool, and each interpreted DMA a copy of the
        VMEM buffer (``pages x buffer`` per step), so the best step sits between: a bf16 decode,
        32/8 heads, head_dim 128, one sequence, on a busy 2-core machine: 32k keys in pages of
        16 about 1.5 s a call at 64 pages (1,024 keys) a step, 4 s at 4,096 keys, 29 s at
        16,384; 131k keys in pages of 128 about 4 s at 4,096 keys, 17 s at 1,024, 10 s at
        16,384. Triton: 4,096 keys per iteration (its gathers cost no more per key as blocks
        grow).
        """
        platform = platform or backend.platform()
        if platform == "tpu":
            return cls(keys_per_step=512, block_k=64)
        if platform == "gpu":
            return cls(keys_per_step=512, block_k=64)
        return cls(keys_per_step=4096, max_pages_per_step=64, block_k=4096)

    def pages(self, page_size: int, pages_per_sequence: int) -> int:
        """Pages per Mosaic step: the given or aimed-at count, at most the sequence's pages."""
        pages = self.pages_per_step
        if pages is None:
            pages = min(max(1, self.keys_per_step // page_size),
                        self.max_pages_per_step or pages_per_sequence)
        return max(1, min(pages, pages_per_sequence))


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """Static facts of one paged call: the problem's sizes, its features, how to lower."""

    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    num_pages: int
    causal: bool
    scale: float
    interpret: Any
    window: Window | None = None  # (left, right) keys around a row's position
    softcap: float | None = None  # logits become softcap * tanh(s / softcap)
    sinks: bool = False  # one sink logit per query head
    rows_pad: int = 8  # rows of a tile, padded (``tile_rows``)
    layout: str = "heads"  # Mosaic: how the K/V buffers hold the heads (``tpu.LAYOUTS``)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Real rows of one kv head's tile: its group's query heads times the new rows."""
        return self.group * self.q_len

    @property
    def max_len(self) -> int:
        """The most keys a sequence can hold: its table's pages, full."""
        return self.pages_per_sequence * self.page_size


def tile_rows(rows: int, family: str) -> int:
    """Rows of a tile holding ``rows`` real ones: a multiple of 8 (``"mosaic"``) or a power of
    two >= 16 (``"triton"``, whose blocks and ``dot`` need them)."""
    if family == "triton":
        return max(16, next_power_of_two(rows))
    return round_up(rows, 8)


def to_rows(q: jax.Array, num_kv_heads: int, rows_pad: int) -> jax.Array:
    """``[batch, q_len, hq, d]`` as ``[batch, hk, rows_pad, d]``: row ``g * q_len + i`` is query
    head ``kv_head * group + g`` at new row ``i``; rows past ``group * q_len`` are zeros."""
    batch, q_len, hq, d = q.shape
    group = hq // num_kv_heads
    rows = q.reshape(batch, q_len, num_kv_heads, group, d).transpose(0, 2, 3, 1, 4)
    rows = rows.reshape(batch, num_kv_heads, group * q_len, d)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, rows_pad - group * q_len), (0, 0)))


def from_rows(out: jax.Array, q_len: int, group: int) -> jax.Array:
    """The inverse of ``to_rows``: ``[batch, hk, rows_pad, d]`` back to ``[batch, q_len, hq, d]``."""
    batch, hk, _, d = out.shape
    out = out[:, :, :group * q_len].reshape(batch, hk, group, q_len, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, hk * group, d)


def clip_lengths(kv_lengths: jax.Array, plan: PagedPlan) -> jax.Array:
    """int32 lengths clipped to ``[0, pages_per_sequence * page_size]``."""
    return jnp.clip(kv_lengths.astype(jnp.int32), 0, plan.max_len)


def first_key(length, plan: PagedPlan):
    """The first key any real row of a sequence of ``length`` keys may see (every row sees
    nothing at or past ``length``): 0, or with a left window bound the first row's
    ``position - left`` (at least 0)."""
    left = plan.window[0] if plan.window is not None else None
    if left is None:
        return jnp.zeros_like(length)
    return jnp.maximum(length - plan.q_len - left, 0)


def div_up(x, d: int):
    """``ceil(x / d)`` for traced ``x >= 0`` (``lax.div``: Mosaic lowers ``//`` through sign())."""
    return lax.div(x + (d - 1), jnp.asarray(d, x.dtype))


def row_index(rows, plan: PagedPlan):
    """``(head, i)``: the group member and the new row of tile rows ``rows`` (an int32 iota),
    by compares (``rows % q_len`` without an integer vector division)."""
    head = jnp.zeros_like(rows)
    for g in range(1, plan.group):
        head = head + (rows >= g * plan.q_len).astype(rows.dtype)
    return head, rows - head * plan.q_len


def visible(rows, keys, length, plan: PagedPlan):
    """Whether tile rows ``rows`` see keys ``keys`` (int32 arrays broadcasting together) of a
    sequence of ``length`` keys: the length, bottom-right causal, the window; a padded row
    (``rows >= plan.rows``) sees nothing."""
    _, i = row_index(rows, plan)
    position = length - plan.q_len + i
    ok = (keys < length) & (rows < plan.rows)
    if plan.causal:
        ok = ok & (keys <= position)
    if plan.window is not None:
        left, right = plan.window
        if left is not None:
            ok = ok & (keys >= position - left)
        if right is not None:
            ok = ok & (keys <= position + right)
    return ok


def row_sinks(sink_of, kv_head, rows, plan: PagedPlan):
    """Initial running max and sum ``(m, l)`` of tile rows ``rows`` (an int32 iota, any shape)
    of kv head ``kv_head``: ``m`` the row's query head's sink (``sink_of(h)``, a scalar), ``l``
    1 (``exp(sink - m)``), or ``-inf`` and 0 for a sink of ``-inf``."""
    m = jnp.full(rows.shape, -jnp.inf, jnp.float32)
    for g in range(plan.group):
        mine = (rows >= g * plan.q_len) & (rows < (g + 1) * plan.q_len)
        m = jnp.where(mine, sink_of(kv_head * plan.group + g).astype(jnp.float32), m)
    return m, jnp.where(m == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
