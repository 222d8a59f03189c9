"""The ragged rubric's slots: the shapes, page sizes, pools and sequence mixes its problems are drawn at.

Two levels, as for the other contracts: ``"full"`` draws every slot by seed, ``"quick"`` keeps fixed small shapes
(``num_tokens``, ``max_seqs``, the pool and the table are the same on every seed, so the programs compiled once
serve them all; only the lengths' values change). A slot fixes the shapes, dtypes, the number of real
sequences and each one's ``q_len`` and ``kv_len``; the values, the page table, the pool's layout and what
the arrays hold past ``num_seqs`` are drawn per problem (``grading.ragged.problems``).

A slot's sequences (``mix``) are what an engine's step holds: decode rows (``q_len = 1``), chunks of prefill
(``1 < q_len < kv_len``), whole prompts (``q_len = kv_len``) and ``q_len = 0`` sequences, never all at the end,
at ``kv_len`` 1, ``page_size - 1``, ``page_size``, ``page_size + 1``, ``2 page_size`` among others, and a chunk that
fills its table (its rows past the first page); ``max_seqs`` is 1-4 rows more than the real sequences and ``num_tokens`` 1-8 rows past the last.

The full distribution (``r(a, b)`` uniform integer in ``[a, b]``; ``G`` a per-seed permutation of the groups 1,
2, 4, 8; ``O`` one of 3, 5, 6, 7):

=========  ==========  =========  ============  ====  ===============  ==========  =========
slot       sequences   max q_len  heads q/kv    d     page_size        pages/seq   dtype
=========  ==========  =========  ============  ====  ===============  ==========  =========
serve16    r(24, 64)   16         2 G[0] / 2    128   16               r(8, 16)    bfloat16
chunk32    r(8, 16)    48         G[1] / 1      64    32               r(4, 8)     float32
mid64      r(6, 12)    80         4 G[2] / 4    64    64               r(2, 5)     bfloat16
tpu128     r(4, 8)     160        G[3] / 2      128   128              r(2, 4)     float32
wide256    r(3, 6)     300        O / 1         256   256              r(2, 3)     bfloat16
odd        r(6, 12)    40         G[0] / 1      64    24, 40 or 48     r(3, 8)     bfloat16
long       3           8          8 / 1         64    16               +r(1, 8)    bfloat16
solo       1           512        8 / 2         128   32               r(4, 16)    bfloat16
=========  ==========  =========  ============  ====  ===============  ==========  =========

``solo``: a step of one sequence (the contract's batches run from 1 sequence to 64), a decode row, a chunk or a
whole prompt with equal odds, ``kv_len`` in ``[2, pages/seq x 32]``, garbage sequences after it as in every slot.

``long``: a decode row and a chunk of a sequence of ``16 r(2049, 4096)`` keys (past 32,768, an exact multiple of
the page size) and of ``r(65537, 131072)``, beside a short one: past every 16-bit length and position, thousands
of pages per sequence, a pool past ``2^15 + r(4096, 8192)`` pages, so page indices run past 2^15. A pool past
2^31 elements is not a slot: the full level's ``ragged-long`` adds one small call spread over such a pool where
memory allows (``grading.ragged.big_pool``). Quantized pools are drawn by the ``ragged-quantized_kv`` check on top of
these slots (``grading.ragged.problems.quantize``).

The quick level: the same slots at ``head_dim`` 16-32 (page sizes 16, 32, 64, 128, 256 and 24 kept), a few
pages per sequence, ``long`` at page size 8 with lengths 32,768 and 33,003 in a pool of 2^15 + 2,048 pages, and
``solo`` at page size 16, 4 pages, 16 tokens and ``max_seqs`` 3.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np

from ...grading.dense.slots import LEVELS
from ...grading.paged.slots import GROUPS, INDEX_LIMIT, ODD_GROUPS, ODD_PAGE_SIZES, POOL_FACTOR, PagedSlot

SLOTS = ("serve16", "chunk32", "mid64", "tpu128", "wide256", "odd", "long", "solo")
EDGE_SLOTS = SLOTS[:-2]  # the slots whose mixes hold every edge length


@dataclass(frozen=True)
class RaggedSlot:
    """One slot: shapes, dtype and the real sequences' ``q_lens`` and ``kv_lens`` (see the module docstring)."""

    name: str
    num_tokens: int
    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    num_pages: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    dtype: str

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def paged(self) -> PagedSlot:
        """The real sequences as a paged slot (``grading.paged.problems.layout`` lays their pool out)."""
        return PagedSlot(self.name, self.num_seqs, 1, self.num_q_heads, self.num_kv_heads, self.head_dim,
                         self.page_size, self.pages_per_sequence, self.num_pages, self.kv_lens, self.dtype)

    def describe(self) -> str:
        """``name(tokens T of N seqs in M, heads q/kv, d, page ps x pps, pool P)`` for problem labels."""
        return (f"{self.name}(t{self.num_tokens}, {self.num_seqs} seqs of {self.max_seqs}, h{self.num_q_heads}/"
                f"{self.num_kv_heads}, d{self.head_dim}, page {self.page_size}x{self.pages_per_sequence}, "
                f"pool {self.num_pages})")


def _rng(seed: int, what: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(what.encode())])


def mix(rng: np.random.Generator, n: int, page_size: int, pages_per_sequence: int, max_q: int,
        ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(q_lens, kv_lens)`` of ``n >= 4`` sequences: decode rows, chunks, whole prompts and empty ones (one of
    them first or between others), at the edge lengths and random ones (module docstring); one chunk fills its
    table, its first row past the first page."""
    full = page_size * pages_per_sequence
    kinds = [str(x) for x in rng.permutation((["decode", "chunk", "prompt", "empty"] * n)[:n])]
    if kinds[-1] == "empty":  # an empty sequence between others, not only last
        kinds[-1], kinds[0] = kinds[0], kinds[-1]
    long_chunk = kinds.index("chunk")  # fills its table: its rows sit past the first page
    others = [i for i, kind in enumerate(kinds) if kind != "prompt" and i != long_chunk]  # the edge lengths go here
    edges = [x for x in dict.fromkeys([1, page_size - 1, page_size, page_size + 1, 2 * page_size])
             if 1 <= x < full][:len(others)]
    kv = [int(x) for x in rng.integers(2, full + 1, n)]
    for i, length in zip(rng.permutation(others), edges):
        kv[i] = length
    kv[long_chunk] = full
    q = []
    for i, kind in enumerate(kinds):
        if kind == "prompt":
            kv[i] = int(rng.integers(2, min(max_q, full) + 1))
        most = min(max_q, kv[i] - 1, max(2, full - page_size) if i == long_chunk else kv[i])
        chunk = int(rng.integers(2, most + 1)) if kv[i] >= 3 else 1
        q.append({"empty": 0, "decode": 1, "prompt": kv[i], "chunk": chunk}[kind])
    return tuple(q), tuple(kv)


def _slot(rng, name, n, max_q, hq, hk, d, ps, pps, dtype, *, extra_seqs=None, pad=None, lengths=None,
          least_pool=0) -> RaggedSlot:
    q_lens, kv_lens = mix(rng, n, ps, pps, max_q) if lengths is None else lengths
    used = sum(-(-k // ps) for k in kv_lens)
    pool = max(used * int(rng.integers(POOL_FACTOR[0], POOL_FACTOR[1] + 1)), least_pool, used + 2)
    extra = int(rng.integers(1, 5)) if extra_seqs is None else extra_seqs
    tokens = sum(q_lens) + (int(rng.integers(1, 9)) if pad is None else pad)
    return RaggedSlot(name, tokens, n + extra, hq, hk, d, ps, pps, pool, q_lens, kv_lens, dtype)


def _long_lengths(rng, lengths: tuple[int, ...], q: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (1, q, 0, 2), (lengths[0], lengths[1], 5, 9)


def _quick(rng) -> dict[str, RaggedSlot]:
    """Fixed shapes: ``num_tokens`` (64 or the long slot's 16) and the pool fixed, the mix redrawn per seed."""
    def fixed(name, n, max_q, hq, hk, d, ps, pps, dtype, tokens=64):
        s = _slot(rng, name, n, max_q, hq, hk, d, ps, pps, dtype, extra_seqs=3)
        while sum(s.q_lens) >= tokens:  # a mix that fits the fixed token count, every row of padding past it
            s = _slot(rng, name, n, max_q, hq, hk, d, ps, pps, dtype, extra_seqs=3)
        return RaggedSlot(name, tokens, n + 3, hq, hk, d, ps, pps, 4 * (n + 3) * pps, s.q_lens, s.kv_lens, dtype)
    s = {"serve16": fixed("serve16", 9, 6, 4, 2, 16, 16, 3, "bfloat16"),
         "chunk32": fixed("chunk32", 7, 12, 2, 1, 32, 32, 2, "float32"),
         "mid64": fixed("mid64", 6, 12, 4, 4, 16, 64, 2, "bfloat16"),
         "tpu128": fixed("tpu128", 5, 12, 4, 2, 16, 128, 2, "float32"),
         "wide256": fixed("wide256", 5, 10, 3, 1, 32, 256, 2, "bfloat16"),
         "odd": fixed("odd", 7, 10, 4, 1, 16, 24, 4, "bfloat16")}
    s["long"] = RaggedSlot("long", 16, 6, 2, 1, 16, 8, 4126, INDEX_LIMIT + 2048,
                           *_long_lengths(rng, (32_768, 33_003), 3), "bfloat16")
    s["solo"] = RaggedSlot("solo", 16, 3, 4, 2, 32, 16, 4, 48, *_solo(rng, 64, 15), "float32")
    return s


def _solo(rng, full: int, max_q: int) -> tuple[tuple[int], tuple[int]]:
    """One sequence's ``(q_lens, kv_lens)``: a decode row, a chunk or a whole prompt, equally likely."""
    kind = str(rng.choice(["decode", "chunk", "prompt"]))
    kv = int(rng.integers(2, min(max_q if kind == "prompt" else full, full) + 1))
    q = {"decode": 1, "prompt": kv, "chunk": int(rng.integers(1, min(kv, max_q + 1)))}[kind]
    return (q,), (kv,)


@functools.lru_cache(maxsize=16)
def draw_ragged_slots(seed: int, level: str = "full") -> dict[str, RaggedSlot]:
    """The slots of ``seed`` at ``level`` (module docstring), by name."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    rng = _rng(seed, "ragged shapes")
    if level == "quick":
        return _quick(rng)

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    g = [int(x) for x in rng.permutation(GROUPS)]
    odd_group, odd_page = int(rng.choice(ODD_GROUPS)), int(rng.choice(ODD_PAGE_SIZES))
    s = {"serve16": _slot(rng, "serve16", r(24, 64), 16, 2 * g[0], 2, 128, 16, r(8, 16), "bfloat16"),
         "chunk32": _slot(rng, "chunk32", r(8, 16), 48, g[1], 1, 64, 32, r(4, 8), "float32"),
         "mid64": _slot(rng, "mid64", r(6, 12), 80, 4 * g[2], 4, 64, 64, r(2, 5), "bfloat16"),
         "tpu128": _slot(rng, "tpu128", r(5, 8), 160, 2 * g[3], 2, 128, 128, r(2, 4), "float32"),
         "wide256": _slot(rng, "wide256", r(5, 6), 300, odd_group, 1, 256, 256, r(2, 3), "bfloat16"),
         "odd": _slot(rng, "odd", r(6, 12), 40, g[0], 1, 64, odd_page, r(3, 8), "bfloat16")}
    lengths = (16 * r(2049, 4096), r(65_537, 131_072))
    pps = -(-max(lengths) // 16) + r(1, 8)
    s["long"] = _slot(rng, "long", 4, 8, 8, 1, 64, 16, pps, "bfloat16", lengths=_long_lengths(rng, lengths, r(2, 8)),
                      least_pool=INDEX_LIMIT + r(4096, 8192))
    solo_pages = r(4, 16)
    s["solo"] = _slot(rng, "solo", 1, 512, 8, 2, 128, 32, solo_pages, "bfloat16",
                      lengths=_solo(rng, 32 * solo_pages, 512))
    return s
