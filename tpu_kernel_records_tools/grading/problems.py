"""The rubric's problems: inputs and flags of one candidate call (``Problem``, with the float64 truth
and the reference's result computed on demand), and the shapes they are drawn at (``shapes``).

Two levels. ``"quick"``: four fixed toy shapes (``QUICK``), for fast tests. ``"full"`` (the default of a
scorecard): shapes drawn by seed from the distribution below, at the sizes models run. Every value is
drawn from a NumPy generator, so ``(seed, level)`` fixes every shape and ``(seed, check, trial)`` every
value.

The full distribution (``draw_shapes``; ``r(a, b)`` uniform integer in ``[a, b]``, ``D`` a per-seed
permutation of head_dims ``(64, 128, 256, odd)`` with ``odd`` one of 80, 96, ``G`` a per-seed
permutation of query heads per kv head ``(1, 2, 4, 8)``):

=========  =====  ==============================  ==============================  =========  =======
slot       batch  q_len                           kv_len                          heads q/kv  head_dim
=========  =====  ==============================  ==============================  =========  =======
long       1      1024 + r(1, 300)                1024 + r(1, 300), kv - q not     2 / 1      D[0]
                                                  a multiple of 128 (either sign)
accum      2      128 + r(1, 100)                 2048 + r(1, 300)                 2 / 1      D[1]
batch      3      128 + r(1, 100)                 384 + r(1, 127), kv - q > 0 not  G[0]*k/k   D[2]
                                                  a multiple of 128
ahead      2      kv + 512 + r(1, 127)            128 + r(1, 127)                  G[1] / 1   D[3]
decode     3      1                               1024 + r(1, 900)                 2*G[2] / 2  128
needle     1      128 + r(1, 127)                 1024 + r(1, 300)                 G[3] / 1   64
readout    3      128 + r(1, 100)                 128 + r(1, 127)                  4 / 2      256
gqa        1      40 + r(0, 24)                   256 + r(1, 127)                  16 / 2     64
small[d]   1      32 + r(0, 31)                   128 + r(1, 127)                  4 / 2      each of D
=========  =====  ==============================  ==============================  =========  =======

(``batch``: ``k`` kv heads, 1 when ``G[0] = 8`` else 2.) So every seed has head_dim 64, 128, 256 and an
odd one; groups 1, 2, 4, 8 and a single kv head; q_len > 1024 and kv_len > 1024 (three or more tiles of
128, 256 and 512 in both directions) with ragged tails; causal offsets ``kv_len - q_len`` that are no
multiple of 128 (so of no tile size), positive and negative; queries ahead of every key by more than
one 512-row tile (``ahead``: whole query tiles see no key); a batch of 3 with distinct kv_lengths
including 0 and full; kv_len > 2048 in bfloat16 (``accum``); split-KV decoding (``decode``, q_len 1).

kv_lengths (``draw_lengths``): batch >= 3 gets ``{0, kv_len, r(m, kv_len - 1)}`` in random order; smaller
batches ``kv_len`` and ``r(m, kv_len - 1)`` when ``m > 1``, else random lengths in ``[1, kv_len - 1]``, the
first past 128 when kv_len > 129; ``m`` is 2049 for ``accum`` (long rows in bfloat16) and 641 for
``decode`` (room for needles past the first 512-key split), 1 elsewhere (``SLOT_MIN_LENGTH``).

Each slot has one dtype and set of flags (``SLOT_FLAGS``; the ``small[d]`` slots cycle through every
combination of causal and kv_lengths, all with the explicit scale), so every (shape, dtype, flags) is
drawn at least twice with different values in one grade. Per check (``grading.checks``):
forward-accuracy long, accum, batch, ahead; gradients long, accum, decode, gqa; causal-leak long, ahead;
padding-leak accum, decode; empty-rows batch, ahead (gradients); mask-readout readout (one-hot V, twice);
gqa-mapping gqa (three draws); large-logits needle (logits ~ +-500; needles, forward and gradients) and
decode (needles); peaky-attention gqa, batch; scale every small[d], forward and gradients; determinism
small[d], batch; fresh-inputs readout (three draws).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from ..grading import oracle
from ..grading.candidates import reference
from kernel_src.contract import Dims

LEVELS = ("full", "quick")
QUICK = {
    "A": Dims(batch=2, q_len=16, kv_len=40, num_q_heads=6, num_kv_heads=3, head_dim=64),
    "B": Dims(batch=1, q_len=24, kv_len=24, num_q_heads=3, num_kv_heads=1, head_dim=32),
    "C": Dims(batch=2, q_len=8, kv_len=136, num_q_heads=2, num_kv_heads=2, head_dim=48),
    "D": Dims(batch=2, q_len=20, kv_len=12, num_q_heads=4, num_kv_heads=2, head_dim=16),
}
SHAPES = QUICK  # the quick level's shapes (name kept for older callers)
# At the quick level each slot of the full distribution is one of the four toy shapes.
QUICK_SLOTS = {"long": "A", "accum": "C", "batch": "A", "ahead": "D", "decode": "C", "needle": "A",
               "readout": "A", "gqa": "A", "small64": "A", "small32": "B", "small48": "C", "small16": "D"}
HEAD_DIMS = (64, 128, 256)
ODD_HEAD_DIMS = (80, 96)
GROUPS = (1, 2, 4, 8)
TILES = (128, 256, 512)
SHORT = {"float32": "f32", "bfloat16": "bf16"}
# Fixed (not drawn) so an explicit scale costs one compiled executable per shape, not one per seed. It must
# differ from head_dim**-0.5 at every head_dim drawn, or a kernel that ignores scale= would pass
# (tests/test_rubric.py checks this for every head_dim of both levels).
EXPLICIT_SCALE = 0.3


class Problem:
    """One call's inputs and flags. ``ct`` (a random cotangent) is set when gradients are checked.

    q: ``[batch, q_len, num_q_heads, head_dim]``; k, v: ``[batch, kv_len, num_kv_heads, head_dim]``;
    ct like q; ``lengths``: NumPy int32 ``[batch]`` or None. ``truth`` is the float64 oracle on these
    inputs; ``baseline`` the contract-precision reference's results (``grouped_baseline``: the same with
    K/V repeated per query head, see there).
    """

    def __init__(self, label: str, dtype: str, q, k, v, *, causal: bool = False, kv_lengths=None,
                 scale: float | None = None, ct=None):
        self.label, self.dtype, self.causal, self.scale = label, dtype, causal, scale
        self.q, self.k, self.v = (jnp.asarray(x, dtype) for x in (q, k, v))
        self.ct = None if ct is None else jnp.asarray(ct, dtype)
        self.lengths = None if kv_lengths is None else np.asarray(kv_lengths, np.int32)
        self.kv_lengths = None if kv_lengths is None else jnp.asarray(self.lengths)
        self.derived = False  # True for a changed copy of another problem (stays-put and determinism checks)

    @property
    def kwargs(self) -> dict:
        return {"causal": self.causal, "kv_lengths": self.kv_lengths, "scale": self.scale}

    @property
    def offset(self) -> int:
        return self.k.shape[1] - self.q.shape[1]

    @property
    def group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]

    @property
    def key(self) -> tuple:
        """What a kernel that memoizes by shape would key on: shapes, dtype and flags."""
        return (tuple(self.q.shape), tuple(self.k.shape), self.dtype, self.causal, self.lengths is None,
                self.scale)

    def replace(self, label: str, **arrays) -> "Problem":
        """The same flags with some of q/k/v/ct replaced (NumPy float32 values); always fresh arrays."""
        a = {n: arrays.get(n, None if getattr(self, n) is None else self.host(n)) for n in ("q", "k", "v", "ct")}
        return Problem(label, self.dtype, a["q"], a["k"], a["v"], ct=a["ct"], causal=self.causal,
                       kv_lengths=self.lengths, scale=self.scale)

    def derive(self, label: str, **arrays) -> "Problem":
        """``replace`` marked as derived: compared with ``self``, not a fresh draw at its shape."""
        p = self.replace(label, **arrays)
        p.derived = True
        return p

    def host(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self, name)).astype(np.float32)

    @functools.cached_property
    def truth(self) -> oracle.Truth:
        return oracle.attention(self.q, self.k, self.v, self.ct, causal=self.causal,
                                kv_lengths=self.lengths, scale=self.scale)

    @functools.cached_property
    def baseline(self) -> tuple[np.ndarray, ...]:
        """The reference's ``(out,)`` or ``(out, dq, dk, dv)`` when ``ct`` is set.

        Both come from one compiled program per shape and flags (forward and backward; a forward-only
        problem runs it under a zero cotangent), so a slot drawn with and without gradients compiles once."""
        ct = np.zeros(self.q.shape, self.q.dtype) if self.ct is None else self.ct
        result = _reference_vjp(self.q, self.k, self.v, ct, self.kv_lengths, causal=self.causal, scale=self.scale)
        return tuple(np.asarray(x) for x in (result[:1] if self.ct is None else result))

    def prepare(self) -> None:
        """Compute what judging this problem needs (truth, baselines, largest logit) now; the rubric calls
        it while the candidate's worker computes, so the two overlap."""
        self.truth, self.baseline, self.logit_max, self.grouped_baseline  # noqa: B018  (cached properties)

    @functools.cached_property
    def logit_max(self) -> float:
        """The largest ``|scale * q.k|`` over visible (query, key) pairs (0 when none is visible): sets the
        tolerance floor's multiple (``grading.tolerance.judge``, ``logit_scale``)."""
        q, k = np.asarray(self.q).astype(np.float32), np.asarray(self.k).astype(np.float32)
        b, lq, hq, d = q.shape
        hk = k.shape[2]
        scale = d ** -0.5 if self.scale is None else self.scale
        s = np.abs(np.matmul(q.reshape(b, lq, hk, hq // hk, d).transpose(0, 2, 3, 1, 4),
                             k.transpose(0, 2, 3, 1)[:, :, None]))  # [b, hk, g, lq, lk]
        vis = self.truth.visible[:, None, None]
        return float(np.max(np.where(vis, s, 0.0), initial=0.0) * scale)

    @functools.cached_property
    def grouped_baseline(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(dk, dv)`` of the reference run on K/V repeated per query head, summed over each group in
        fp32 and rounded to the input dtype: each query head's contribution is rounded to the input dtype
        before the group sum, as FlashAttention-2-style backwards (and JAX's Pallas TPU flash kernel on
        repeated heads) do. ``None`` when that rounding is exact (float32 or group 1)."""
        if self.ct is None or self.dtype == "float32" or self.group == 1:
            return None
        g = self.group
        k, v = jnp.repeat(self.k, g, axis=2), jnp.repeat(self.v, g, axis=2)
        _, _, dk, dv = _reference_vjp(self.q, k, v, self.ct, self.kv_lengths, causal=self.causal, scale=self.scale)
        b, lk, hq, d = dk.shape

        def fold(x):
            return np.asarray(x).astype(np.float32).reshape(b, lk, hq // g, g, d).sum(axis=3).astype(
                np.asarray(self.k).dtype)
        return fold(dk), fold(dv)


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _reference_vjp(q, k, v, ct, kv_lengths, *, causal: bool, scale: float | None):
    """The reference's output and its gradients under ``ct``, compiled as one program per shape and flags."""
    out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale),
                        q, k, v)
    return (out, *pull(ct))


# --------------------------------------------------------------------------------------------------
# Shapes.

def _rng(seed: int, what: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(what.encode())])


def _not_tile_multiple(offset: int) -> int:
    """``offset`` moved by one when it is a multiple of 128 (and so of some tile size, or zero)."""
    return offset + 1 if offset % 128 == 0 else offset


@functools.lru_cache(maxsize=64)
def draw_shapes(seed: int, level: str = "full") -> dict[str, Dims]:
    """The slots of ``seed`` at ``level`` (see the module docstring): slot name -> Dims."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if level == "quick":
        return {slot: QUICK[name] for slot, name in QUICK_SLOTS.items()}
    rng = _rng(seed, "shapes")

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    dims = [int(x) for x in rng.permutation([*HEAD_DIMS, int(rng.choice(ODD_HEAD_DIMS))])]
    groups = [int(x) for x in rng.permutation(GROUPS)]
    shapes = {}
    q_len = 1024 + r(1, 300)
    kv_len = 1024 + r(1, 300)
    if (kv_len - q_len) % 128 == 0:
        kv_len += 1
    shapes["long"] = Dims(1, q_len, kv_len, 2, 1, dims[0])
    shapes["accum"] = Dims(2, 128 + r(1, 100), 2048 + r(1, 300), 2, 1, dims[1])
    q_len = 128 + r(1, 100)
    kv_len = q_len + _not_tile_multiple(384 + r(1, 127) - q_len)
    kv_heads = 1 if groups[0] == 8 else 2
    shapes["batch"] = Dims(3, q_len, kv_len, groups[0] * kv_heads, kv_heads, dims[2])
    kv_len = 128 + r(1, 127)
    shapes["ahead"] = Dims(2, kv_len + 512 + r(1, 127), kv_len, groups[1], 1, dims[3])
    shapes["decode"] = Dims(3, 1, 1024 + r(1, 900), 2 * groups[2], 2, 128)
    shapes["needle"] = Dims(1, 128 + r(1, 127), 1024 + r(1, 300), groups[3], 1, 64)
    shapes["readout"] = Dims(3, 128 + r(1, 100), 128 + r(1, 127), 4, 2, 256)
    shapes["gqa"] = Dims(1, 40 + r(0, 24), 256 + r(1, 127), 16, 2, 64)
    for d in dims:
        shapes[f"small{d}"] = Dims(1, 32 + r(0, 31), 128 + r(1, 127), 4, 2, d)
    return shapes


# Each slot's dtype and flags ``(dtype, causal, kv_lengths, scale)``, the same in every check that draws
# from it, so each (shape, dtype, flags) is called at least twice with different values in one grade.
SLOT_FLAGS = {
    "long": ("float32", True, False, None),
    "accum": ("bfloat16", False, True, EXPLICIT_SCALE),
    "batch": ("bfloat16", True, True, None),
    "ahead": ("float32", True, False, EXPLICIT_SCALE),
    "decode": ("float32", False, True, None),
    "needle": ("float32", True, False, None),
    "readout": ("float32", True, True, None),
    "gqa": ("float32", False, False, None),
}
# The small[d] slots, in the order drawn, cycle through every flag combination with an explicit scale.
SMALL_FLAGS = (("float32", False, False), ("bfloat16", True, False), ("float32", False, True),
               ("bfloat16", True, True))


# Shortest non-zero kv_length a slot draws where the slot's point needs long rows (at the full level):
# accumulation over >= 2048 keys, split-KV decoding with room for needles past the first 512 keys.
SLOT_MIN_LENGTH = {"accum": 2049, "decode": 641}


def slot_flags(shapes: dict[str, Dims], slot: str) -> tuple[str, bool, bool, float | None]:
    """``(dtype, causal, kv_lengths, scale)`` of ``slot`` among ``shapes`` (one level and seed)."""
    if slot in SLOT_FLAGS:
        return SLOT_FLAGS[slot]
    small = [s for s in shapes if s.startswith("small")]
    dtype, causal, lengths = SMALL_FLAGS[small.index(slot) % len(SMALL_FLAGS)]
    return dtype, causal, lengths, EXPLICIT_SCALE


def draw_lengths(rng: np.random.Generator, dims: Dims, zero_batch: int | None = None,
                 minimum: int = 1) -> np.ndarray:
    """kv_lengths ``[batch]``: ``{0, kv_len, r(minimum, kv_len - 1)...}`` shuffled when batch >= 3; else
    ``kv_len`` then ``r(minimum, kv_len - 1)`` when ``minimum > 1``, else random in ``[1, kv_len - 1]`` (the
    first past 128 when kv_len > 129). ``zero_batch`` forces a 0 there."""
    lk = dims.kv_len
    if dims.batch >= 3:
        out = rng.permutation(np.concatenate([[0, lk], rng.integers(minimum, lk, size=dims.batch - 2)]))
    elif minimum > 1:
        out = np.concatenate([[lk], rng.integers(minimum, lk, size=dims.batch - 1)])
    else:
        out = rng.integers(1, lk, size=dims.batch)
        if lk > 129:
            out[0] = rng.integers(129, lk)
            out[1:] = rng.integers(1, 128, size=dims.batch - 1)
    if zero_batch is not None:
        out[zero_batch] = 0
    return out.astype(np.int32)


def normal(rng: np.random.Generator, shape: str | Dims, dtype: str, *, causal: bool = False,
           lengths: bool | str = False, scale: float | None = None, grad: bool = False,
           zero_batch: int | None = None, tag: str = "", name: str | None = None,
           min_length: int = 1) -> Problem:
    """N(0, 1) q, k, v (and cotangent when ``grad``) of ``shape`` (a ``QUICK`` name or a Dims).

    ``lengths``: False (kv_lengths=None), True (``draw_lengths``), "full" (kv_len each) or an int array.
    The label names the shape (``name`` or the quick name), its dims, the dtype and every flag.
    """
    d = QUICK[shape] if isinstance(shape, str) else shape
    name = name or (shape if isinstance(shape, str) else "")
    q = rng.standard_normal((d.batch, d.q_len, d.num_q_heads, d.head_dim), np.float32)
    k = rng.standard_normal((d.batch, d.kv_len, d.num_kv_heads, d.head_dim), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    ct = rng.standard_normal(q.shape, np.float32) if grad else None
    if isinstance(lengths, np.ndarray):
        kv_lengths = lengths
    else:
        kv_lengths = None if not lengths else np.full(d.batch, d.kv_len) if lengths == "full" else \
            draw_lengths(rng, d, zero_batch, min_length if min_length < d.kv_len else 1)
    flags = ["causal"] if causal else []
    flags += [] if kv_lengths is None else [f"kv_lengths={np.asarray(kv_lengths).tolist()}"]
    flags += [f"scale={scale:g}"] if scale is not None else []
    label = f"{name}{tuple(d)} {SHORT[dtype]} {'+'.join(flags) or 'unmasked'}{' ' + tag if tag else ''}"
    return Problem(label, dtype, q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, ct=ct)
