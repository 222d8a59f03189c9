"""How a Mosaic kernel reads and writes one head of a block, in each ``plan.Layout``.

Mosaic of jax < 0.7 (libtpu 0.0.17) cannot take one head out of a 16-bit ``(rows, heads, d)``
block for a matmul: ``ref[:, h, :]`` fails "infer-vector-layout: unsupported shape cast",
``ref[:, pl.ds(h, 1), :]`` reshaped (through fp32 or not) "unsupported implicit dim change", a
value slice aborts the compiler and a DMA of ``ref.at[:, h, :]`` fails verification. There the
kernels take the free view ``[batch, seq * heads, d]`` (layout "rows", ``plan.Layout``): head
``h`` of a ``(rows * heads, d)`` block is every ``heads``-th row from row ``h``, a strided load,
which that Mosaic has for 32-bit data only. A 16-bit block is therefore copied once into a
32-bit scratch (``pltpu.bitcast``: row pair ``2p, 2p + 1`` becomes one word, row ``2p`` in its
low half), where heads ``2m`` and ``2m + 1`` share the strided rows ``m, m + heads / 2, ...``;
a head is its half of each word, widened to fp32 exactly. Outputs go back the same way.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src.flash.plan import F32, Plan

WORD = jnp.uint32
_HIGH_HALF = 0xFFFF0000


class Heads:
    """The heads of one block: ``(rows, heads, d)``, ``(rows, heads * d)`` (layout "flat") or
    ``(rows * heads, d)`` (layout "rows", with ``words``, its 32-bit scratch, in 16 bits)."""

    def __init__(self, ref, heads: int, plan: Plan, words=None):
        self.ref, self.heads, self.plan, self.words = ref, heads, plan, words

    @property
    def rows(self) -> int:
        """Sequence rows of the block."""
        return self.ref.shape[0] // (self.heads if self.plan.layout == "rows" else 1)

    def copy_words(self) -> None:
        """Refresh the 32-bit copy (layout "rows", 16 bits) after a new block arrives."""
        if self.words is not None and self.heads > 1:  # one head is the whole block
            self.words[...] = pltpu.bitcast(self.ref[...], WORD)

    def load(self, h: int) -> jax.Array:
        """Head ``h`` as ``[rows, d]`` in the block's dtype."""
        ref, layout, heads = self.ref, self.plan.layout, self.heads
        if layout == "heads":
            return ref[:, h, :]
        if layout == "flat":
            d = self.plan.flat_head_dim
            return ref[:, h * d:(h + 1) * d]
        if heads == 1:
            return ref[...]
        if self.words is None:
            return ref[pl.ds(h, self.rows, stride=heads), :]
        word = self.words[pl.ds(h // 2, self.rows, stride=heads // 2), :]
        half = word & WORD(_HIGH_HALF) if h % 2 else word << 16
        return pltpu.bitcast(half, F32).astype(ref.dtype)

    def store(self, value_of: Callable[[int], jax.Array]) -> None:
        """Write every head ``h`` as ``value_of(h)`` (fp32 ``[rows, d]``), in the block's dtype."""
        ref, heads = self.ref, self.heads
        if self.words is None or heads == 1:
            for h in range(heads):
                self._put(h, value_of(h).astype(ref.dtype))
            return
        for m in range(heads // 2):
            low, high = (pltpu.bitcast(value_of(h).astype(ref.dtype).astype(F32), WORD)
                         for h in (2 * m, 2 * m + 1))
            self.words[pl.ds(m, self.rows, stride=heads // 2), :] = (
                (high & WORD(_HIGH_HALF)) | (low >> 16))
        ref[...] = pltpu.bitcast(self.words[...], ref.dtype)

    def _put(self, h: int, value: jax.Array) -> None:
        """Write head ``h`` (``value`` in the block's dtype) where ``load(h)`` reads it."""
        ref, layout, heads = self.ref, self.plan.layout, self.heads
        if layout == "heads":
            ref[:, h, :] = value
        elif layout == "flat":
            d = self.plan.flat_head_dim
            ref[:, h * d:(h + 1) * d] = value
        elif heads == 1:
            ref[...] = value
        else:
            ref[pl.ds(h, self.rows, stride=heads), :] = value


def needs_words(plan: Plan, dtype) -> bool:
    """Whether blocks of ``dtype`` are read through a 32-bit copy (layout "rows", 16 bits)."""
    return plan.layout == "rows" and jnp.dtype(dtype).itemsize < 4
