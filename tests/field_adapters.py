"""Adapters that give other code the candidate contract, for the rubric tests (not collected by pytest).

Each adapter handles only layout (``[batch, seq, heads, head_dim]`` vs head-major), masks (the
contract's bottom-right causal and ``kv_lengths`` expressed as the kernel's own mask, segment ids or
front padding), head repetition for kernels without grouped heads, and the contract's convention for
rows that see no key (exact zeros: the field's kernels return the mean of V or NaN there, a
convention the rubric's ``mean-v-empty-rows`` and ``nan-empty-rows`` built-ins show it rejects). None
of them touches the numerics: logits, softmax, accumulation and the backward are the kernel's own.

The rubric loads these by path (``tests/field_adapters.py:xla_dot_product_attention``), so they also
run in its worker process.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from grading.candidates import jit_contract
from kernel_src.contract import visibility_mask
from kernel_src.reference import reference_attention
from kernel_src.sharded import attention_mesh, sharded_attention


def _visible(q_len: int, kv_len: int, batch: int, causal: bool, kv_lengths) -> jax.Array:
    """Bool ``[batch, q_len, kv_len]``: the contract's mask."""
    mask = visibility_mask(q_len, kv_len, causal, kv_lengths)
    return jnp.broadcast_to(mask, (batch, q_len, kv_len))


def _zero_empty_rows(out: jax.Array, visible: jax.Array) -> jax.Array:
    """The contract's convention: a query row that sees no key gives exact zeros (and zero dQ)."""
    has_key = jnp.any(visible, axis=-1)[:, :, None, None]
    return jnp.where(has_key, out, jnp.zeros_like(out))


# --------------------------------------------------------------------------------------------------
# The project's own sharded entry point, over as many host devices as divide the problem.

def _mesh(batch: int, num_kv_heads: int):
    devices = jax.devices()
    for n in range(len(devices), 0, -1):
        try:
            return attention_mesh(batch, num_kv_heads, devices[:n])
        except ValueError:
            continue
    raise ValueError("no device count divides the problem")


@jit_contract
def sharded_reference(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """``kernel_src.sharded.sharded_attention`` of the reference, on every host device that divides the problem."""
    mesh = _mesh(q.shape[0], k.shape[2])
    return sharded_attention(reference_attention, q, k, v, mesh=mesh, causal=causal, kv_lengths=kv_lengths,
                             scale=scale)


def ignores_scale(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Known-bad for the tests: the reference with ``scale=`` ignored (always head_dim**-0.5)."""
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths)


# --------------------------------------------------------------------------------------------------
# jax.nn.dot_product_attention, XLA implementation: same layout, native grouped heads.

@jit_contract
def xla_dot_product_attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    batch, q_len = q.shape[:2]
    visible = _visible(q_len, k.shape[1], batch, causal, kv_lengths)
    out = jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=scale, implementation="xla")
    return _zero_empty_rows(out, visible)


# --------------------------------------------------------------------------------------------------
# Pallas TPU kernels of jax.experimental.pallas.ops.tpu, in TPU interpret mode (set for the whole
# process: the rubric runs each candidate in a worker process of its own).

def _tpu_interpret() -> None:
    import jax.experimental.pallas.tpu as pltpu

    if not hasattr(pltpu, "set_tpu_interpret_mode"):
        raise RuntimeError(f"jax {jax.__version__} has no pltpu.set_tpu_interpret_mode (TPU interpret mode)")
    pltpu.set_tpu_interpret_mode()


def _pad(x: jax.Array, axis: int, front: int = 0, multiple: int = 1) -> jax.Array:
    """``front`` zeros before, then zeros after until the axis is a multiple of ``multiple``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (front, -(x.shape[axis] + front) % multiple)
    return jnp.pad(x, pad)


LANES = 128  # the TPU kernels' blocks are whole 128-lane tiles; the padding is masked or dropped


@jit_contract
def pallas_tpu_flash(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """``pallas.ops.tpu.flash_attention``: head-major layout, K/V heads repeated over their query group
    (it has no grouped heads), padding keys as segment 0. Its causal mask is top-left, so the shorter
    side is padded at the front until both are equally long (top-left is then bottom-right), then both
    are padded at the back to whole 128-row tiles; padded query rows are dropped and padded keys carry
    segment 0. One block per sequence."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    _tpu_interpret()
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    visible = _visible(q_len, kv_len, batch, causal, kv_lengths)
    pad_q = max(kv_len - q_len, 0) if causal else 0
    pad_k = max(q_len - kv_len, 0) if causal else 0
    qh = _pad(jnp.transpose(q, (0, 2, 1, 3)), 2, pad_q, LANES)
    kh, vh = (_pad(jnp.transpose(jnp.repeat(x, hq // hk, axis=2), (0, 2, 1, 3)), 2, pad_k, LANES) for x in (k, v))
    lq, lk = qh.shape[2], kh.shape[2]
    lengths = jnp.full((batch,), kv_len) if kv_lengths is None else jnp.asarray(kv_lengths)
    j = jnp.arange(lk)[None, :] - pad_k
    kv_seg = ((j >= 0) & (j < lengths[:, None])).astype(jnp.int32)
    segment_ids = fa.SegmentIds(q=jnp.ones((batch, lq), jnp.int32), kv=kv_seg)
    blocks = fa.BlockSizes(block_q=lq, block_k_major=lk, block_k=lk, block_b=1,
                           block_q_major_dkv=lq, block_k_major_dkv=lk, block_k_dkv=lk, block_q_dkv=lq,
                           block_k_major_dq=lk, block_k_dq=lk, block_q_dq=lq)
    out = fa.flash_attention(qh, kh, vh, segment_ids=segment_ids, causal=causal, sm_scale=scale, block_sizes=blocks)
    out = jnp.transpose(out[:, :, pad_q:pad_q + q_len], (0, 2, 1, 3))
    return _zero_empty_rows(out, visible)


@jit_contract
def pallas_tpu_splash(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """``pallas.ops.tpu.splash_attention`` (interpret=True): its own bottom-right causal mask
    (``CausalMask`` with offset kv_len - q_len), padding keys as segment 0, native grouped heads (the
    multi-query kernel per kv head). It takes no scale: q is scaled first, in float32 and rounded once
    to the input dtype, as models using it do."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = d ** -0.5 if scale is None else scale
    visible = _visible(q_len, kv_len, batch, causal, kv_lengths)
    lq, lk = -(-q_len // LANES) * LANES, -(-kv_len // LANES) * LANES  # whole tiles; padding masked or dropped
    one = sm.CausalMask((lq, lk), offset=kv_len - q_len) if causal else sm.FullMask((lq, lk))
    blocks = sk.BlockSizes(block_q=lq, block_kv=lk, block_kv_compute=lk, block_q_dkv=lq,
                           block_kv_dkv=lk, block_kv_dkv_compute=lk, block_q_dq=lq, block_kv_dq=lk)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * group), block_sizes=blocks, interpret=True)
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qg = _pad(jnp.transpose(qs.reshape(batch, q_len, hk, group, d), (0, 2, 3, 1, 4)), 3, 0, LANES)
    kg, vg = (_pad(jnp.transpose(x, (0, 2, 1, 3)), 2, 0, LANES) for x in (k, v))  # [b, hk, lk, d]
    lengths = jnp.full((batch,), kv_len) if kv_lengths is None else jnp.asarray(kv_lengths)
    seg = sk.SegmentIds(q=jnp.ones((batch, lq), jnp.int32),
                        kv=(jnp.arange(lk)[None, :] < lengths[:, None]).astype(jnp.int32))
    per_kv_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_kv_head, in_axes=(0, 0, 0, 0))(qg, kg, vg, seg)  # [b, hk, group, q_len, d]
    out = jnp.transpose(out[:, :, :, :q_len], (0, 3, 1, 2, 4)).reshape(batch, q_len, hq, d).astype(q.dtype)
    return _zero_empty_rows(out, visible)
