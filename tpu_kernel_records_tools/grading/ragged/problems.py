"""The ragged rubric's problems: one call's rows, pool, page table, per-sequence arrays and flags
(``RaggedProblem``, with the float64 truth and the ragged reference's result computed on demand), and ``draw``,
which lays a pool out at a slot (``grading.ragged.slots``) the way an engine's step looks.

Layout of a drawn call: the real sequences' pages as the paged rubric lays them out (``grading.paged.problems.
layout``: distinct random pages of a pool 3-4 times larger, shared prefixes, NaN on every slot no key is on,
trailing table entries at NaN pages and page 0); every padding row of ``q`` (past ``cu_q_lens[num_seqs]``) NaN;
``kv_lengths``, ``page_indices`` rows and ``cu_q_lens`` entries past ``num_seqs`` random in range (``cu_q_lens``
unsorted). A quantized pool (``quantize``) stores values near its type's range with scales far from 1; where its
type has no NaN or Inf, the slots no key is on hold its extremes.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ...grading.dense.slots import SHORT
from ...grading.paged.problems import garbage as float_garbage
from ...grading.paged.problems import PagedProblem, layout
from ...grading.ragged import truth as ragged_oracle
from ...grading.ragged.known_bad import ragged_reference
from ...grading.ragged.slots import RaggedSlot

FILLS = ("nan", "inf", "huge")  # what slots no key is on and padding rows hold
QUANTIZED = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0), "int8": (np.int8, 127.0)}  # dtype, largest value


def garbage(kind: str, shape: tuple[int, ...], rng: np.random.Generator, dtype) -> np.ndarray:
    """Values of ``kind`` (``FILLS``) in ``dtype``; a quantized dtype without NaN or Inf gets its extremes."""
    dtype = np.dtype(dtype)
    name = dtype.name
    if name not in QUANTIZED:
        return float_garbage(kind, shape, rng).astype(dtype)
    largest = QUANTIZED[name][1]
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if name == "float8_e4m3fn" and kind == "nan":
        return np.full(shape, np.nan, np.float32).astype(dtype)
    return np.where(sign < 0, -largest - (name == "int8"), largest).astype(dtype)


def graded_rows(cu_q_lens: np.ndarray, num_seqs: np.ndarray, num_tokens: int) -> np.ndarray:
    """Bool ``[num_tokens]``: the rows a sequence ``i < num_seqs[0]`` owns."""
    return np.arange(num_tokens) < int(cu_q_lens[int(num_seqs[0])])


class RaggedProblem:
    """One ragged call. ``q`` ``[num_tokens, num_q_heads, head_dim]`` in the slot's dtype; ``k_pages``/``v_pages``
    ``[num_pages, page_size, num_kv_heads, head_dim]`` in the pool's (q's, or quantized with ``k_scale``,
    ``v_scale``: floats, sent as 0-d float32 arrays when ``scale_arrays``); ``lengths`` int32 ``[max_seqs]``,
    ``table`` int32 ``[max_seqs, pages_per_sequence]``, ``cu`` int32 ``[max_seqs + 1]``, ``num_seqs`` int32
    ``[1]``; ``holds`` bool ``[num_pages, page_size]``: the slots a real sequence's key is on. Features, None when
    unused: ``window``, ``softcap``, ``sinks`` (float32 ``[num_q_heads]``). ``truth``: the float64 oracle;
    ``baseline``: ``(out,)`` of the ragged reference."""

    FIELDS = ("q", "k_pages", "v_pages", "lengths", "table", "cu", "num_seqs", "holds")
    FLAGS = ("causal", "scale", "window", "softcap", "sinks", "k_scale", "v_scale", "scale_arrays")

    def __init__(self, label: str, slot: RaggedSlot, q, k_pages, v_pages, lengths, table, cu, num_seqs, holds, *,
                 causal: bool = True, scale: float | None = None, window=None, softcap: float | None = None,
                 sinks=None, k_scale: float | None = None, v_scale: float | None = None, scale_arrays: bool = False):
        self.label, self.slot, self.dtype = label, slot, slot.dtype
        self.q = np.asarray(q).astype(np.dtype(jnp.dtype(slot.dtype)), copy=False)
        self.k_pages, self.v_pages = np.asarray(k_pages), np.asarray(v_pages)
        self.lengths, self.table = np.asarray(lengths, np.int32), np.asarray(table, np.int32)
        self.cu, self.num_seqs = np.asarray(cu, np.int32), np.asarray(num_seqs, np.int32)
        self.holds = np.asarray(holds, bool)
        self.causal, self.scale = bool(causal), None if scale is None else float(scale)
        self.window = None if window is None else tuple(window)
        self.softcap = None if softcap is None else float(softcap)
        self.sinks = None if sinks is None else np.asarray(sinks, np.float32)
        self.k_scale = None if k_scale is None else float(k_scale)
        self.v_scale = None if v_scale is None else float(v_scale)
        self.scale_arrays = bool(scale_arrays)
        self.graded = graded_rows(self.cu, self.num_seqs, self.q.shape[0])
        self.derived = False  # a changed copy of another problem, judged against it (not a fresh draw)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def features(self) -> dict:
        """The feature arguments this problem uses, as the contract names them."""
        as_scale = (lambda x: np.float32(x)) if self.scale_arrays else (lambda x: x)
        found = {"window_size": self.window, "softcap": self.softcap, "sinks": self.sinks,
                 "k_scale": None if self.k_scale is None else as_scale(self.k_scale),
                 "v_scale": None if self.v_scale is None else as_scale(self.v_scale)}
        return {n: x for n, x in found.items() if x is not None}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the call by its argument's name, q and the pools first."""
        return {"q": self.q, "k_pages": self.k_pages, "v_pages": self.v_pages, "kv_lengths": self.lengths,
                "page_indices": self.table, "cu_q_lens": self.cu, "num_seqs": self.num_seqs,
                **{n: np.asarray(x) for n, x in self.features.items() if isinstance(x, (np.ndarray, np.floating))}}

    @property
    def static(self) -> dict:
        """The call's other keyword arguments (flags, floats, the window)."""
        return {"causal": self.causal, "scale": self.scale,
                **{n: x for n, x in self.features.items() if not isinstance(x, (np.ndarray, np.floating))}}

    @property
    def kwargs(self) -> dict:
        """The candidate's keyword arguments after q, k_pages, v_pages (JAX arrays where the call has arrays)."""
        arrays = {n: jnp.asarray(x) for n, x in list(self.arrays.items())[3:]}
        return {**arrays, **self.static}

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def replace(self, label: str, *, derived: bool = True, **changes) -> "RaggedProblem":
        """A copy with some fields (``FIELDS``, ``FLAGS``) replaced (``derived``: judged against this problem)."""
        args = [changes.pop(n, getattr(self, n)) for n in self.FIELDS]
        flags = {n: changes.pop(n, getattr(self, n)) for n in self.FLAGS}
        if changes:
            raise TypeError(f"unknown problem fields {sorted(changes)}")
        p = RaggedProblem(label, self.slot, *args, **flags)
        p.derived = derived
        return p

    def refilled(self, kind: str, rng: np.random.Generator) -> "RaggedProblem":
        """The same keys with every pool slot that holds none refilled with ``kind`` (``FILLS``)."""
        junk = ~self.holds[:, :, None, None]
        k, v = (np.where(junk, garbage(kind, x.shape, rng, x.dtype), x) for x in (self.k_pages, self.v_pages))
        return self.replace(f"{self.label} pool garbage={kind}", k_pages=k, v_pages=v)

    def padded_with(self, kind: str, rng: np.random.Generator) -> "RaggedProblem":
        """Every padding row of ``q`` refilled with ``kind``."""
        q = self.q.copy()
        q[~self.graded] = garbage(kind, q[~self.graded].shape, rng, np.float32).astype(q.dtype)
        return self.replace(f"{self.label} padding rows={kind}", q=q)

    def regarbaged(self, rng: np.random.Generator) -> "RaggedProblem":
        """``kv_lengths`` and ``page_indices`` at or after ``num_seqs`` and ``cu_q_lens`` after it redrawn in range
        (unsorted offsets that land inside the real rows)."""
        n, full = int(self.num_seqs[0]), self.slot.page_size * self.slot.pages_per_sequence
        lengths, table, cu = self.lengths.copy(), self.table.copy(), self.cu.copy()
        lengths[n:] = rng.integers(0, full + 1, len(lengths) - n)
        table[n:] = rng.integers(0, self.k_pages.shape[0], table[n:].shape)
        cu[n + 1:] = rng.integers(0, self.q.shape[0] + 1, len(cu) - n - 1)
        return self.replace(f"{self.label} arrays past num_seqs redrawn", lengths=lengths, table=table, cu=cu)

    def retabled(self, rng: np.random.Generator) -> "RaggedProblem":
        """The table's entries past each real sequence's last page re-pointed: at page 0 now a page with no key,
        the others at page 0."""
        table, ps = self.table.copy(), self.slot.page_size
        empty = np.flatnonzero(~self.holds.any(axis=1))
        for i in range(int(self.num_seqs[0])):
            for c in range(-(-int(self.lengths[i]) // ps), table.shape[1]):
                table[i, c] = rng.choice(empty) if table[i, c] == 0 and len(empty) else 0
        return self.replace(f"{self.label} trailing entries re-pointed", table=table)

    permuted = PagedProblem.permuted  # the pool permuted and the whole table alike (the same fields by name)

    @functools.cached_property
    def truth(self) -> ragged_oracle.RaggedTruth:
        return ragged_oracle.ragged_paged_attention(
            self.q, self.k_pages, self.v_pages, kv_lengths=self.lengths, page_indices=self.table, cu_q_lens=self.cu,
            num_seqs=self.num_seqs, scale=self.scale, causal=self.causal, window=self.window, softcap=self.softcap,
            sinks=self.sinks, k_scale=self.k_scale, v_scale=self.v_scale)

    @functools.cached_property
    def baseline(self) -> tuple[np.ndarray]:
        """``(out,)``: the ragged reference's output (``grading.ragged.known_bad.ragged_reference``)."""
        return (np.asarray(ragged_reference(jnp.asarray(self.q), jnp.asarray(self.k_pages), jnp.asarray(self.v_pages),
                                            **self.kwargs)),)

    @property
    def logit_max(self) -> float:
        return self.truth.logit_max

    def prepare(self) -> None:
        """Compute the truth and the baseline now (while the candidate's worker computes)."""
        self.truth, self.baseline  # noqa: B018  (cached properties)


def quantize(rng: np.random.Generator, values: np.ndarray, dtype: str) -> tuple[np.ndarray, float]:
    """``(stored, scale)``: N(0, 1) ``values`` stored in a quantized ``dtype`` (``QUANTIZED``) spread near its
    range (a few at its largest magnitude), and the float32 scale that dequantizes them back to about N(0, 1)."""
    np_dtype, largest = QUANTIZED[dtype]
    stored = np.clip(values * largest / 3.0, -largest, largest)
    flat = stored.reshape(-1)
    flat[rng.choice(flat.size, min(flat.size, 8), replace=False)] = largest * rng.choice([-1.0, 1.0], min(flat.size, 8))
    stored = np.round(stored) if dtype == "int8" else stored
    return stored.astype(np_dtype), float(np.float32(3.0 / largest))


def _shown(xs) -> str:
    xs = [int(x) for x in xs]
    return str(xs) if len(xs) <= 12 else f"{len(xs)} in [{min(xs)}, {max(xs)}]"


def draw(rng: np.random.Generator, slot: RaggedSlot, *, tag: str = "", causal: bool = True, scale: float | None = None,
         window=None,
         softcap: float | None = None, q_boost: float = 1.0, sinks=None, quantized: str | None = None,
         value_scales: tuple[float, float] = (1.0, 1.0), scale_arrays: bool = False) -> RaggedProblem:
    """A call at ``slot`` (module docstring): N(0, 1) q (times ``q_boost``) and keys; ``quantized`` (a key of
    ``QUANTIZED``) stores the pool in that dtype with k_scale, v_scale times ``value_scales``."""
    n, full = slot.num_seqs, slot.page_size * slot.pages_per_sequence
    real_table, holds = layout(rng, slot.paged)
    table = rng.integers(0, slot.num_pages, (slot.max_seqs, slot.pages_per_sequence)).astype(np.int32)
    table[:n] = real_table
    lengths = rng.integers(0, full + 1, slot.max_seqs).astype(np.int32)
    lengths[:n] = slot.kv_lens
    cu = rng.integers(0, slot.num_tokens + 1, slot.max_seqs + 1).astype(np.int32)
    cu[:n + 1] = np.concatenate([[0], np.cumsum(slot.q_lens)])
    shape = (slot.num_pages, slot.page_size, slot.num_kv_heads, slot.head_dim)
    pools, scales = [], []
    for factor in value_scales:
        values = rng.standard_normal((int(holds.sum()), *shape[2:]), np.float32)
        if quantized is None:
            pool = np.full(shape, np.nan, np.dtype(jnp.dtype(slot.dtype)))
            pool[holds] = values.astype(pool.dtype)
            scales.append(None)
        else:
            stored, scale = quantize(rng, values, quantized)
            pool = garbage("nan", shape, rng, stored.dtype)
            pool[holds] = stored
            scales.append(float(np.float32(scale * factor)))
        pools.append(pool)
    q = rng.standard_normal((slot.num_tokens, slot.num_q_heads, slot.head_dim), np.float32) * q_boost
    q[int(cu[n]):] = np.nan
    flags = [f for f, on in (("causal", causal), (f"scale={scale}", scale is not None),
                             (f"window={window}", window is not None),
                             (f"softcap={softcap:g}" if softcap else "", softcap is not None),
                             ("sinks", sinks is not None),
                             (f"{quantized} k_scale={scales[0]:.3g} v_scale={scales[1]:.3g}" if quantized else "",
                              quantized is not None)) if on]
    label = (f"{slot.describe()} {SHORT[slot.dtype]} {'+'.join(flags) or 'not causal'} q_lens={_shown(slot.q_lens)} "
             f"kv_lens={_shown(slot.kv_lens)}{' ' + tag if tag else ''}")
    return RaggedProblem(label, slot, q, *pools, lengths, table, cu, np.array([n], np.int32), holds, causal=causal,
                         scale=scale, window=window, softcap=softcap, sinks=sinks, k_scale=scales[0], v_scale=scales[1],
                         scale_arrays=scale_arrays)
