"""Fused flash attention in Pallas: online-softmax forward, log-sum-exp backward (FlashAttention-2).

One kernel owns the whole of attention: ``Q·Kᵀ``, the masked softmax and ``P·V`` never leave
on-chip memory, unlike ``kernel_src.attention`` where XLA does the two matrix multiplications.

Layout. The API takes the contract layout ``[batch, seq, heads, head_dim]``. The Mosaic (TPU)
kernels view it, by a free reshape, as ``[batch, seq, heads * head_dim]``: one head's tile is the
``(block, head_dim)`` window at column block ``head``, so no transpose is needed, and grouped-query
attention is the kv column block ``head // group`` in a ``BlockSpec`` index map: K and V are read
in place, never repeated. Sequences are zero-padded to whole blocks inside the wrapper (padded
keys are masked, padded query rows sliced off); on TPU a ``head_dim`` that is not a multiple of
128 is zero-padded too, which changes no logit and no kept output column.

Skipping. Key block ``ki`` is needed by query block ``qi`` iff it holds a key some row of ``qi``
may see (bottom-right causal, ``kv_lengths``). The needed blocks are always a prefix
``[0, n(qi))``. A skipped grid step computes nothing (``pl.when``) and its K/V index map repeats
the last needed block, so the pipeline issues no new DMA for it (the trick of JAX's flash and
splash kernels). ``kv_lengths`` arrive by scalar prefetch (SMEM on TPU) for the index maps.

Numerics. Logits, running max, running sum and the output accumulator are fp32; probabilities
are rounded to the input dtype before ``P·V`` (the contract allows it). The forward saves the fp32
log-sum-exp; the backward recomputes ``P = exp(S - lse)`` and uses ``di = rowsum(dO ⊙ O)``.
A row with no visible key has ``l == 0``: its output is exactly 0, its log-sum-exp ``+inf``, so
its recomputed probabilities and all its gradients are exactly 0.

Lowerings. ``variant="mosaic"`` (TPU, and CPU interpret mode) carries the accumulators across
the innermost grid axis in VMEM scratch. ``variant="triton"`` (GPU) loops over key blocks inside
the kernel with power-of-two tiles, since Triton programs run in parallel and cannot carry state
across grid steps. What has been exercised: both variants run in interpret mode on CPU against a
float64 oracle, the Mosaic kernels lower to ``tpu_custom_call`` and the Triton kernels to Triton
IR via ``jax.export``. What has not: compiling or running either on a real TPU or GPU from this
repository's tests (the Triton path has never run on a GPU at all).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_src import backend
from kernel_src.contract import check_inputs, default_scale, visible

LANES = 128
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: x @ y.T
_F32 = jnp.float32

Variant = Literal["mosaic", "triton"]


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
class _Plan:
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

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _fit_blocks(blocks: FlashBlockSizes, q_len: int, kv_len: int, variant: str,
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
        limit = _round_up(max(length, 1), granule)
        if variant == "triton":
            limit = _next_power_of_two(limit)
        fitted[field.name] = min(block, limit)
    return FlashBlockSizes(**fitted)


# --------------------------------------------------------------------------------------------
# Block skipping: which key blocks a query block needs (shared by every kernel and index map).
# Integer division is lax.div on non-negative values: Mosaic lowers `//` on traced ints via sign().


def _num_key_blocks(qi, length, block_q: int, block_k: int, plan: _Plan):
    """``n``: key blocks ``[0, n)`` hold a key visible to some row of query block ``qi``."""
    end = length
    if plan.causal:
        end = jnp.minimum(end, (qi + 1) * block_q + (plan.kv_len - plan.q_len))
    return lax.div(jnp.maximum(end, 0) + (block_k - 1), block_k)


def _first_query_block(ki, block_q: int, block_k: int, num_q_blocks: int, plan: _Plan):
    """First query block needing key block ``ki``; all later ones do too, if ``ki`` is in range."""
    if not plan.causal:
        return 0
    first = lax.div(jnp.maximum(ki * block_k - (plan.kv_len - plan.q_len), 0), block_q)
    return jnp.minimum(first, num_q_blocks - 1)


def _key_in_range(ki, length, block_k: int):
    return ki * block_k < length


def _visible_tile(qi, ki, block_q: int, block_k: int, length, plan: _Plan):
    """``[block_q, block_k]`` visibility of one (query block, key block) tile, from iotas."""
    q_pos = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    k_pos = ki * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    return visible(q_pos, k_pos, plan.q_len, plan.kv_len, plan.causal, length)


# --------------------------------------------------------------------------------------------
# Block math shared by both lowerings. Mosaic keeps row statistics lane-replicated as
# [rows, 128] (TPU vreg layout) and widens them with `_lanes`; Triton keeps them as [rows, 1].


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """Lane-replicated row statistics ``[rows, 128]`` as ``[rows, width]``."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    if width % LANES == 0:
        if hasattr(pltpu, "repeat"):  # jax <= 0.6: the Mosaic lane-tiling op
            return pltpu.repeat(x, width // LANES, axis=1)
        return jnp.tile(x, (1, width // LANES))
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _columns(x: jax.Array, width: int) -> jax.Array:
    """Row statistics ``[rows, 1]`` broadcast to ``[rows, width]``."""
    return jnp.broadcast_to(x, (x.shape[0], width))


def _scores(q, k, mask, scale: float):
    """Masked, scaled fp32 logits ``[block_q, block_k]`` (masked entries ``-inf``)."""
    s = lax.dot_general(q, k, _TRANS_B, preferred_element_type=_F32) * scale
    return jnp.where(mask, s, -jnp.inf)


def _online_softmax_step(s, v, m_prev, l_prev, acc_prev, widen):
    """Fold one key block into the running max ``m``, sum ``l`` and output accumulator ``acc``."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with nothing visible yet
    p = jnp.exp(s - widen(m_safe, s.shape[1]))
    alpha = jnp.exp(m_prev - m_safe)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=_F32)
    return m_next, l_next, acc_prev * widen(alpha, acc_prev.shape[1]) + pv


def _finish(m, l, acc, widen):
    """``(out fp32, lse)``; rows with ``l == 0`` give out 0 and lse ``+inf``."""
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc * widen(jnp.where(empty, 0.0, 1.0 / l_safe), acc.shape[1])
    return out, jnp.where(empty, jnp.inf, m + jnp.log(l_safe))


def _score_grads(q, k, v, do, lse, di, mask, scale: float, widen):
    """Recomputed probabilities ``P`` and logit gradients ``dS`` (scale folded in), fp32."""
    s = lax.dot_general(q, k, _TRANS_B, preferred_element_type=_F32) * scale
    width = s.shape[1]
    p = jnp.where(mask, jnp.exp(s - widen(lse, width)), 0.0)
    dp = lax.dot_general(do, v, _TRANS_B, preferred_element_type=_F32)
    return p, p * (dp - widen(di, width)) * scale


# --------------------------------------------------------------------------------------------
# Mosaic (TPU) kernels. Grids carry accumulators across their last ("arbitrary") axes.


def _mosaic_forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                           m_scratch, l_scratch, acc_scratch, *, plan: _Plan, num_k_blocks: int):
    """Forward of one (batch, q head, query block, key block) grid step.

    lengths_ref: int32 ``[batch]`` key lengths (SMEM). q_ref: ``[block_q, head_dim]``; k_ref,
    v_ref: ``[block_k, head_dim]`` of kv head ``q head // group``. o_ref: ``[block_q, head_dim]``
    in the input dtype; lse_ref: fp32 ``[block_q, 128]`` lane-replicated log-sum-exp. Scratch:
    fp32 running max and sum ``[block_q, 128]``, accumulator ``[block_q, head_dim]``.
    """
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when(ki == 0)
    def _start():
        m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, _F32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, _F32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, _F32)

    @pl.when(ki < _num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
        s = _scores(q_ref[...], k_ref[...], mask, plan.scale)
        m, l, acc = _online_softmax_step(s, v_ref[...], m_scratch[...], l_scratch[...],
                                         acc_scratch[...], _lanes)
        m_scratch[...], l_scratch[...], acc_scratch[...] = m, l, acc

    @pl.when(ki == num_k_blocks - 1)
    def _store():
        out, lse = _finish(m_scratch[...], l_scratch[...], acc_scratch[...], _lanes)
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


def _mosaic_dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref,
                      dq_scratch, *, plan: _Plan, num_k_blocks: int):
    """dQ of one (batch, q head, query block, key block) grid step.

    q_ref, do_ref: ``[block_q, head_dim]``; k_ref, v_ref: ``[block_k, head_dim]``; lse_ref,
    di_ref: fp32 ``[block_q, 128]`` lane-replicated. dq_ref: ``[block_q, head_dim]`` in the input
    dtype, accumulated over key blocks in fp32 ``dq_scratch``.
    """
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when(ki == 0)
    def _start():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, _F32)

    @pl.when(ki < _num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        k = k_ref[...]
        mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
        _, ds = _score_grads(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], di_ref[...],
                             mask, plan.scale, _lanes)
        dq_scratch[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=_F32)

    @pl.when(ki == num_k_blocks - 1)
    def _store():
        dq_ref[...] = dq_scratch[...].astype(dq_ref.dtype)


def _mosaic_dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                       dk_scratch, dv_scratch, *, plan: _Plan, num_q_blocks: int):
    """dK and dV of one (batch, kv head, key block, head in group, query block) grid step.

    The query heads of a kv head's group are the second-to-last grid axis, so their
    contributions add up in the fp32 scratch: K and V are never repeated. q_ref, do_ref:
    ``[block_q, head_dim]`` of q head ``kv head * group + g``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, head_dim]``; lse_ref, di_ref: fp32 ``[block_q, 128]`` lane-replicated.
    """
    b, ki, g, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    length = lengths_ref[b]

    @pl.when((g == 0) & (qi == 0))
    def _start():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, _F32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, _F32)

    @pl.when(ki < _num_key_blocks(qi, length, block_q, block_k, plan))
    def _step():
        q, do = q_ref[...], do_ref[...]
        mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
        p, ds = _score_grads(q, k_ref[...], v_ref[...], do, lse_ref[...], di_ref[...], mask,
                             plan.scale, _lanes)
        dv_scratch[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=_F32)
        dk_scratch[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=_F32)

    @pl.when((g == plan.group - 1) & (qi == num_q_blocks - 1))
    def _store():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _mosaic_call(kernel, grid, in_specs, out_specs, out_shape, scratch, plan: _Plan, semantics):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(shape, _F32) for shape in scratch]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=plan.interpret,
    )


def _query_side_maps(plan: _Plan, block_q: int, block_k: int):
    """Index maps of the (batch, q head, qi, ki) grids: query tiles, and K/V tiles clamped so a
    skipped key block re-uses the last needed one (no DMA)."""

    def q_map(b, h, qi, ki, lengths):
        return b, qi, h

    def kv_map(b, h, qi, ki, lengths):
        n = _num_key_blocks(qi, lengths[b], block_q, block_k, plan)
        return b, jnp.minimum(ki, jnp.maximum(n - 1, 0)), lax.div(h, plan.group)

    return q_map, kv_map


def _key_side_maps(plan: _Plan, block_q: int, block_k: int, num_q_blocks: int):
    """Index maps of the dK/dV grid (batch, kv head, ki, g, qi): K/V tiles, and query-side tiles
    where a skipped step fetches the tile the next needed step uses (no extra DMA)."""

    def q_map(b, h, ki, g, qi, lengths):
        length = lengths[b]
        in_range = _key_in_range(ki, length, block_k)
        first = _first_query_block(ki, block_q, block_k, num_q_blocks, plan)
        qi = jnp.where(in_range, jnp.maximum(qi, first), num_q_blocks - 1)
        g = jnp.where(in_range, g, plan.group - 1)
        return b, qi, h * plan.group + g

    def kv_map(b, h, ki, g, qi, lengths):
        return b, ki, h

    return q_map, kv_map


def _mosaic_forward(q, k, v, lengths, plan: _Plan):
    """``(out [b, q_pad, hq*d], lse [b, q_pad, hq*128] fp32)`` from ``[b, seq_pad, heads*d]``."""
    batch, q_pad, _ = q.shape
    kv_pad = k.shape[1]
    d = q.shape[2] // plan.num_q_heads
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    grid = (batch, plan.num_q_heads, q_pad // bq, kv_pad // bk)
    q_map, kv_map = _query_side_maps(plan, bq, bk)
    kernel = functools.partial(_mosaic_forward_kernel, plan=plan, num_k_blocks=grid[3])
    return _mosaic_call(
        kernel, grid,
        in_specs=[pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bk, d), kv_map),
                  pl.BlockSpec((None, bk, d), kv_map)],
        out_specs=[pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bq, LANES), q_map)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, q_pad, plan.num_q_heads * LANES), _F32)],
        scratch=[(bq, LANES), (bq, LANES), (bq, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
    )(lengths, q, k, v)


def _mosaic_backward(q, k, v, lengths, lse, di, do, plan: _Plan):
    """``(dq, dk, dv)`` in the layouts of ``q, k, v``; lse and di lane-replicated fp32."""
    batch, q_pad, _ = q.shape
    kv_pad = k.shape[1]
    d = q.shape[2] // plan.num_q_heads
    blocks = plan.blocks

    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    grid = (batch, plan.num_q_heads, q_pad // bq, kv_pad // bk)
    q_map, kv_map = _query_side_maps(plan, bq, bk)
    q_spec, stat_spec = pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bq, LANES), q_map)
    kv_spec = pl.BlockSpec((None, bk, d), kv_map)
    dq = _mosaic_call(
        functools.partial(_mosaic_dq_kernel, plan=plan, num_k_blocks=grid[3]), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec], out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), scratch=[(bq, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
    )(lengths, q, k, v, do, lse, di)

    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    num_q_blocks = q_pad // bq
    grid = (batch, plan.num_kv_heads, kv_pad // bk, plan.group, num_q_blocks)
    q_map, kv_map = _key_side_maps(plan, bq, bk, num_q_blocks)
    q_spec, stat_spec = pl.BlockSpec((None, bq, d), q_map), pl.BlockSpec((None, bq, LANES), q_map)
    kv_spec = pl.BlockSpec((None, bk, d), kv_map)
    dk, dv = _mosaic_call(
        functools.partial(_mosaic_dkv_kernel, plan=plan, num_q_blocks=num_q_blocks), grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[(bk, d), (bk, d)], plan=plan,
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
    )(lengths, q, k, v, do, lse, di)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Triton (GPU) kernels: one program per output tile, loops over the other sequence inside.
# Views [batch, seq, heads, head_dim] (dK/dV: [batch, seq, kv_heads, group, head_dim]);
# statistics fp32 [batch, kv_heads, group, q_pad]. Never run on a GPU here.


def _triton_forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: _Plan):
    """Forward of one (batch, q head, query block) program.

    lengths_ref: int32 ``[batch_pad]``. q_ref, o_ref: ``[block_q, head_dim]``; k_ref, v_ref:
    ``[kv_pad, head_dim]`` of kv head ``q head // group``; lse_ref: fp32 ``[block_q]``.
    """
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k
    length = lengths_ref[b]
    q = q_ref[...]

    def body(ki, carry):
        keys = pl.ds(ki * block_k, block_k)
        mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
        s = _scores(q, k_ref[keys, :], mask, plan.scale)
        return _online_softmax_step(s, v_ref[keys, :], *carry, _columns)

    init = (jnp.full((block_q, 1), -jnp.inf, _F32), jnp.zeros((block_q, 1), _F32),
            jnp.zeros(q.shape, _F32))
    n = _num_key_blocks(qi, length, block_q, block_k, plan)
    out, lse = _finish(*lax.fori_loop(0, n, body, init), _columns)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.squeeze(lse, 1)


def _triton_dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, *,
                      plan: _Plan):
    """dQ of one (batch, q head, query block) program; shapes as in the forward, di like lse."""
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q, block_k = q_ref.shape[0], plan.blocks.block_k_dq
    length = lengths_ref[b]
    q, do = q_ref[...], do_ref[...]
    lse, di = lse_ref[...][:, None], di_ref[...][:, None]

    def body(ki, dq):
        keys = pl.ds(ki * block_k, block_k)
        k = k_ref[keys, :]
        mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
        _, ds = _score_grads(q, k, v_ref[keys, :], do, lse, di, mask, plan.scale, _columns)
        return dq + lax.dot(ds.astype(k.dtype), k, preferred_element_type=_F32)

    n = _num_key_blocks(qi, length, block_q, block_k, plan)
    dq_ref[...] = lax.fori_loop(0, n, body, jnp.zeros(q.shape, _F32)).astype(dq_ref.dtype)


def _triton_dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                       *, plan: _Plan):
    """dK, dV of one (batch, kv head, key block) program, summed over the group's q heads.

    q_ref, do_ref: ``[q_pad, group, head_dim]``; k_ref, v_ref, dk_ref, dv_ref:
    ``[block_k, head_dim]``; lse_ref, di_ref: fp32 ``[group, q_pad]``.
    """
    b, ki = pl.program_id(0), pl.program_id(2)
    block_k, block_q = k_ref.shape[0], plan.blocks.block_q_dkv
    q_pad = q_ref.shape[0]
    length = lengths_ref[b]
    k, v = k_ref[...], v_ref[...]
    num_q_blocks = q_pad // block_q
    first = _first_query_block(ki, block_q, block_k, num_q_blocks, plan)
    stop = jnp.where(_key_in_range(ki, length, block_k), num_q_blocks, first)
    grads = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    for g in range(plan.group):
        def body(qi, carry, g=g):
            dk, dv = carry
            rows = pl.ds(qi * block_q, block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, di = lse_ref[g, rows][:, None], di_ref[g, rows][:, None]
            mask = _visible_tile(qi, ki, block_q, block_k, length, plan)
            p, ds = _score_grads(q, k, v, do, lse, di, mask, plan.scale, _columns)
            return (dk + lax.dot(ds.astype(q.dtype).T, q, preferred_element_type=_F32),
                    dv + lax.dot(p.astype(do.dtype).T, do, preferred_element_type=_F32))
        grads = lax.fori_loop(first, stop, body, grads)
    dk_ref[...] = grads[0].astype(dk_ref.dtype)
    dv_ref[...] = grads[1].astype(dv_ref.dtype)


def _triton_call(kernel, grid, in_specs, out_specs, out_shape, plan: _Plan):
    from jax.experimental.pallas import triton as pltriton

    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
    )


def _triton_query_specs(plan: _Plan, block_q: int, d: int, kv_pad: int):
    """Specs of a (batch, q head, query block) grid: a query tile, its kv head's whole K/V, its
    statistics ``[block_q]`` in ``[batch, kv_heads, group, q_pad]``, the key lengths."""
    group = plan.group
    tile = pl.BlockSpec((None, block_q, None, d), lambda b, h, i: (b, i, h, 0))
    keys = pl.BlockSpec((None, kv_pad, None, d), lambda b, h, i: (b, 0, lax.div(h, group), 0))
    stat = pl.BlockSpec((None, None, None, block_q),
                        lambda b, h, i: (b, lax.div(h, group), lax.rem(h, group), i))
    return tile, keys, stat


def _triton_forward(q, k, v, lengths, plan: _Plan):
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, bq = plan.num_q_heads, plan.num_kv_heads, plan.blocks.block_q
    d = q.shape[2] // hq
    tile, keys, stat = _triton_query_specs(plan, bq, d, kv_pad)
    out, lse = _triton_call(
        functools.partial(_triton_forward_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[pl.BlockSpec(lengths.shape, lambda b, h, i: (0,)), tile, keys, keys],
        out_specs=[tile, stat],
        out_shape=[jax.ShapeDtypeStruct((batch, q_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((batch, hk, plan.group, q_pad), _F32)],
        plan=plan,
    )(lengths, q.reshape(batch, q_pad, hq, d), k.reshape(batch, kv_pad, hk, d),
      v.reshape(batch, kv_pad, hk, d))
    return out.reshape(q.shape), lse


def _triton_backward(q, k, v, lengths, lse, di, do, plan: _Plan):
    (batch, q_pad, _), kv_pad = q.shape, k.shape[1]
    hq, hk, group = plan.num_q_heads, plan.num_kv_heads, plan.group
    d = q.shape[2] // hq
    q4, do4 = q.reshape(batch, q_pad, hq, d), do.reshape(batch, q_pad, hq, d)
    k4, v4 = k.reshape(batch, kv_pad, hk, d), v.reshape(batch, kv_pad, hk, d)
    lengths_spec = pl.BlockSpec(lengths.shape, lambda b, h, i: (0,))

    bq = plan.blocks.block_q_dq
    tile, keys, stat = _triton_query_specs(plan, bq, d, kv_pad)
    dq = _triton_call(
        functools.partial(_triton_dq_kernel, plan=plan), (batch, hq, q_pad // bq),
        in_specs=[lengths_spec, tile, keys, keys, tile, stat, stat], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype), plan=plan,
    )(lengths, q4, k4, v4, do4, lse, di)

    # (batch, kv head, key block) grid: the kv head's whole group of query heads, one key tile.
    bk = plan.blocks.block_k_dkv
    group_rows = pl.BlockSpec((None, q_pad, None, group, d), lambda b, h, j: (b, 0, h, 0, 0))
    group_stat = pl.BlockSpec((None, None, group, q_pad), lambda b, h, j: (b, h, 0, 0))
    key_tile = pl.BlockSpec((None, bk, None, d), lambda b, h, j: (b, j, h, 0))
    grouped = (batch, q_pad, hk, group, d)
    dk, dv = _triton_call(
        functools.partial(_triton_dkv_kernel, plan=plan), (batch, hk, kv_pad // bk),
        in_specs=[lengths_spec, group_rows, key_tile, key_tile, group_rows, group_stat,
                  group_stat],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(k4.shape, k.dtype),
                   jax.ShapeDtypeStruct(v4.shape, v.dtype)],
        plan=plan,
    )(lengths, q.reshape(grouped), k4, v4, do.reshape(grouped), lse, di)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# --------------------------------------------------------------------------------------------
# custom_vjp over the padded [batch, seq_pad, heads * head_dim] arrays.


def _forward(q, k, v, lengths, plan: _Plan):
    if plan.variant == "triton":
        return _triton_forward(q, k, v, lengths, plan)
    return _mosaic_forward(q, k, v, lengths, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, lengths, plan: _Plan):
    return _forward(q, k, v, lengths, plan)[0]


def _flash_fwd(q, k, v, lengths, plan: _Plan):
    out, lse = _forward(q, k, v, lengths, plan)
    return out, (q, k, v, lengths, out, lse)


def _flash_bwd(plan: _Plan, residuals, do):
    q, k, v, lengths, out, lse = residuals
    batch, q_pad, _ = q.shape
    do = do.astype(q.dtype)
    di = jnp.sum(out.astype(_F32).reshape(batch, q_pad, plan.num_q_heads, -1)
                 * do.astype(_F32).reshape(batch, q_pad, plan.num_q_heads, -1), axis=-1)
    if plan.variant == "triton":
        di = di.reshape(batch, q_pad, plan.num_kv_heads, plan.group).transpose(0, 2, 3, 1)
        dq, dk, dv = _triton_backward(q, k, v, lengths, lse, di, do, plan)
    else:
        di = jnp.broadcast_to(di[..., None], di.shape + (LANES,)).reshape(lse.shape)
        dq, dk, dv = _mosaic_backward(q, k, v, lengths, lse, di, do, plan)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes", "interpret",
                                             "variant"))
def _flash_attention(q, k, v, kv_lengths, *, causal: bool, scale: float,
                     block_sizes: FlashBlockSizes, interpret: Any, variant: str):
    batch, q_len, hq, d = q.shape
    _, kv_len, hk, _ = k.shape
    compiled = not interpret
    blocks = _fit_blocks(block_sizes, q_len, kv_len, variant, compiled)
    plan = _Plan(q_len, kv_len, hq, hk, causal, scale, blocks, variant, interpret)

    q_multiple = math.lcm(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    kv_multiple = math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    if variant == "triton":
        d_pad = max(16, _next_power_of_two(d))
    else:
        d_pad = _round_up(d, LANES) if compiled and d % LANES and max(hq, hk) > 1 else d
    q_pad, kv_pad = _round_up(max(q_len, 1), q_multiple), _round_up(max(kv_len, 1), kv_multiple)

    def flat(x, seq_pad):
        x = jnp.pad(x, ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, d_pad - d)))
        return x.reshape(x.shape[0], seq_pad, -1)

    if kv_lengths is None:
        lengths = jnp.full((batch,), kv_len, jnp.int32)
    else:
        lengths = jnp.clip(kv_lengths, 0, kv_len).astype(jnp.int32)
    if variant == "triton":  # a Triton block must have a power-of-two size
        lengths = jnp.pad(lengths, (0, _next_power_of_two(batch) - batch))
    out = _flash(flat(q, q_pad), flat(k, kv_pad), flat(v, kv_pad), lengths, plan)
    return out.reshape(batch, q_pad, hq, d_pad)[:, :q_len, :, :d]


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    kv_lengths: jax.Array | None = None, scale: float | None = None,
                    block_sizes: FlashBlockSizes | None = None, interpret: Any = None,
                    variant: Variant | None = None) -> jax.Array:
    """Fused grouped-query attention (the candidate contract), differentiable, in Pallas.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``, same dtype; ``num_q_heads`` is a
        multiple of ``num_kv_heads`` and query head ``h`` reads kv head ``h // group``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      kv_lengths: optional int ``[batch]``; keys at or past ``kv_lengths[b]`` are padding
        (values are clipped to ``[0, kv_len]``).
      scale: logit scale, ``head_dim ** -0.5`` by default.
      block_sizes: tiles; ``FlashBlockSizes.for_platform()`` by default.
      interpret: passed to ``pl.pallas_call``; ``True`` on CPU by default (see
        ``kernel_src.backend.resolve_interpret``), e.g. ``pltpu.InterpretParams(...)`` for TPU
        interpret mode.
      variant: ``"mosaic"`` (grid-carried accumulators, the TPU kernels) or ``"triton"``
        (in-kernel loops, the GPU kernels); by default ``"triton"`` on GPU, else ``"mosaic"``.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in the input dtype. Rows with no visible key are
      exact zeros, and so are their gradients.
    """
    dims = check_inputs(q, k, v, kv_lengths)
    scale = default_scale(dims.head_dim, scale)
    interpret = backend.resolve_interpret(interpret)
    if variant is None:
        variant = "triton" if backend.platform() == "gpu" else "mosaic"
    if variant not in ("mosaic", "triton"):
        raise ValueError(f"variant must be 'mosaic' or 'triton', got {variant!r}")
    if block_sizes is None:
        target = "cpu" if interpret else ("gpu" if variant == "triton" else "tpu")
        block_sizes = FlashBlockSizes.for_platform(target)
    return _flash_attention(q, k, v, kv_lengths, causal=bool(causal), scale=scale,
                            block_sizes=block_sizes, interpret=interpret, variant=variant)
