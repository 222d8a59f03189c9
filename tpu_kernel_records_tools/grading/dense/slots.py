"""The shapes the rubric draws problems at: slots, their dtypes and flags, and kv_lengths.

Two levels. ``"quick"``: four fixed toy shapes (``QUICK``), for fast tests. ``"full"`` (the default of a
scorecard): shapes drawn by seed from the distribution below, at the sizes models run. Every value is
drawn from a NumPy generator, so ``(seed, level)`` fixes every shape and ``(seed, check, trial)`` every
value.

The full distribution (``draw_shapes``; ``r(a, b)`` uniform integer in ``[a, b]``, ``D`` a per-seed
permutation of head_dims ``(64, 128, 256, odd)`` with ``odd`` one of 80, 96, ``G`` a per-seed
permutation of query heads per kv head ``(1, 2, 4, 8)``; ``~`` marks a length moved by one when it
is a multiple of 128, so of no tile size):

==========  =====  ==============================  ==============================  ==========  =======
slot        batch  q_len                           kv_len                          heads q/kv  head_dim
==========  =====  ==============================  ==============================  ==========  =======
long        1      1024 + r(1, 300)                1024 + r(1, 300), kv - q not     2 / 1       D[0]
                                                   a multiple of 128 (either sign)
accum       2      128 + r(1, 100)                 2048 + r(1, 300)                 2 / 1       D[1]
batch       3      128 + r(1, 100)                 384 + r(1, 127), kv - q > 0 not  G[0]*k/k    D[2]
                                                   a multiple of 128
ahead       2      kv + 512 + r(1, 127)            128 + r(1, 127)                  G[1] / 1    D[3]
decode      3      1                               1024 + r(1, 900)                 2*G[2] / 2  128
needle      1      128 + r(1, 127)                 1024 + r(1, 300)                 G[3] / 1    64
readout     3      128 + r(1, 100)                 128 + r(1, 127)                  4 / 2       256
gqa         1      40 + r(0, 24)                   256 + r(1, 127)                  16 / 2      64
small[d]    1      32 + r(0, 31)                   128 + r(1, 127)                  4 / 2       each of D
serve8      8      1                               ~1024 + r(1, 1023)               8 / 2       128
spec        8      r(2, 8)                         ~512 + r(1, 1535)                8 / 2       128
longcache   2      r(1, 16)                        ~8192 + r(1, 8191)               4 / 1       128
longdecode  2      1                               ~32768 + r(1, 98303)             8 / 1       64
longspec    2      r(2, 8)                         ~32768 + r(1, 98303)             4 / 2       64
heads[h]    1      16 + r(0, 16)                   ~64 + r(1, 63)                   h / 8       128
mha[h]      1      as heads[h]                     as heads[h]                      h / h       64, 128, 64
prefill     1      2048 + r(1, 255)                ~q + r(1, 511)                   2 / 1       64
exact512    2      512                             512                              4 / 4       64
exact2048   1      512                             2048                             2 / 1       128
exact4096   1      2048                            4096                             1 / 1       64
==========  =====  ==============================  ==============================  ==========  =======

(``batch``: ``k`` kv heads, 1 when ``G[0] = 8`` else 2. ``heads[h]``, ``mha[h]``: h = 24, 40, 64, as
Llama-3.2-3B, Qwen2.5-14B and Llama-2-70B have; one q_len and kv_len for all six; ``mha`` at head_dim
64, 128, 64 for h = 24, 40, 64.) So every seed has head_dim 64, 128, 256 and an odd one; groups 1, 2,
4, 8 and a single kv head; q_len > 1024 and kv_len > 1024 (three or more tiles of 128, 256 and 512 in
both directions) with ragged tails; causal offsets ``kv_len - q_len`` that are no multiple of 128 (so
of no tile size), positive and negative; queries ahead of every key by more than one 512-row tile
(``ahead``: whole query tiles see no key); a batch of 3 with distinct kv_lengths including 0 and full;
kv_len > 2048 in bfloat16 (``accum``); split-KV decoding (``decode``, q_len 1). And the shapes serving
and training run every day (drawn from a generator of their own, so the slots above are those of
earlier versions): a serving batch of 8 with 8 distinct kv_lengths (``serve8``, decoding, and
``spec``, speculative decoding with 2-8 draft tokens, causal); KV caches of 8,192-16,384 keys in
bfloat16 (``longcache``), and decoding (``longdecode``) and speculative decoding (``longspec``) over
32,769-131,071 keys in bfloat16, every length past 2^15 (past any 16-bit key position or length; from
a generator of their own, so the slots before them stay as drawn); 24, 40 and 64 query heads over 8 kv
heads and as many kv heads (past one or more blocks of 16 heads, with a remainder block at 24 and 40);
plain multi-head attention at head_dim 64 and 128 in every grade (``mha[h]``, ``exact512``); chunked
prefill of more than 2048 queries against a longer cache (``prefill``); and lengths that are exact
multiples of every tile (``exact*``: 512, 2048 and 4096, beside the ragged ones).

kv_lengths (``draw_lengths``): batch >= 3 gets ``{0, kv_len, r(m, kv_len - 1)}`` in random order; smaller
batches ``kv_len`` and ``r(m, kv_len - 1)`` when ``m > 1``, else random lengths in ``[1, kv_len - 1]``, the
first past 128 when kv_len > 129; ``m`` is 2049 for ``accum`` (long rows in bfloat16), 641 for
``decode`` (room for needles past the first 512-key split), 4097 for ``longcache`` and 32769 for
``longdecode`` and ``longspec`` (a full and a partial length, both past 2^15), 1 elsewhere
(``SLOT_MIN_LENGTH``). ``serve8`` and ``spec`` (``serving_lengths``): 0, kv_len and six lengths, one
from the middle half of each sixth of ``[1, kv_len - 1]``, shuffled: eight distinct lengths at least
``kv_len / 24`` apart, so a sequence given another's length loses or gains many keys.

Each slot has one dtype and set of flags (``SLOT_FLAGS``; the ``small[d]`` slots cycle through every
combination of causal and kv_lengths, all with the explicit scale), so every (shape, dtype, flags) is
drawn at least twice with different values in one grade. Per check (``grading.dense.checks``):
forward-accuracy long, accum, batch, ahead, serve8, spec, longcache (twice: random, and V constant
along keys, which a bfloat16 running sum cannot return exactly), longdecode, longspec, prefill,
exact512, exact2048, exact4096; gradients long, accum, decode, gqa, heads40, exact512; causal-leak long, ahead, spec,
prefill, exact2048, exact4096; padding-leak accum, decode, serve8, spec, longcache, longdecode,
longspec; empty-rows batch,
ahead, serve8 (gradients); mask-readout readout (one-hot V, twice); gqa-mapping gqa (three draws), and
heads[h], mha[h] (V = kv head + 1, and a random draw, each); large-logits needle (logits ~ +-500;
needles, forward and gradients) and decode (needles); peaky-attention gqa, batch; scale every small[d],
forward and gradients; determinism small[d], batch; fresh-inputs readout (three draws). The quick level
has the first twelve slots only (``QUICK_SLOTS``); the checks skip the others there.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

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
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)  # key blocks kernels walk: segments/chunk and decode put boundaries past each
MANY_HEADS = (24, 40, 64)  # heads[h] and mha[h]
MHA_HEAD_DIMS = {24: 64, 40: 128, 64: 64}
LONG_CONTEXT = (32_768, 131_072)  # longdecode and longspec: kv_len and every length past the first, at most the second
SERVING_SLOTS = ("serve8", "spec", "longcache", "longdecode", "longspec", *(f"heads{h}" for h in MANY_HEADS),
                 *(f"mha{h}" for h in MANY_HEADS), "prefill", "exact512", "exact2048", "exact4096")
SHORT = {"float32": "f32", "bfloat16": "bf16"}
# Fixed (not drawn) so an explicit scale costs one compiled executable per shape, not one per seed. It must
# differ from head_dim**-0.5 at every head_dim drawn, or a kernel that ignores scale= would pass
# (tests/test_rubric.py checks this for every head_dim of both levels).
EXPLICIT_SCALE = 0.3


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
    shapes.update(_serving_shapes(seed))
    return shapes


def _serving_shapes(seed: int) -> dict[str, Dims]:
    """The serving and training slots (module docstring), from a generator of their own."""
    rng = _rng(seed, "serving shapes")

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    shapes = {"serve8": Dims(8, 1, _not_tile_multiple(1024 + r(1, 1023)), 8, 2, 128),
              "spec": Dims(8, r(2, 8), _not_tile_multiple(512 + r(1, 1535)), 8, 2, 128),
              "longcache": Dims(2, r(1, 16), _not_tile_multiple(8192 + r(1, 8191)), 4, 1, 128)}
    q_len, kv_len = 16 + r(0, 16), _not_tile_multiple(64 + r(1, 63))
    for h in MANY_HEADS:
        shapes[f"heads{h}"] = Dims(1, q_len, kv_len, h, 8, 128)
    for h in MANY_HEADS:
        shapes[f"mha{h}"] = Dims(1, q_len, kv_len, h, h, MHA_HEAD_DIMS[h])
    q_len = 2048 + r(1, 255)
    shapes["prefill"] = Dims(1, q_len, q_len + _not_tile_multiple(r(1, 511)), 2, 1, 64)
    shapes["exact512"] = Dims(2, 512, 512, 4, 4, 64)
    shapes["exact2048"] = Dims(1, 512, 2048, 2, 1, 128)
    shapes["exact4096"] = Dims(1, 2048, 4096, 1, 1, 64)
    return {**shapes, **_long_context_shapes(seed)}


def _long_context_shapes(seed: int) -> dict[str, Dims]:
    """``longdecode`` and ``longspec`` (module docstring), from a generator of their own (issue 36)."""
    rng = _rng(seed, "long context shapes")
    low, high = LONG_CONTEXT

    def kv_len() -> int:
        return min(_not_tile_multiple(low + int(rng.integers(1, high - low))), high - 1)

    return {"longdecode": Dims(2, 1, kv_len(), 8, 1, 64),
            "longspec": Dims(2, int(rng.integers(2, 9)), kv_len(), 4, 2, 64)}


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
    "serve8": ("bfloat16", True, True, None),
    "spec": ("float32", True, True, None),
    "longcache": ("bfloat16", True, True, None),
    "longdecode": ("bfloat16", True, True, None),
    "longspec": ("bfloat16", True, True, None),
    "heads24": ("float32", True, False, None),
    "heads40": ("bfloat16", True, False, None),
    "heads64": ("float32", False, False, None),
    "mha24": ("bfloat16", True, False, None),
    "mha40": ("float32", False, False, None),
    "mha64": ("bfloat16", False, False, EXPLICIT_SCALE),
    "prefill": ("bfloat16", True, False, None),
    "exact512": ("bfloat16", True, False, None),
    "exact2048": ("float32", True, False, None),
    "exact4096": ("bfloat16", True, False, None),
}
# The small[d] slots, in the order drawn, cycle through every flag combination with an explicit scale.
SMALL_FLAGS = (("float32", False, False), ("bfloat16", True, False), ("float32", False, True),
               ("bfloat16", True, True))


# Shortest non-zero kv_length a slot draws where the slot's point needs long rows (at the full level):
# accumulation over >= 2048 keys, split-KV decoding with room for needles past the first 512 keys, a
# cache longer than 4096 keys, lengths past 2^15.
SLOT_MIN_LENGTH = {"accum": 2049, "decode": 641, "longcache": 4097, "longdecode": LONG_CONTEXT[0] + 1,
                   "longspec": LONG_CONTEXT[0] + 1}


# The slots some check grades with gradients: their forward-only problems get the reference's forward
# from the same compiled program as the gradients (``Problem.baseline``).
GRADIENT_SLOTS = frozenset({"long", "accum", "batch", "ahead", "decode", "needle", "gqa", "serve8", "heads40",
                            "exact512"})


def gradient_slot(slot: str | None) -> bool:
    """Whether some check grades ``slot`` with gradients (every small[d] is; an unnamed problem may be)."""
    return slot is None or slot in GRADIENT_SLOTS or slot.startswith("small") or slot in QUICK


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


def serving_lengths(rng: np.random.Generator, dims: Dims) -> np.ndarray:
    """``batch`` distinct kv_lengths: 0, kv_len and one from the middle half of each of ``batch - 2``
    equal parts of ``[1, kv_len - 1]``, shuffled (``serve8``, ``spec``; kv_len >= 8 * batch)."""
    n, lk = dims.batch - 2, dims.kv_len
    width = (lk - 1) / n
    middle = [int(rng.integers(1 + int(i * width + width / 4), 1 + int(i * width + 3 * width / 4))) for i in range(n)]
    return rng.permutation(np.array([0, lk, *middle])).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# The features' slots (``kernel_src.contract.FEATURES``), graded only for a candidate that declares the
# feature (``grading.dense.feature_checks``). Every slot is graded on every seed; the shapes and the feature
# values are drawn by seed from a generator of their own, so adding them moved no base slot.
#
# window (W: a model's sliding window, ``window_size=(W - 1, 0)``; "~" as above):
#   train    batch 1, q = kv = 3W + r(1, 300), W = 128 (gpt-oss), 8/1 heads, d 64, causal, f32, grads
#   wide     as train with window (W, 0): one key more than the model's window (the other side of W - 1)
#   chunk    chunked prefill q 128 + r(1, 127) against kv ~3W + r(1, 999), W = 1024 (Gemma 3), 4/2, d 128
#   decode   batch 4, q 1, kv ~3W + r(1, 1999), W = 4096 (Mistral), 8/2, d 128, kv_lengths: full, inside
#            the window, and two that leave the row no visible key (zeros)
#   short    q = kv = 300 + r(1, 200) < W = 4096, 2/1 heads, d 256, causal, bf16, grads (= plain causal)
#   all      q 64 + r(0, 63), kv 256 + r(1, 127), left >= kv - 1 (= plain causal), f32
#   self     window (0, 0), not causal: each row sees its own position only; q 96 + r(0, 31) <= kv, grads
#   odd      window (left, right), left 300 + r(1, 99) and right 50 + r(1, 99), no multiple of 128, not
#            causal, q 200 + r(0, 55), kv ~1024 + r(1, 299): whole leading key blocks masked for every row
#   ahead    q_len > kv_len (rows ahead of every key see none), window (31 + r(0, 32), 0), causal
#   readout  one-hot V (kv <= head_dim 256), window (17 + r(0, 40), r(0, 9)), causal, kv_lengths
# softcap:
#   cap5     cap 5, q x6 (logits far past the cap), batch 3 with kv_lengths (0 and full), causal, grads
#   cap50    cap 50, scale 144 ** -0.5 at d 128 (Gemma 2 27B), q x40, 8/4 heads, causal, bf16, grads
#   d256     cap 50 at d 256 (Gemma 2 9B), q x60, 4/2 heads, not causal, f32
#   huge     cap 1e30 (= no cap), f32: compared with the same call without the cap
# segments (ids of the key positions; queries carry the id of their own position when q = kv):
#   packed   training row, q = kv ~1024 + r(1, 299), batch 2, 4-16 documents (one of them one key long,
#            boundaries inside tiles), causal, 4/2, d 64, f32, grads
#   repeat   ids in runs of 1-40 drawn from {0, 1, 2} (A B A), not causal, q = kv 200 + r(0, 55), d 256,
#            one-hot V readout
#   cross    q 64 + r(0, 63) ids, kv 300 + r(1, 99) ids of their own (q_len != kv_len), a query id that
#            no key has (zeros), kv_lengths, not causal, f32
#   equal    every id equal (= no ids), causal, kv_lengths, bf16: compared with the call without ids
#   chunk    chunked prefill over a packed cache (issue 51): q 100 + r(1, 155) rows, the last of kv ~q + 520 +
#            r(1, 700) keys; a document starts 1-3 keys after each common block size (16, 32, 64, 128, 256,
#            512) and one inside the queries, so the leading documents are only among the keys and every block
#            boundary falls inside a document; distinct ids in random order; batch 2, causal, 4/2, d 64, f32,
#            grads
#   decode   decoding over a packed cache: batch 4, q r(1, 4), kv ~1152 + r(1, 600), kv_lengths 1-7 keys past
#            128, 256, 512 and 1024, documents as in chunk up to each length, the queries the last document's,
#            the padding an id of its own; causal, 8/2, d 128, f32
#   (chunk and decode come from a generator of their own, so the slots above stay as drawn; at the quick
#   level kv 150 against q 8 (chunk, batch 2) and 2 (decode, batch 3), decode's lengths 1-7 past 32, 64, 128)
# sinks (one per query head, differing within a kv group):
#   random   16/2 heads (gpt-oss's group of 8), d 64, N(0, 2) sinks, causal, f32, grads (dsinks)
#   high     sinks 40-60 above every logit, kv_lengths with 0 (a fully masked row: zeros), f32
#   low      sinks near -60 (below every logit), bf16, grads
#   off      sinks -1e30 (= no sinks), f32: compared with the same call without sinks

FEATURE_SEED = "feature shapes"


@functools.lru_cache(maxsize=64)
def draw_feature_slots(seed: int, level: str = "full") -> dict[str, dict]:
    """Slot name ``"feature/probe"`` -> ``{"dims", "dtype", "causal", "lengths", "scale", "window",
    "softcap", "q_boost", "segments", "sinks", "grad"}`` (see the table above); ``level="quick"``
    draws the same probes at fixed toy sizes (windows of a few keys; the values still come from the
    seed), so that, as at the quick level's base shapes, every seed reuses the programs compiled once."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    rng = _rng(seed, FEATURE_SEED)
    quick = level == "quick"

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    def slot(dims, dtype, causal, *, lengths=False, scale=None, window=None, softcap=None, q_boost=1.0,
             segments=None, sinks=None, grad=False):
        return {"dims": dims, "dtype": dtype, "causal": causal, "lengths": lengths, "scale": scale,
                "window": window, "softcap": softcap, "q_boost": q_boost, "segments": segments, "sinks": sinks,
                "grad": grad}

    s = {}
    if quick:  # windows of 4-8 keys over a few dozen, the same toy shapes on every seed (as QUICK)
        w = 8
        s["window/train"] = slot(Dims(1, 3 * w + 1, 0, 4, 1, 32), "float32", True, window=(w - 1, 0), grad=True)
        s["window/wide"] = slot(s["window/train"]["dims"], "float32", True, window=(w, 0))
        s["window/chunk"] = slot(Dims(1, 8, 3 * w + 1, 4, 2, 32), "float32", True, window=(w - 1, 0))
        s["window/decode"] = slot(Dims(4, 1, 3 * w + 1, 4, 2, 32), "float32", True, lengths=True,
                                  window=(w - 1, 0))
        s["window/short"] = slot(Dims(1, 12, 0, 2, 1, 64), "bfloat16", True, window=(4 * w - 1, 0), grad=True)
        s["window/all"] = slot(Dims(1, 8, 21, 2, 1, 32), "float32", True)
        s["window/self"] = slot(Dims(1, 10, 0, 2, 1, 32), "float32", False, window=(0, 0), grad=True)
        s["window/odd"] = slot(Dims(1, 10, 41, 2, 1, 32), "float32", False,
                               window=(9, 2), grad=True)
        s["window/ahead"] = slot(Dims(2, 0, 12, 2, 1, 32), "float32", True, window=(3, 0))
        s["window/readout"] = slot(Dims(3, 12, 24, 2, 1, 64), "float32", True, lengths=True,
                                   window=(5, 2))
        s["softcap/cap5"] = slot(Dims(3, 8, 24, 4, 2, 32), "float32", True, lengths=True,
                                 softcap=5.0, q_boost=6.0, grad=True)
        s["softcap/cap50"] = slot(Dims(1, 16, 0, 4, 2, 32), "bfloat16", True, scale=144 ** -0.5,
                                  softcap=50.0, q_boost=40.0, grad=True)
        s["softcap/d256"] = slot(Dims(1, 8, 20, 2, 1, 64), "float32", False, softcap=50.0,
                                 q_boost=60.0)
        s["softcap/huge"] = slot(Dims(1, 8, 20, 2, 1, 32), "float32", False, softcap=1e30)
        s["segments/packed"] = slot(Dims(2, 40, 0, 4, 2, 32), "float32", True, segments="packed", grad=True)
        s["segments/repeat"] = slot(Dims(1, 24, 0, 2, 1, 64), "float32", False, segments="repeat")
        s["segments/cross"] = slot(Dims(2, 8, 30, 2, 1, 32), "float32", False, lengths=True,
                                   segments="cross")
        s["segments/equal"] = slot(Dims(3, 12, 20, 2, 1, 32), "bfloat16", True, lengths=True,
                                   segments="equal")
        s["sinks/random"] = slot(Dims(1, 8, 24, 8, 2, 32), "float32", True, sinks="random",
                                 grad=True)
        s["sinks/high"] = slot(Dims(3, 8, 20, 4, 2, 32), "float32", True, lengths=True,
                               sinks="high")
        s["sinks/low"] = slot(Dims(1, 8, 20, 4, 2, 32), "bfloat16", True, sinks="low", grad=True)
        s["sinks/off"] = slot(Dims(1, 8, 20, 4, 2, 32), "float32", False, sinks="off")
    else:
        w = 128
        n = 3 * w + r(1, 300)
        s["window/train"] = slot(Dims(1, n, 0, 8, 1, 64), "float32", True, window=(w - 1, 0), grad=True)
        s["window/wide"] = slot(Dims(1, n, 0, 8, 1, 64), "float32", True, window=(w, 0))
        w = 1024
        s["window/chunk"] = slot(Dims(1, 128 + r(1, 127), _not_tile_multiple(3 * w + r(1, 999)), 4, 2, 128),
                                 "float32", True, window=(w - 1, 0))
        w = 4096
        s["window/decode"] = slot(Dims(4, 1, _not_tile_multiple(3 * w + r(1, 1999)), 8, 2, 128), "float32", True,
                                  lengths=True, window=(w - 1, 0))
        s["window/short"] = slot(Dims(1, 300 + r(1, 200), 0, 2, 1, 256), "bfloat16", True, window=(w - 1, 0),
                                 grad=True)
        s["window/all"] = slot(Dims(1, 64 + r(0, 63), 256 + r(1, 127), 2, 1, 128), "float32", True)
        s["window/self"] = slot(Dims(1, 96 + r(0, 31), 0, 4, 2, 64), "float32", False, window=(0, 0), grad=True)
        left = _not_tile_multiple(300 + r(1, 99))
        s["window/odd"] = slot(Dims(1, 200 + r(0, 55), _not_tile_multiple(1024 + r(1, 299)), 2, 1, 128), "float32",
                               False, window=(left, 50 + r(1, 99)), grad=True)
        s["window/ahead"] = slot(Dims(2, 0, 128 + r(1, 100), 2, 1, 64), "float32", True, window=(31 + r(0, 32), 0))
        s["window/readout"] = slot(Dims(3, 96 + r(0, 31), 160 + r(0, 95), 4, 2, 256), "float32", True, lengths=True,
                                   window=(17 + r(0, 40), r(0, 9)))
        s["softcap/cap5"] = slot(Dims(3, 64 + r(0, 63), 300 + r(1, 200), 8, 2, 128), "float32", True, lengths=True,
                                 softcap=5.0, q_boost=6.0, grad=True)
        s["softcap/cap50"] = slot(Dims(1, 256 + r(1, 127), 0, 8, 4, 128), "bfloat16", True, scale=144 ** -0.5,
                                  softcap=50.0, q_boost=40.0, grad=True)
        s["softcap/d256"] = slot(Dims(1, 48 + r(0, 15), 200 + r(1, 99), 4, 2, 256), "float32", False, softcap=50.0,
                                 q_boost=60.0)
        s["softcap/huge"] = slot(Dims(1, 64 + r(0, 63), 256 + r(1, 127), 2, 1, 64), "float32", False, softcap=1e30)
        s["segments/packed"] = slot(Dims(2, _not_tile_multiple(1024 + r(1, 299)), 0, 4, 2, 64), "float32", True,
                                    segments="packed", grad=True)
        s["segments/repeat"] = slot(Dims(1, 200 + r(0, 55), 0, 4, 1, 256), "float32", False, segments="repeat")
        s["segments/cross"] = slot(Dims(2, 64 + r(0, 63), 300 + r(1, 99), 4, 2, 64), "float32", False, lengths=True,
                                   segments="cross")
        s["segments/equal"] = slot(Dims(3, 128 + r(1, 127), 384 + r(1, 127), 4, 2, 128), "bfloat16", True,
                                   lengths=True, segments="equal")
        s["sinks/random"] = slot(Dims(1, 128 + r(1, 127), 384 + r(1, 127), 16, 2, 64), "float32", True,
                                 sinks="random", grad=True)
        s["sinks/high"] = slot(Dims(3, 64 + r(0, 63), 256 + r(1, 127), 8, 2, 64), "float32", True, lengths=True,
                               sinks="high")
        s["sinks/low"] = slot(Dims(1, 128 + r(1, 127), 256 + r(1, 127), 8, 1, 64), "bfloat16", True, sinks="low",
                              grad=True)
        s["sinks/off"] = slot(Dims(1, 64 + r(0, 63), 256 + r(1, 127), 4, 2, 64), "float32", False, sinks="off")
    for name, spec in s.items():  # kv_len 0 above: as long as q (square, training); q_len 0: kv + 200..300
        d = spec["dims"]
        if d.kv_len == 0:
            spec["dims"] = d._replace(kv_len=d.q_len)
        elif d.q_len == 0:
            spec["dims"] = d._replace(q_len=d.kv_len + (9 if quick else 200 + r(0, 100)))
        if name == "window/all":
            spec["window"] = (spec["dims"].kv_len - 1 + (2 if quick else r(0, 5)), None)
    return {**s, **_packed_cache_slots(seed, quick, slot)}


def _packed_cache_slots(seed: int, quick: bool, slot) -> dict[str, dict]:
    """``segments/chunk`` and ``segments/decode`` (the table above), from a generator of their own (issue 51)."""
    rng = _rng(seed, "packed cache slots")

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    if quick:
        return {"segments/chunk": slot(Dims(2, 8, 150, 4, 2, 32), "float32", True, segments="chunk", grad=True),
                "segments/decode": slot(Dims(3, 2, 150, 4, 2, 32), "float32", True, lengths=True, segments="decode")}
    q_len = 100 + r(1, 155)
    return {"segments/chunk": slot(Dims(2, q_len, _not_tile_multiple(q_len + 520 + r(1, 700)), 4, 2, 64), "float32",
                                   True, segments="chunk", grad=True),
            "segments/decode": slot(Dims(4, r(1, 4), _not_tile_multiple(1152 + r(1, 600)), 8, 2, 128), "float32", True,
                                    lengths=True, segments="decode")}
