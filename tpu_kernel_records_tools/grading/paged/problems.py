"""The paged rubric's problems: one call's pool, page table, lengths and flags (``PagedProblem``, with the
float64 truth and the paged reference's result computed on demand), and ``draw``, which lays a pool out at
a slot (``grading.paged.slots``) the way a serving engine's pool looks after a while.

Layout of a drawn pool: each sequence's pages are distinct pages drawn at random from a pool 3-4 times
larger than needed (permuted, non-contiguous), some sequences share their leading pages with another's
(prefix caching: the shared pages are whole pages of the sequence they come from), every slot that holds
no key of any sequence, and every page no sequence uses, is NaN (``fill``), and the table's entries past a
sequence's last page point at NaN pages (always the first of them, so a kernel that reads one page too
many meets NaN) and at page 0.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ...grading.paged import truth as paged_oracle
from ...grading.paged.known_bad import paged_reference
from ...grading.paged.slots import INDEX_LIMIT, PagedSlot
from ...grading.dense.slots import SHORT
from ...sandbox.cpu_jit import device_array

FILLS = ("nan", "inf", "huge")  # what the slots no sequence reads hold: NaN, +-Inf, +-1e38


def garbage(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float32 values of ``kind`` (``FILLS``) for slots no key is on; signs drawn at random."""
    if kind == "nan":
        return np.full(shape, np.nan, np.float32)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
    if kind == "inf":
        return sign * np.float32(np.inf)
    if kind == "huge":
        return sign * np.float32(1e38)
    raise ValueError(f"unknown fill {kind!r}: one of {FILLS}")


class PagedProblem:
    """One paged call. ``q`` ``[batch, q_len, num_q_heads, head_dim]``, ``k_pages``/``v_pages`` ``[num_pages,
    page_size, num_kv_heads, head_dim]`` (NumPy, in ``dtype``), ``lengths`` int32 ``[batch]``, ``table`` int32
    ``[batch, pages_per_sequence]``; ``holds`` bool ``[num_pages, page_size]``: the slots that hold a key of
    some sequence (everything else is garbage). Features, None when unused: ``window``, ``softcap``,
    ``sinks`` (float32 ``[num_q_heads]``). ``truth``: the float64 oracle; ``baseline``: ``(out,)`` of the
    paged reference."""

    def __init__(self, label: str, slot: PagedSlot, q, k_pages, v_pages, lengths, table, holds, *, causal: bool,
                 scale: float | None = None, window=None, softcap: float | None = None, sinks=None):
        self.label, self.slot, self.dtype = label, slot, slot.dtype
        np_dtype = np.dtype(jnp.dtype(slot.dtype))
        self.q, self.k_pages, self.v_pages = (np.asarray(x).astype(np_dtype, copy=False) for x in (q, k_pages, v_pages))
        self.lengths = np.asarray(lengths, np.int32)
        self.table = np.asarray(table, np.int32)
        self.holds = np.asarray(holds, bool)
        self.causal, self.scale = bool(causal), None if scale is None else float(scale)
        self.window = None if window is None else tuple(window)
        self.softcap = None if softcap is None else float(softcap)
        self.sinks = None if sinks is None else np.asarray(sinks, np.float32)
        self.derived = False  # a changed copy of another problem, judged against it (not a fresh draw)

    @property
    def features(self) -> dict:
        """The feature arguments this problem uses, as the contract names them."""
        found = {"window_size": self.window, "softcap": self.softcap, "sinks": self.sinks}
        return {n: x for n, x in found.items() if x is not None}

    @property
    def kwargs(self) -> dict:
        """The candidate's keyword arguments (JAX arrays), only the features this problem uses."""
        return {"kv_lengths": device_array(self.lengths), "page_indices": device_array(self.table),
                "causal": self.causal, "scale": self.scale,
                **{n: device_array(x) if isinstance(x, np.ndarray) else x for n, x in self.features.items()}}

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def replace(self, label: str, *, derived: bool = True, **changes) -> "PagedProblem":
        """A copy with some of q, k_pages, v_pages, lengths, table, holds, causal, window, softcap, sinks
        replaced (``derived``: judged against this problem, not a fresh draw)."""
        names = ("q", "k_pages", "v_pages", "lengths", "table", "holds")
        args = [changes.pop(n, getattr(self, n)) for n in names]
        flags = {n: changes.pop(n, getattr(self, n)) for n in ("causal", "scale", "window", "softcap", "sinks")}
        if changes:
            raise TypeError(f"unknown problem fields {sorted(changes)}")
        p = PagedProblem(label, self.slot, *args, **flags)
        p.derived = derived
        return p

    def refilled(self, kind: str, rng: np.random.Generator) -> "PagedProblem":
        """The same keys with every slot that holds none refilled with ``kind`` (``FILLS``)."""
        dtype = self.k_pages.dtype
        junk = ~self.holds[:, :, None, None]
        k = np.where(junk, garbage(kind, self.k_pages.shape, rng).astype(dtype), self.k_pages)
        v = np.where(junk, garbage(kind, self.v_pages.shape, rng).astype(dtype), self.v_pages)
        return self.replace(f"{self.label} garbage={kind}", k_pages=k, v_pages=v)

    def retabled(self, rng: np.random.Generator) -> "PagedProblem":
        """The table's entries past each sequence's last page swapped in kind: those at page 0 now point at
        NaN pages, the others at page 0."""
        table = self.table.copy()
        empty = np.flatnonzero(~self.holds.any(axis=1))
        for b, n in enumerate(self.lengths):
            for c in range(-(-int(n) // self.slot.page_size), table.shape[1]):
                table[b, c] = rng.choice(empty) if table[b, c] == 0 and len(empty) else 0
        return self.replace(f"{self.label} trailing entries re-pointed", table=table)

    def permuted(self, rng: np.random.Generator) -> "PagedProblem":
        """The pool permuted and the table (trailing entries included) permuted alike: page ``i`` moves to
        ``perm[i]``."""
        perm = rng.permutation(self.k_pages.shape[0])
        k, v, holds = (np.empty_like(x) for x in (self.k_pages, self.v_pages, self.holds))
        k[perm], v[perm], holds[perm] = self.k_pages, self.v_pages, self.holds
        return self.replace(f"{self.label} pool permuted", k_pages=k, v_pages=v, holds=holds,
                            table=perm[self.table].astype(np.int32))

    @functools.cached_property
    def truth(self) -> paged_oracle.PagedTruth:
        return paged_oracle.paged_attention(self.q, self.k_pages, self.v_pages, kv_lengths=self.lengths,
                                            page_indices=self.table, scale=self.scale, causal=self.causal,
                                            window=self.window, softcap=self.softcap, sinks=self.sinks)

    @functools.cached_property
    def baseline(self) -> tuple[np.ndarray]:
        """``(out,)``: the paged reference's output (``grading.paged.known_bad.paged_reference``)."""
        arrays = (device_array(self.q), device_array(self.k_pages), device_array(self.v_pages))
        return (np.asarray(paged_reference(*arrays, **self.kwargs)),)

    @property
    def logit_max(self) -> float:
        return self.truth.logit_max

    def prepare(self) -> None:
        """Compute the truth and the baseline now (while the candidate's worker computes)."""
        self.truth, self.baseline  # noqa: B018  (cached properties)


def layout(rng: np.random.Generator, slot: PagedSlot) -> tuple[np.ndarray, np.ndarray]:
    """``(table, holds)`` of a pool laid out at ``slot`` (module docstring): int32 ``[batch,
    pages_per_sequence]`` and bool ``[num_pages, page_size]``."""
    ps, pps, n = slot.page_size, slot.pages_per_sequence, slot.num_pages
    lengths = np.asarray(slot.lengths)
    used = -(-lengths // ps)
    table = np.full((slot.batch, pps), -1, np.int64)
    free = list(rng.permutation(n))
    for b in rng.permutation(slot.batch):  # some sequences open with another's whole pages (a shared prefix)
        donors = [a for a in range(slot.batch) if a != b and table[a, 0] >= 0 and lengths[a] >= ps]
        shared = 0
        if donors and used[b] >= 1 and rng.random() < 0.3:
            a = int(rng.choice(donors))
            shared = int(rng.integers(1, min(lengths[a] // ps, used[b]) + 1))
            table[b, :shared] = table[a, :shared]
        for c in range(shared, used[b]):
            table[b, c] = free.pop()
    if n > INDEX_LIMIT:  # every sequence of such a pool reads a page past 2^15
        for b in range(slot.batch):
            high = [p for p in free if p >= INDEX_LIMIT]
            if used[b] and table[b, :used[b]].max() < INDEX_LIMIT and high:
                table[b, used[b] - 1] = high[0]
                free.remove(high[0])
    holds = np.zeros((n, ps), bool)
    for b in range(slot.batch):
        slots = np.arange(lengths[b])
        holds[table[b, slots // ps], slots % ps] = True
    empty = np.flatnonzero(~holds.any(axis=1))
    for b in range(slot.batch):  # past the last page: first a NaN page, then NaN pages and page 0
        for c in range(used[b], pps):
            table[b, c] = rng.choice(empty) if c == used[b] or rng.random() < 0.5 else 0
    return table.astype(np.int32), holds


def draw(rng: np.random.Generator, slot: PagedSlot, *, tag: str = "", fill: str = "nan", causal: bool | None = None,
         window=None, softcap: float | None = None, q_boost: float = 1.0, sinks=None) -> PagedProblem:
    """A problem at ``slot``: N(0, 1) q (times ``q_boost``) and keys on the slots that hold one, ``fill`` on
    every other slot of the pool; ``causal`` (default: the slot's) and features as given."""
    table, holds = layout(rng, slot)
    shape = (slot.num_pages, slot.page_size, slot.num_kv_heads, slot.head_dim)
    dtype = np.dtype(jnp.dtype(slot.dtype))
    k, v = (np.full(shape, np.nan, dtype) for _ in range(2))
    count = int(holds.sum())
    k[holds] = rng.standard_normal((count, *shape[2:]), np.float32).astype(dtype)
    v[holds] = rng.standard_normal((count, *shape[2:]), np.float32).astype(dtype)
    q = rng.standard_normal((slot.batch, slot.q_len, slot.num_q_heads, slot.head_dim), np.float32) * q_boost
    causal = slot.causal if causal is None else causal
    lengths = list(slot.lengths)
    shown = (f"kv_lengths={lengths}" if len(lengths) <= 12 else
             f"{len(lengths)} kv_lengths in [{min(lengths)}, {max(lengths)}]")
    flags = [f for f, on in (("causal", causal), (f"window={window}", window is not None),
                             (f"softcap={softcap:g}" if softcap else "", softcap is not None),
                             ("sinks", sinks is not None)) if on]
    label = f"{slot.describe()} {SHORT[slot.dtype]} {'+'.join(flags) or 'not causal'} {shown}{' ' + tag if tag else ''}"
    p = PagedProblem(label, slot, q, k, v, slot.lengths, table, holds, causal=causal, scale=slot.scale, window=window,
                     softcap=softcap, sinks=sinks)
    return p if fill == "nan" else p.refilled(fill, rng).replace(p.label + f" garbage={fill}", derived=False)
