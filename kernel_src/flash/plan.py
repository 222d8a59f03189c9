"""What every flash lowering shares: block sizes, the call's plan, VMEM tiles, online softmax.

Block skipping (``kernel_src.flash.block_skipping``): a grid or loop walks only the key blocks a
query block needs (and the query blocks a key block needs).

Features (``kernel_src.contract``): the window and segment ids are part of each tile's mask
(``block_skipping.visible_tile``); the soft-cap is applied to the logits (``logits``) and its slope
``1 - tanh^2`` to ``dS`` in the backward; a sink starts each row's running max and sum
(``initial_stats``: ``m = sink``, ``l = 1``), so it joins the denominator in the max-shifted frame
and, being no key, contributes no value; ``dsinks`` comes from the log-sum-exp and ``di``
(``sink_grads``).

Numerics. Logits, running max, running sum and the output accumulator are fp32; probabilities
are rounded to the input dtype before ``P·V`` (the contract allows it). The forward keeps the fp32
log-sum-exp; the backward recomputes ``P = exp(S - lse)`` and uses ``di = rowsum(dO ⊙ O)``.
A row with no visible key accumulates nothing (every probability of its tiles is masked to 0),
so its output is exactly 0 and, its probabilities being masked in the backward too, so are its
gradients; without a sink it has ``l == 0`` and its log-sum-exp is ``+inf``, with one ``l = 1``
and the log-sum-exp is the sink. Padded query rows (past ``q_len``) see no key.

The block maths takes a ``widen(stat, width)`` that turns row statistics into ``[rows, width]``:
Mosaic keeps them lane-replicated ``[rows, 128]`` (``kernel_src.flash.tpu``), Triton as
``[rows, 1]`` (``kernel_src.flash.gpu``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax

from kernel_src import backend

LANES = 128
TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: x @ y.T
F32 = jnp.float32

Widen = Callable[[jax.Array, int], jax.Array]

# How the Mosaic kernels see the heads of ``[batch, seq, heads, head_dim]``:
#   "heads": as they are, a block ``(rows, heads, d)`` (Mosaic of jax >= 0.7);
#   "rows":  the free view ``[batch, seq * heads, d]``, a block ``(rows * heads, d)`` whose head
#            ``h`` is every ``heads``-th row (jax < 0.7, whose Mosaic cannot index a head);
#   "flat":  ``[batch, seq, heads * d]``, a head a lane window (a relayout copy on TPU): where
#            "rows" is no free view, and always for Triton.
Layout = Literal["heads", "rows", "flat"]
LAYOUTS: tuple[Layout, ...] = ("heads", "rows", "flat")
HEADS_IN_PLACE = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 7)


def rows_view_is_free(num_heads: int, head_dim: int) -> bool:
    """Whether XLA's tiled TPU layout of ``[b, s, heads, d]`` is, byte for byte, that of
    ``[b, s * heads, d]``: whole 128-lane rows, and heads that fill their sublane tiles (1, 2,
    4 or a multiple of 8), as the v5e compiler confirms (a bitcast, no copy, in bf16 and fp32).
    Every such count above 1 is even, as the 16-bit head pairs of ``tpu`` need."""
    return head_dim % LANES == 0 and (num_heads in (1, 2, 4) or num_heads % 8 == 0)


def mosaic_layout(num_q_heads: int, num_kv_heads: int, head_dim: int) -> Layout:
    """The layout compiled Mosaic kernels take under the installed jax (see ``Layout``)."""
    if HEADS_IN_PLACE:
        return "heads"
    free = all(rows_view_is_free(h, head_dim) for h in (num_q_heads, num_kv_heads))
    return "rows" if free else "flat"


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes (query rows, key rows) of the three kernels; they change speed, not results.

    Blocks larger than the (rounded-up) sequence are shrunk to it, and sequences are padded to a
    common multiple of the query (resp. key) blocks. Compiled for TPU every block must be a
    multiple of 128; for Triton a power of two, at least 16; in interpret mode any multiple of 8.

    Attributes:
      block_q, block_k: forward kernel.
      block_q_dq, block_k_dq: dQ kernel.
      block_q_dkv, block_k_dkv: dK/dV kernel.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 128
    block_q_dkv: int = 128
    block_k_dkv: int = 128

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0 or value % 8:
                raise ValueError(f"{field.name} must be a positive multiple of 8, got {value!r}")

    @classmethod
    def for_platform(cls, platform: str | None = None) -> FlashBlockSizes:
        """Defaults for ``"tpu"``, ``"gpu"`` or ``"cpu"`` (the default backend's when ``None``).

        TPU: lane-aligned tiles, untuned. GPU: powers of two sized for Triton. CPU (interpret
        mode, whose cost grows with grid steps): large tiles, so few steps.
        """
        platform = platform or backend.platform()
        if platform == "tpu":
            return cls(block_q=512, block_k=512, block_q_dq=256, block_k_dq=512,
                       block_q_dkv=256, block_k_dkv=512)
        if platform == "gpu":
            return cls(block_q=128, block_k=64, block_q_dq=64, block_k_dq=64,
                       block_q_dkv=64, block_k_dkv=64)
        return cls(block_q=1024, block_k=1024, block_q_dq=1024, block_k_dq=1024,
                   block_q_dkv=1024, block_k_dkv=1024)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static facts of one call: the unpadded problem, the fitted blocks, how to lower."""

    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    causal: bool
    scale: float
    blocks: FlashBlockSizes
    variant: str
    interpret: Any
    kv_heads_per_step: int | None = None  # Mosaic: kv heads one grid step holds; None = all
    layout: Layout = "heads"  # how the Mosaic kernels see the heads (Triton: always flat)
    flat_head_dim: int | None = None  # layout "flat": the (lane-padded) d of one head
    window: tuple[int | None, int | None] | None = None  # (left, right) keys around a row's position
    softcap: float | None = None  # logits become softcap * tanh(s / softcap)
    segments: bool = False  # segment ids given: masks and block tables use them
    sinks: bool = False  # one sink logit per query head

    @property
    def offset(self) -> int:
        """A query row's position minus its index (bottom-right alignment)."""
        return self.kv_len - self.q_len

    @property
    def reach(self) -> tuple[int | None, int | None]:
        """``(left, right)``: how far before and after its position a row may see, None for no
        bound; ``causal`` is a right bound of 0."""
        left, right = self.window or (None, None)
        if self.causal:
            right = 0
        return left, right

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_head_block(self) -> int:
        return self.kv_heads_per_step or self.num_kv_heads

    @property
    def q_head_block(self) -> int:
        return self.kv_head_block * self.group


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def next_power_of_two(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def fit_blocks(blocks: FlashBlockSizes, q_len: int, kv_len: int, variant: str,
               compiled: bool) -> FlashBlockSizes:
    """Check ``blocks`` for the target and shrink each to its (rounded-up) sequence length."""
    granule = 16 if variant == "triton" else (LANES if compiled else 8)
    fitted = {}
    for field in dataclasses.fields(blocks):
        block = getattr(blocks, field.name)
        if compiled and variant == "mosaic" and block % LANES:
            raise ValueError(f"{field.name}={block}: TPU blocks must be multiples of {LANES}")
        if compiled and variant == "triton" and (block < 16 or block & (block - 1)):
            raise ValueError(f"{field.name}={block}: Triton blocks must be powers of two >= 16")
        length = q_len if field.name.startswith("block_q") else kv_len
        limit = round_up(max(length, 1), granule)
        if variant == "triton":
            limit = next_power_of_two(limit)
        fitted[field.name] = min(block, limit)
    return FlashBlockSizes(**fitted)


# --------------------------------------------------------------------------------------------
# Mosaic tiles chosen by the plan: per phase the fitting tiles that re-read least, double-buffered.

VMEM_LIMIT = 32 * 2 ** 20  # bytes of scoped VMEM the Mosaic kernels ask for on most TPUs
VMEM_BUDGET = 24 * 2 ** 20  # what the estimate may use of it: room for Mosaic's own temporaries
# Chips with 128 MiB of VMEM per core (v5e, v6e): twice the room, so query (dK/dV: key) tiles
# twice as long, and K/V (Q/dO) re-read about half as often.
LARGE_VMEM_LIMIT = 64 * 2 ** 20
LARGE_VMEM_BUDGET = 48 * 2 ** 20
LARGE_VMEM_KINDS = ("TPU v5 lite", "TPU v5e", "TPU v6 lite", "TPU v6e")


def vmem_limits() -> tuple[int, int]:
    """``(limit, budget)``: the scoped VMEM compiled Mosaic kernels ask for and what the tiles'
    ``vmem_estimate`` may use of it. ``LARGE_*`` where the chip has 128 MiB of VMEM: the default
    backend's TPU when there is one (its ``device_kind``), and when there is none, the TPU v5e
    that a deviceless compile targets (``jax.experimental.topologies``, the static plan)."""
    if backend.platform() == "tpu":
        kind = str(jax.devices()[0].device_kind)
        if not any(kind.startswith(k) for k in LARGE_VMEM_KINDS):
            return VMEM_LIMIT, VMEM_BUDGET
    return LARGE_VMEM_LIMIT, LARGE_VMEM_BUDGET
TILE_CHOICES = (1024, 512, 256, 128)
# The forward in the "heads" layout: its estimate is calibrated against the v5e compiler (below),
# so it may use the scoped limit (4/3 of each budget above) less this headroom, and take query
# tiles of up to 2048 rows (K/V fetched half as often again as at 1024).
FORWARD_HEADROOM = 2 * 2 ** 20
FORWARD_ROWS = (2048,) + TILE_CHOICES
# The largest tile (query rows x key rows) the "heads" layout takes. Mosaic compiles each head's
# tile maths fully unrolled: at 1024 x 1024 one 4/2-head forward took ~12 GB of host memory and
# ~210 s to compile for v5e (deviceless), at 1024 x 512 a few seconds. 2048 x 256 and 2048 x 128
# stay under it.
MAX_TILE_AREA = 1024 * 512
# The inner tile of the backward kernels in that layout (dQ's key rows, dK/dV's query rows). The
# outer block decides how often K/V (Q/dO) are fetched; a longer inner tile only lets consecutive
# outer blocks share one block without a new fetch (the plan: 16/16 heads, seq 2048, VJP 1,349 MB
# at 256 rows, 1,281 MB at 1024). A 512-row inner tile made one 4/2-head dQ compile take ~6 GB
# and ~86 s (256 rows: ~3 GB and 45 s for the whole VJP).
BACKWARD_INNER_ROWS = 256
_SUBLANES = 8  # a [1, rows] statistic row takes 8 sublanes of VMEM


def phase_budget(phase: str, layout: Layout, budget: int) -> int:
    """What ``vmem_estimate`` of ``phase`` may use under ``budget``: the budget, except the
    calibrated forward of the "heads" layout (``FORWARD_HEADROOM``)."""
    if phase == "fwd" and layout == "heads":
        return budget + budget // 3 - FORWARD_HEADROOM
    return budget


def vmem_estimate(phase: str, block_q: int, block_k: int, kv_heads: int, group: int,
                  head_dim: int, itemsize: int, layout: Layout = "heads",
                  segments: bool = False) -> int:
    """Bytes of VMEM one grid step of ``phase`` (``fwd``, ``dq``, ``dkv``) needs: its blocks
    twice (double buffering), its fp32 scratch, and about four fp32 ``[block_q, block_k]`` tiles
    of intermediates (scores, probabilities, their gradients).

    A ``(rows, heads, head_dim)`` block is tiled in VMEM on its last two dims, the heads padded
    to whole sublane tiles (8 rows of 32 bits: 16 heads in bf16), so 2 or 4 heads take the room
    of 16: matched within 1% by the VMEM the v5e compiler reserved at 128 x 128 tiles, 4/2 heads.
    The "rows" and "flat" layouts pad no head; "rows" in 16 bits adds the 32-bit copy of each
    input block that its heads are read from (``tpu``).

    The forward of the "heads" layout is calibrated against the VMEM the v5e compiler (libtpu
    0.0.42.1, jax 0.10.2) reserved with a log-sum-exp, bf16, head_dim 128: a multiple of 8 heads
    is not padded, and writing the log-sum-exp takes about 1.8 fp32 ``[block_q, 128]`` tiles per
    query head besides (counted as 2). Estimated / reserved: 61.0 / 58.2 MiB at 32 / 8 heads,
    512 x 256 tiles; 62.0 / 57.8 MiB at 8 of 16 / 16 heads per step, 2048 x 128. dQ and dK/dV
    keep the padded count: there the compiler reserved 26-31 MiB where it says 39-47.

    ``segments``: the id blocks besides (int32 lane-replicated ``[rows, 128]`` on the outer side,
    a ``[1, rows]`` row of 8 sublanes on the inner one, twice each) and the widened ids of a tile.
    """
    q_heads = kv_heads * group
    sublanes = _SUBLANES * max(1, 4 // itemsize) if layout == "heads" else 1
    calibrated = layout == "heads" and phase == "fwd"

    def tile(rows: int, heads: int) -> int:
        if calibrated and heads % _SUBLANES == 0:
            return rows * heads * head_dim * itemsize
        return rows * round_up(heads, sublanes) * head_dim * itemsize

    q_tile, kv_tile = tile(block_q, q_heads), tile(block_k, kv_heads)  # q/o/dO/dQ; k/v/dK/dV
    stat = q_heads * _SUBLANES * block_q * 4  # lse or di: fp32 [q heads, 1, block_q]
    lanes = q_heads * block_q * LANES * 4  # a lane-replicated fp32 statistic in scratch
    blocks, scratch = {
        "fwd": (2 * q_tile + 2 * kv_tile + stat, 2 * lanes + q_heads * block_q * head_dim * 4),
        "dq": (4 * q_tile + 2 * kv_tile + 2 * stat, 2 * lanes + q_heads * block_q * head_dim * 4),
        "dkv": (2 * q_tile + 4 * kv_tile + 2 * stat, 2 * kv_heads * block_k * head_dim * 4),
    }[phase]
    if layout == "rows" and itemsize < 4:  # q (fwd) or q and dO words, and K and V words
        scratch += (1 if phase == "fwd" else 2) * q_tile + 2 * kv_tile
    if calibrated:  # the log-sum-exp's lane-replicated temporaries
        scratch += 2 * lanes
    if segments:
        outer, inner = (block_k, block_q) if phase == "dkv" else (block_q, block_k)
        blocks += outer * LANES * 4 + _SUBLANES * inner * 4
        scratch += block_q * block_k * 4
    return 2 * blocks + scratch + 4 * block_q * block_k * 4


def _head_blocks(num_kv_heads: int, group: int) -> list[int]:
    """kv heads per grid step that Mosaic accepts: all of them, or a multiple of 8 dividing
    them (the heads axis is the second-minor of the 4-D block), most first."""
    return [h for h in range(num_kv_heads, 0, -1) if num_kv_heads % h == 0
            and (h == num_kv_heads or (h % _SUBLANES == 0 and h * group % _SUBLANES == 0))]


def window_span(window: tuple[int | None, int | None] | None, causal: bool) -> int | None:
    """Keys one row may see at most under ``window`` (None: unbounded)."""
    if window is None or window[0] is None or (window[1] is None and not causal):
        return None
    return window[0] + 1 + (0 if causal else window[1])


# A window's span over this many tiles at least: the keys a query block reads beyond its rows'
# windows (about a tile on each side) stay about 1/8 of what it reads.
WINDOW_TILES = 8


def tpu_tiles(q_len: int, kv_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
              itemsize: int, budget: int | None = None,
              layout: Layout | None = None, span: int | None = None,
              segments: bool = False) -> tuple[FlashBlockSizes, int]:
    """``(blocks, kv heads per step)`` for compiled Mosaic: per phase the tiles whose
    ``vmem_estimate`` fits ``budget`` (``vmem_limits()``'s when ``None``) with the longest outer
    block (the query block of the forward and dQ, the key block of dK/dV: each K/V (resp. Q, dO)
    tile is fetched again for every outer block that needs it, so HBM traffic falls as it grows),
    then the most ``block_q * block_k``; for the head block that allows the longest outer blocks,
    then the largest tiles (more heads on a tie; all heads in the "rows" layout, whose block rows
    interleave them). Tiles are shrunk to the (128-rounded) sequence first; 128 x 128 is the
    floor; the forward of the "heads" layout may take 2048 query rows within its own room
    (``phase_budget``), and no tile of that layout exceeds ``MAX_TILE_AREA`` nor, in dQ and dK/dV,
    ``BACKWARD_INNER_ROWS`` inner rows. ``layout``:
    ``mosaic_layout``'s when ``None``. ``span`` (``window_span``): with a window, no tile is longer
    than ``span / WINDOW_TILES`` (128 at least), so each block reads little past its rows' windows.
    ``segments``: the id blocks count too (``vmem_estimate``)."""
    group = num_q_heads // num_kv_heads
    budget = vmem_limits()[1] if budget is None else budget
    layout = layout or mosaic_layout(num_q_heads, num_kv_heads, head_dim)
    q_cap, kv_cap = round_up(max(q_len, 1), LANES), round_up(max(kv_len, 1), LANES)
    if span is not None:
        longest = max([t for t in TILE_CHOICES if t <= span // WINDOW_TILES] or [LANES])
        q_cap, kv_cap = min(q_cap, longest), min(kv_cap, longest)
    best = None
    head_blocks = [num_kv_heads] if layout == "rows" else _head_blocks(num_kv_heads, group)
    for heads in head_blocks:
        chosen = []
        for phase in ("fwd", "dq", "dkv"):
            outer = 1 if phase == "dkv" else 0
            rows = FORWARD_ROWS if phase == "fwd" and layout == "heads" else TILE_CHOICES
            pairs = sorted({(min(bq, q_cap), min(bk, kv_cap)) for bq in rows
                            for bk in TILE_CHOICES}, key=lambda t: (t[outer], t[0] * t[1]),
                           reverse=True)
            if layout == "heads":
                inner = BACKWARD_INNER_ROWS if phase != "fwd" else max(t[1 - outer] for t in pairs)
                pairs = [t for t in pairs if t[0] * t[1] <= MAX_TILE_AREA and t[1 - outer] <= inner]
            room = phase_budget(phase, layout, budget)
            fits = [t for t in pairs if vmem_estimate(phase, *t, heads, group, head_dim,
                                                      itemsize, layout, segments) <= room]
            chosen.append(fits[0] if fits else pairs[-1])
        outers = [chosen[0][0], chosen[1][0], chosen[2][1]]
        score = (min(outers), sum(outers), min(bq * bk for bq, bk in chosen))
        if best is None or score > best[0]:
            best = (score, chosen, heads)
    _, ((bq, bk), (bq_dq, bk_dq), (bq_dkv, bk_dkv)), heads = best
    return FlashBlockSizes(bq, bk, bq_dq, bk_dq, bq_dkv, bk_dkv), heads


# --------------------------------------------------------------------------------------------
# Online softmax and its backward, on one (query block, key block) tile.


def logits(q, k, plan: Plan):
    """``(s, t)``: fp32 logits ``[rows of q, rows of k]``, scaled and soft-capped, and the
    cap's ``tanh`` (for its slope in the backward; None without a cap)."""
    s = lax.dot_general(q, k, TRANS_B, preferred_element_type=F32) * plan.scale
    if plan.softcap is None:
        return s, None
    t = jnp.tanh(s / plan.softcap)
    return plan.softcap * t, t


def scores(q, k, mask, plan: Plan):
    """Masked, scaled (capped) fp32 logits ``[block_q, block_k]`` (masked entries ``-inf``);
    ``mask`` ``None`` for a tile no mask cuts."""
    s, _ = logits(q, k, plan)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def initial_stats(sink, shape):
    """Running max and sum before the first key block: ``-inf`` and 0, or with a sink (a scalar)
    ``m = sink`` and ``l = exp(sink - m) = 1`` (0 for a sink of ``-inf``)."""
    if sink is None:
        return jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32)
    m = jnp.full(shape, sink, F32)
    return m, jnp.where(m == -jnp.inf, 0.0, 1.0).astype(F32)


def online_softmax_step(s, v, m_prev, l_prev, acc_prev, widen: Widen):
    """Fold one key block into the running max ``m``, sum ``l`` and output accumulator ``acc``."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with nothing visible yet
    p = jnp.exp(s - widen(m_safe, s.shape[1]))
    alpha = jnp.exp(m_prev - m_safe)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=F32)
    return m_next, l_next, acc_prev * widen(alpha, acc_prev.shape[1]) + pv


def finish(m, l, acc, widen: Widen):
    """``(out fp32, lse)``; rows with ``l == 0`` give out 0 and lse ``+inf``."""
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc * widen(jnp.where(empty, 0.0, 1.0 / l_safe), acc.shape[1])
    return out, jnp.where(empty, jnp.inf, m + jnp.log(l_safe))


def score_grads(q, k, v, do, lse, di, mask, plan: Plan, widen: Widen):
    """Recomputed probabilities ``P`` and logit gradients ``dS`` (the cap's slope and the scale
    folded in), fp32, ``[rows of q, rows of k]``; ``mask`` ``None`` for a tile no mask cuts.
    ``widen(stat, width)`` turns ``lse`` and ``di`` into that shape."""
    s, t = logits(q, k, plan)
    width = s.shape[1]
    p = jnp.exp(s - widen(lse, width))
    p = p if mask is None else jnp.where(mask, p, 0.0)
    dp = lax.dot_general(do, v, TRANS_B, preferred_element_type=F32)
    return p, logit_grads(p, dp, widen(di, width), t, plan)


def logit_grads(p, dp, di, t, plan: Plan):
    """``dS = P ⊙ (dP - di)`` through the cap's slope ``1 - tanh^2`` (``t``: ``logits``'s) and
    the scale: the gradient of the unscaled ``q·k``."""
    ds = p * (dp - di)
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds * plan.scale


def sink_grads(sinks, lse, di, q_len: int):
    """``dsinks`` fp32 ``[heads]`` from the log-sum-exp (sink included) and ``di = rowsum(dO ⊙ O)``,
    both fp32 ``[batch, heads, q_pad]``: ``-sum over rows of exp(sink - lse) * di`` (the sink's
    probability times ``d lse / d sink``'s share of each row's loss)."""
    lse, di = lse[:, :, :q_len], di[:, :, :q_len]
    p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - lse)
    return -jnp.sum(p_sink * di, axis=(0, 2))
