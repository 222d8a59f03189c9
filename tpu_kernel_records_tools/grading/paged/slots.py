"""The paged rubric's slots: the shapes, page sizes, pools and lengths its problems are drawn at.

Two levels, as for the dense contract (``grading.dense.slots``): ``"full"`` draws every slot by seed, ``"quick"``
keeps fixed small sizes (every seed reuses the programs compiled once) with the same probes. A slot fixes
the shape, dtype, flags and ``kv_lengths``; the values, the page table and the pool's layout are drawn per
problem (``grading.paged.problems``).

The full distribution (``r(a, b)`` uniform integer in ``[a, b]``; ``G`` a per-seed permutation of the groups
1, 2, 4, 8; ``O`` one of the groups 3, 5, 6, 7; ``E(ps, pps)`` the edge lengths 0, 1, ps - 1, ps, ps + 1,
2 ps and the full table ``pps * ps``, the rest of the batch distinct lengths drawn in ``[2, pps * ps - 1]``,
shuffled):

=========  ==========  =========  ============  ====  ===============  =========  ============  =========
slot       batch       q_len      heads q/kv    d     page_size        pages/seq  kv_lengths    dtype
=========  ==========  =========  ============  ====  ===============  =========  ============  =========
vllm16     r(24, 64)   1          2 G[0] / 2    128   16               r(24, 40)  E             bfloat16
spec32     r(8, 12)    r(2, 8)    G[1] / 1      64    32               r(6, 12)   E             float32
tpu128     r(7, 9)     r(1, 4)    4 G[2] / 4    128   128              r(3, 5)    E             float32
odd        r(7, 10)    r(2, 8)    G[3] / 1      64    24, 40 or 48     r(4, 8)    E             bfloat16
single     1           r(1, 8)    2 O / 2       64    64               r(4, 10)   one, ragged   float32
long       2           r(1, 8)    8 / 1         64    16               +r(1, 8)   see below     bfloat16
=========  ==========  =========  ============  ====  ===============  =========  ============  =========

``long``: one sequence of ``16 r(2049, 4096)`` keys (32,784-65,536, an exact multiple of the page size) and one
of ``r(65537, 131072)``: past every 16-bit length and position, 2,049-8,192 pages per sequence (past 128),
and a pool of ``max(3 x the pages used, 2^15 + r(4096, 8192))`` pages, so page indices run past 2^15; the
table has 1-8 entries past the longer sequence's last page. Every slot is causal with the default scale,
and every pool is several times (3-4x) larger than the pages its sequences use (``POOL_FACTOR``).

The quick level: the same slots at ``head_dim`` 16-32 and a few pages per sequence (page sizes 16, 32, 128
and 24 kept; ``long`` at page size 8 with lengths 32,768 and 33,003 in a pool of 2^15 + 2,048 pages), each
pool a fixed size, so only the lengths' values change with the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from dataclasses import dataclass

import numpy as np

from ...grading.dense.slots import LEVELS

PAGE_SIZES = (16, 32, 128)
ODD_PAGE_SIZES = (24, 40, 48)  # no power of two
GROUPS = (1, 2, 4, 8)
ODD_GROUPS = (3, 5, 6, 7)
POOL_FACTOR = (3, 4)  # a pool holds 3-4 times the pages its sequences use (``long``: also past 2^15 pages)
INDEX_LIMIT = 1 << 15  # page indices past it: a kernel that keeps them in int16 wraps
LONG_KEYS = (32_768, 131_072)  # the long slot's sequence lengths lie in this range
SLOTS = ("vllm16", "spec32", "tpu128", "odd", "single", "long")


@dataclass(frozen=True)
class PagedSlot:
    """One slot: the call's shape, pool, lengths, dtype and flags (see the module docstring).

    ``num_pages`` is the pool's page count; ``lengths`` the ``kv_lengths`` of every problem drawn here."""

    name: str
    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    num_pages: int
    lengths: tuple[int, ...]
    dtype: str
    causal: bool = True
    scale: float | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def pages_used(self) -> int:
        """Pages the sequences' keys fill, without sharing (an upper bound of the pages a problem uses)."""
        return sum(-(-n // self.page_size) for n in self.lengths)

    def describe(self) -> str:
        """``name(batch, q_len, heads q/kv, d, page ps x pps, pool N)`` for problem labels."""
        return (f"{self.name}(b{self.batch}, q{self.q_len}, h{self.num_q_heads}/{self.num_kv_heads}, d{self.head_dim}, "
                f"page {self.page_size}x{self.pages_per_sequence}, pool {self.num_pages})")


def _rng(seed: int, what: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(what.encode())])


def edge_lengths(rng: np.random.Generator, batch: int, page_size: int, pages_per_sequence: int) -> tuple[int, ...]:
    """``batch`` distinct lengths: 0, 1, ``page_size - 1``, ``page_size``, ``page_size + 1``, ``2 page_size`` and
    the full table (``batch >= 7``), then distinct draws in ``[2, full - 1]``, shuffled."""
    full = page_size * pages_per_sequence
    edges = [0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, full]
    edges = list(dict.fromkeys(e for e in edges if e <= full))[:batch]
    rest = [x for x in range(2, full) if x not in edges]
    more = rng.choice(rest, size=batch - len(edges), replace=False) if batch > len(edges) else []
    return tuple(int(x) for x in rng.permutation(np.array([*edges, *more])))


def _pool(rng: np.random.Generator, used: int, least: int = 0) -> int:
    return max(used * int(rng.integers(POOL_FACTOR[0], POOL_FACTOR[1] + 1)), least, used + 2)


def _slot(rng, name, batch, q_len, hq, hk, d, ps, pps, dtype, lengths=None, least_pool=0) -> PagedSlot:
    lengths = edge_lengths(rng, batch, ps, pps) if lengths is None else tuple(int(x) for x in lengths)
    used = sum(-(-n // ps) for n in lengths)
    return PagedSlot(name, batch, q_len, hq, hk, d, ps, pps, _pool(rng, used, least_pool), lengths, dtype)


@functools.lru_cache(maxsize=16)
def draw_paged_slots(seed: int, level: str = "full") -> dict[str, PagedSlot]:
    """The slots of ``seed`` at ``level`` (module docstring), by name."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    rng = _rng(seed, "paged shapes")

    def r(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    groups = [int(x) for x in rng.permutation(GROUPS)]
    odd_group = int(rng.choice(ODD_GROUPS))
    odd_page = int(rng.choice(ODD_PAGE_SIZES))
    s = {}
    if level == "quick":
        s["vllm16"] = _slot(rng, "vllm16", 9, 1, 4, 2, 16, 16, 4, "bfloat16")
        s["spec32"] = _slot(rng, "spec32", 8, 4, 2, 1, 32, 32, 3, "float32")
        s["tpu128"] = _slot(rng, "tpu128", 7, 2, 4, 4, 16, 128, 3, "float32")
        s["odd"] = _slot(rng, "odd", 7, 3, 4, 1, 16, 24, 4, "bfloat16")
        s["single"] = _slot(rng, "single", 1, 3, 6, 2, 16, 64, 3, "float32", lengths=(150,))
        s["long"] = _slot(rng, "long", 2, 2, 2, 1, 16, 8, 4126, "bfloat16", lengths=(32_768, 33_003))
        # Fixed pools (4x the fullest tables; the long one past 2^15): the same shapes, so the same programs, on
        # every seed.
        return {n: dataclasses.replace(x, num_pages=INDEX_LIMIT + 2048 if n == "long" else
                                       4 * x.batch * x.pages_per_sequence) for n, x in s.items()}
    s["vllm16"] = _slot(rng, "vllm16", r(24, 64), 1, 2 * groups[0], 2, 128, 16, r(24, 40), "bfloat16")
    s["spec32"] = _slot(rng, "spec32", r(8, 12), r(2, 8), groups[1], 1, 64, 32, r(6, 12), "float32")
    s["tpu128"] = _slot(rng, "tpu128", r(7, 9), r(1, 4), 4 * groups[2], 4, 128, 128, r(3, 5), "float32")
    s["odd"] = _slot(rng, "odd", r(7, 10), r(2, 8), groups[3], 1, 64, odd_page, r(4, 8), "bfloat16")
    pps = r(4, 10)
    s["single"] = _slot(rng, "single", 1, r(1, 8), 2 * odd_group, 2, 64, 64, pps, "float32",
                        lengths=(r(2, 64 * pps - 1),))
    lengths = (16 * r(LONG_KEYS[0] // 16 + 1, 4096), r(65_537, LONG_KEYS[1]))
    pps = -(-max(lengths) // 16) + r(1, 8)
    s["long"] = _slot(rng, "long", 2, r(1, 8), 8, 1, 64, 16, pps, "bfloat16", lengths=lengths,
                      least_pool=INDEX_LIMIT + r(4096, 8192))
    return s
