"""Adapters that give other code the candidate contract, for the rubric tests (not collected by pytest).

Each adapter handles only layout (``[batch, seq, heads, head_dim]`` vs head-major), masks (the
contract's bottom-right causal and ``kv_lengths`` expressed as the kernel's own mask, segment ids or
front padding), head repetition for kernels without grouped heads, and the contract's convention for
rows that see no key (exact zeros: the field's kernels return the mean of V or NaN there, a
convention the rubric's ``mean-v-empty-rows`` and ``nan-empty-rows`` built-ins show it rejects). None
of them touches the numerics: logits, softmax, accumulation and the backward are the kernel's own.

Features (``kernel_src.contract.FEATURES``): an adapter declares (``features``) exactly those its kernel
implements itself, and passes them to the kernel's own arguments: ``xla_dot_product_attention`` the window
(``local_window_size``); ``pallas_tpu_splash`` the window (``LocalMask``), soft-cap
(``attn_logits_soft_cap``), segment ids (``SegmentIds``) and, where the installed splash takes them, sinks.

Paged KV (``kernel_src.contract.paged_attention``, the last section): JAX's ``paged_attention`` and ragged
paged attention, and JAX's reference of the ragged one, under the same rules (layout only), graded by
``tpu-kernel-rubric --paged`` (``tests/test_paged_field_kernels.py``).

The rubric loads these by path (``tests/field_adapters.py:xla_dot_product_attention``), so they also
run in its worker process.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp

from tpu_kernel_records_tools.grading.candidates import jit_contract
from kernel_src.contract import check_paged_inputs, check_window, default_scale, supports, visibility_mask
from kernel_src.reference import reference_attention
from kernel_src.sharded import attention_mesh, sharded_attention


def _visible(q_len: int, kv_len: int, batch: int, causal: bool, kv_lengths, window=None, q_segment_ids=None,
             kv_segment_ids=None) -> jax.Array:
    """Bool ``[batch, q_len, kv_len]``: the contract's mask (features included where given)."""
    mask = visibility_mask(q_len, kv_len, causal, kv_lengths, window, q_segment_ids, kv_segment_ids)
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


@supports("softcap")
def prerounded_reference(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None):
    """The reference fed q as ``pallas_tpu_splash`` feeds splash: scaled in float32 and rounded once to the
    input dtype, then ``scale=1`` (for the tests: what that rounding alone costs under a cap)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return reference_attention(qs, k, v, causal=causal, kv_lengths=kv_lengths, scale=1.0, softcap=softcap)


# --------------------------------------------------------------------------------------------------
# jax.nn.dot_product_attention, XLA implementation: same layout, native grouped heads.

def _dpa_window(window_size, q_len: int, kv_len: int) -> tuple[int, int] | None:
    """The contract's ``window_size=(left, right)`` as ``dot_product_attention``'s ``local_window_size``.

    dpa's window is top-left aligned: query index ``t`` sees key index ``s`` iff ``t - l <= s <= t + r``
    (``_get_window_mask``: ``t <= s + l`` and ``t >= s - r``, the same inequalities in jax 0.6.2 and
    0.10.2). The contract centres the window on ``p = i + (kv_len - q_len)``, so with ``shift = kv_len -
    q_len`` it is dpa's window ``(left - shift, right + shift)``: a side may come out negative (a decode row
    far down a long cache), which dpa's XLA implementation evaluates as the same inequalities. An unbounded
    side (None) is a side past every key (``q_len`` left, ``kv_len`` right); ``(None, None)`` is no window.
    (jax 0.6.2's ``_apply_masks`` drops ``local_window_size`` when no mask, causal or lengths come with
    it; the adapter always passes its mask.)"""
    if window_size is None:
        return None
    left, right = window_size
    if left is None and right is None:
        return None
    shift = kv_len - q_len
    return (q_len if left is None else int(left) - shift, kv_len if right is None else int(right) + shift)


@jit_contract
@supports("window")
def xla_dot_product_attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None,
                              softcap=None):
    """``jax.nn.dot_product_attention(implementation="xla")``: the contract's causal and ``kv_lengths`` as
    its boolean ``mask`` (its ``is_causal`` is top-left), the window as its own ``local_window_size``
    (``_dpa_window``: the contract's bottom-right centre expressed in dpa's top-left indices).

    ``softcap`` is in the signature only because ``jit_contract`` makes ``window_size`` and ``softcap``
    static for any candidate that declares a feature: dpa has no cap, so it is not declared and refused."""
    if softcap is not None:
        raise ValueError("jax.nn.dot_product_attention has no soft-cap (not a declared feature)")
    batch, q_len = q.shape[:2]
    kv_len = k.shape[1]
    visible = _visible(q_len, kv_len, batch, causal, kv_lengths)
    out = jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=scale, implementation="xla",
                                       local_window_size=_dpa_window(window_size, q_len, kv_len))
    window = check_window(window_size)
    return _zero_empty_rows(out, _visible(q_len, kv_len, batch, causal, kv_lengths, window))


# --------------------------------------------------------------------------------------------------
# Pallas TPU kernels of jax.experimental.pallas.ops.tpu, interpreted on the CPU (splash: interpret=True;
# flash: TPU interpret mode, set once for the process: the rubric runs each candidate in a worker of
# its own).
#
# Layout only, chosen so that one compiled program serves many problems (an interpreted kernel costs
# seconds to compile and milliseconds to run): every (batch, head) pair becomes a row of a leading axis
# padded to a power of two (at least ROWS), query rows are padded to 128 x a power of two and keys to
# 256 x one, head_dim to whole 128-lane tiles; one block per sequence. The padding is exact: zero
# query/key/value columns add exact zero terms to every dot product and are dropped, padded query rows are
# dropped (and get a zero cotangent), padded keys carry a segment id no query row has (flash: 0),
# padded rows attend to zero keys and are dropped.

LANES = 128  # the TPU kernels' blocks are whole 128-lane tiles
ROWS = 16    # smallest leading (batch x head) extent, so the quick level's shapes share programs


def _ladder(n: int, smallest: int) -> int:
    """``smallest`` x the least power of two that reaches ``n``."""
    size = smallest
    while size < n:
        size *= 2
    return size


def _pad(x: jax.Array, axis: int, front: int, total: int) -> jax.Array:
    """``front`` zeros before, zeros after until the axis has ``total`` entries."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (front, total - front - x.shape[axis])
    return jnp.pad(x, pad)


def _geometry(q_len: int, kv_len: int, causal: bool) -> tuple[int, int, int, int]:
    """``(pad_q, pad_k, lq, lk)``. The field's causal masks are top-left (or offset-free), so under
    causal the shorter side is padded at the front until both are equally long (top-left is then
    bottom-right); both are then padded at the back to ``lq`` (128 x a power of two) and ``lk`` (256 x a power of two:
    the quick level's short and 136-key problems then share programs)."""
    pad_q = max(kv_len - q_len, 0) if causal else 0
    pad_k = max(q_len - kv_len, 0) if causal else 0
    return pad_q, pad_k, _ladder(q_len + pad_q, LANES), _ladder(kv_len + pad_k, 2 * LANES)


def _kv_segments(batch: int, kv_len: int, kv_lengths, pad_k: int, lk: int) -> jax.Array:
    """Int32 ``[batch, lk]``: 1 on real keys before ``kv_lengths[b]``, 0 on padding (front, back, past the length)."""
    lengths = jnp.full((batch,), kv_len) if kv_lengths is None else jnp.asarray(kv_lengths)
    j = jnp.arange(lk)[None, :] - pad_k
    return ((j >= 0) & (j < lengths[:, None])).astype(jnp.int32)


def _rows(x: jax.Array, seq_axis: int, front: int, length: int, rows: int, lanes: int) -> jax.Array:
    """Pad a row-major array ``[n, ..., seq, head_dim]``: rows to ``rows``, the sequence, head_dim to ``lanes``."""
    x = _pad(x, 0, 0, rows)
    x = _pad(x, seq_axis, front, length)
    return _pad(x, x.ndim - 1, 0, lanes)


def _pad_segments(kv_seg: jax.Array, rows: int) -> jax.Array:
    """Padded rows (id 1, their queries' too) see every (zero) key: finite, and dropped."""
    return jnp.concatenate([kv_seg, jnp.ones((rows - kv_seg.shape[0], kv_seg.shape[1]), jnp.int32)])


_INTERPRET_SET = []


def _tpu_interpret() -> None:
    """TPU interpret mode for every pallas_call of this process, set once, before the first trace (set
    inside a trace it would change the jit key between the first and second call)."""
    import jax.experimental.pallas.tpu as pltpu

    if not hasattr(pltpu, "set_tpu_interpret_mode"):
        raise RuntimeError(f"jax {jax.__version__} has no pltpu.set_tpu_interpret_mode (TPU interpret mode)")
    if not _INTERPRET_SET:
        pltpu.set_tpu_interpret_mode()
        _INTERPRET_SET.append(True)


def pallas_tpu_flash(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """``pallas.ops.tpu.flash_attention`` in TPU interpret mode: each (batch, query head) its own row
    with its kv head repeated (it has no grouped heads), padding keys as segment 0, its own causal mask
    on the front-padded square (``_geometry``), its own ``sm_scale``."""
    _tpu_interpret()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    rows = _flash_layout(q, k, v, kv_lengths, causal=bool(causal))
    out = _flash_rows(*rows, bool(causal), scale)  # [rows, 1, lq, lanes]
    return _flash_unlayout(out, kv_lengths, causal=bool(causal), q_shape=q.shape, kv_shape=k.shape)


@functools.partial(jax.jit, static_argnames=("causal",))
def _flash_layout(q, k, v, kv_lengths, *, causal: bool):
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    pad_q, pad_k, lq, lk = _geometry(q_len, kv_len, causal)
    n, lanes = batch * hq, -(-d // LANES) * LANES
    rows = _ladder(n, ROWS)
    qr = _rows(jnp.transpose(q, (0, 2, 1, 3)).reshape(n, 1, q_len, d), 2, pad_q, lq, rows, lanes)
    kr, vr = (_rows(jnp.transpose(jnp.repeat(x, hq // hk, axis=2), (0, 2, 1, 3)).reshape(n, 1, kv_len, d),
                    2, pad_k, lk, rows, lanes) for x in (k, v))
    kv_seg = _pad_segments(jnp.repeat(_kv_segments(batch, kv_len, kv_lengths, pad_k, lk), hq, axis=0), rows)
    return qr, kr, vr, kv_seg


@functools.partial(jax.jit, static_argnames=("causal", "q_shape", "kv_shape"))
def _flash_unlayout(out, kv_lengths, *, causal: bool, q_shape, kv_shape):
    batch, q_len, hq, d = q_shape
    pad_q = _geometry(q_len, kv_shape[1], causal)[0]
    out = out[:batch * hq, 0, pad_q:pad_q + q_len, :d].reshape(batch, hq, q_len, d)
    return _zero_empty_rows(jnp.transpose(out, (0, 2, 1, 3)), _visible(q_len, kv_shape[1], batch, causal, kv_lengths))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _flash_kernel(q, k, v, kv_seg, causal: bool, scale: float):
    """The kernel alone on padded rows ``[rows, 1, seq, lanes]``, all rows in one block (one grid step:
    the TPU interpreter's cost is per step): compiled once per padded shape and flags (the layout before
    and after is compiled apart, so problems of different shapes share this program)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
    segment_ids = fa.SegmentIds(q=jnp.ones((b, lq), jnp.int32), kv=kv_seg)
    blocks = fa.BlockSizes(block_q=lq, block_k_major=lk, block_k=lk, block_b=b,
                           block_q_major_dkv=lq, block_k_major_dkv=lk, block_k_dkv=lk, block_q_dkv=lq,
                           block_k_major_dq=lk, block_k_dq=lk, block_q_dq=lq)
    return fa.flash_attention(q, k, v, segment_ids=segment_ids, causal=causal, sm_scale=scale, block_sizes=blocks)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _flash_kernel_vjp(q, k, v, kv_seg, g, causal: bool, scale: float):
    """dQ, dK, dV of ``_flash_kernel`` (its own custom backward), compiled once per padded shape and flags."""
    return jax.vjp(lambda q, k, v: _flash_kernel(q, k, v, kv_seg, causal, scale), q, k, v)[1](g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash_rows(q, k, v, kv_seg, causal: bool, scale: float):
    """``_flash_kernel`` whose backward is the kernel's own, through a jitted function: calling jax.vjp
    on the kernel directly traces and compiles its backward anew on every call."""
    return _flash_kernel(q, k, v, kv_seg, causal, scale)


def _flash_rows_fwd(q, k, v, kv_seg, causal, scale):
    return _flash_kernel(q, k, v, kv_seg, causal, scale), (q, k, v, kv_seg)


def _flash_rows_bwd(causal, scale, saved, g):
    q, k, v, kv_seg = saved
    return (*_flash_kernel_vjp(q, k, v, kv_seg, g, causal, scale), None)


_flash_rows.defvjp(_flash_rows_fwd, _flash_rows_bwd)


def _splash_takes_sinks() -> bool:
    """Whether the installed splash attention takes ``sinks`` (jax 0.10.2's does, jax 0.6.2's does not)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    return "sinks" in inspect.signature(sk._splash_attention).parameters


SPLASH_FEATURES = ("window", "softcap", "segments", *(("sinks",) if _splash_takes_sinks() else ()))


@supports(*SPLASH_FEATURES)
def pallas_tpu_splash(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None,
                      q_segment_ids=None, kv_segment_ids=None, sinks=None):
    """``pallas.ops.tpu.splash_attention`` (interpret=True): each (batch, kv head) a row of the
    multi-query kernel with its query group (native grouped heads; the group padded to a power of two
    with zero query heads), padding keys as a segment no query has, its own causal mask on the
    front-padded square (``_geometry``). It takes no scale: q is scaled first, in float32, and passed to it
    in float32 (its logits are then the contract's float32 ``scale * q.k``; its output is rounded to the
    input dtype). Models feeding it usually round the scaled q to bfloat16 first: that rounding is outside
    the contract, and past a cap of 50 it alone costs about ten times the reference's error (the softcap
    check's cap50 probe rejects the reference fed such a q, ``prerounded_reference``), so the adapter does
    not do it.

    Its features, each through its own argument: ``window_size`` as its ``LocalMask`` (ends inclusive,
    like the contract's) with its own ``offset`` placing row ``i`` at ``p = i + kv_len - q_len``, and'ed
    with its ``CausalMask`` at the same offset under causal (no front padding then: the offsets align
    both); ``softcap`` as its ``attn_logits_soft_cap`` (on the scaled logits, before its mask, as the
    contract orders them); segment ids as its ``SegmentIds`` (padding keys get an id that no query row of
    their batch has, ``_kv_ids``); ``sinks`` (where the installed splash takes them) per query head, in
    the frame of its logits (unscaled, uncapped, as the contract's)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    causal = bool(causal)
    window = check_window(window_size)
    softcap = None if softcap is None else float(softcap)
    rows = _splash_layout(q, k, v, kv_lengths, jnp.float32(scale), q_segment_ids, kv_segment_ids, sinks,
                          causal=causal, window=window is not None)
    offset = 0 if window is None else k.shape[1] - q.shape[1]  # CausalMask alone: the front-padded square
    out = _splash_rows(*rows, causal, window, offset, softcap)  # [rows, heads, lq, lanes]
    return _splash_unlayout(out, kv_lengths, q_segment_ids, kv_segment_ids, causal=causal, window=window,
                            q_shape=q.shape, kv_shape=k.shape).astype(q.dtype)


def _absent_id(ids: jax.Array) -> jax.Array:
    """Int32 ``[batch]``: for each row of ``ids`` (``[batch, n]``), the least id >= 0 it lacks (one of 0..n)."""
    n = ids.shape[1]
    ordered = jnp.sort(ids, axis=1)
    candidates = jnp.arange(n + 1, dtype=ids.dtype)
    at = jax.vmap(lambda row: jnp.searchsorted(row, candidates))(ordered)
    present = jnp.take_along_axis(ordered, jnp.minimum(at, n - 1), axis=1) == candidates[None, :]
    return jnp.argmin(present, axis=1).astype(jnp.int32)


def _kv_ids(q_ids: jax.Array, kv_ids: jax.Array, kv_lengths, pad_k: int, lk: int) -> jax.Array:
    """Int32 ``[batch, lk]``: the keys' segment ids laid out (front ``pad_k``, back to ``lk``), every padding
    key (front, back, past ``kv_lengths[b]``) given an id that no query row of batch ``b`` has."""
    batch, kv_len = kv_ids.shape
    valid = _kv_segments(batch, kv_len, kv_lengths, pad_k, lk) == 1
    ids = _pad(kv_ids.astype(jnp.int32), 1, pad_k, lk)
    return jnp.where(valid, ids, _absent_id(q_ids.astype(jnp.int32))[:, None])


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _splash_layout(q, k, v, kv_lengths, scale, q_segment_ids, kv_segment_ids, sinks, *, causal: bool,
                   window: bool):
    batch, q_len, hq, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    group = hq // hk
    pad_q, pad_k, lq, lk = _geometry(q_len, kv_len, causal and not window)
    n, heads, lanes = batch * hk, _ladder(group, 4), -(-d // LANES) * LANES
    rows = _ladder(n, ROWS // 2)
    qs = q.astype(jnp.float32) * scale  # float32 logits, as the contract has them (see pallas_tpu_splash)
    qg = jnp.transpose(qs.reshape(batch, q_len, hk, group, d), (0, 2, 3, 1, 4)).reshape(n, group, q_len, d)
    qg = _rows(_pad(qg, 1, 0, heads), 2, pad_q, lq, rows, lanes)  # [rows, heads, lq, lanes]
    kg, vg = (_rows(jnp.transpose(x, (0, 2, 1, 3)).reshape(n, kv_len, d), 1, pad_k, lk, rows, lanes)
              for x in (k, v))  # [rows, lk, lanes]
    if q_segment_ids is None:  # one segment; padding keys get id 0
        q_ids, kv_ids = jnp.ones((batch, q_len), jnp.int32), jnp.ones((batch, kv_len), jnp.int32)
    else:
        q_ids, kv_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    kv_seg = _kv_ids(q_ids, kv_ids, kv_lengths, pad_k, lk)
    q_seg = _pad(q_ids, 1, pad_q, lq)  # padded query rows are dropped: any id
    q_seg, kv_seg = (_pad_segments(jnp.repeat(x, hk, axis=0), rows) for x in (q_seg, kv_seg))
    if sinks is not None:  # [hq] -> [rows, heads]: row b * hk + h holds kv head h's query group
        sinks = _pad(_pad(jnp.tile(sinks.astype(jnp.float32).reshape(hk, group), (batch, 1)), 1, 0, heads), 0, 0,
                     rows)
    return qg, kg, vg, q_seg, kv_seg, sinks


@functools.partial(jax.jit, static_argnames=("causal", "window", "q_shape", "kv_shape"))
def _splash_unlayout(out, kv_lengths, q_segment_ids, kv_segment_ids, *, causal: bool, window, q_shape, kv_shape):
    batch, q_len, hq, d = q_shape
    hk = kv_shape[2]
    pad_q = _geometry(q_len, kv_shape[1], causal and window is None)[0]
    out = out[:batch * hk, :hq // hk, pad_q:pad_q + q_len, :d].reshape(batch, hk, hq // hk, q_len, d)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, q_len, hq, d)
    return _zero_empty_rows(out, _visible(q_len, kv_shape[1], batch, causal, kv_lengths, window, q_segment_ids,
                                          kv_segment_ids))


def _splash_mask(lq: int, lk: int, causal: bool, window, offset: int):
    """Splash's own mask of one head on the padded ``(lq, lk)`` grid: ``CausalMask`` (at ``offset``),
    ``LocalMask(window, offset)``, their AND, or ``FullMask``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is None:
        return sm.CausalMask((lq, lk), offset=offset) if causal else sm.FullMask((lq, lk))
    local = sm.LocalMask((lq, lk), window, offset=offset)
    return sm.CausalMask((lq, lk), offset=offset) & local if causal else local


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9))
def _splash_rows(q, k, v, q_seg, kv_seg, sinks, causal: bool, window, offset: int, softcap):
    """The multi-query kernel alone on padded rows (q ``[rows, heads, lq, lanes]``, k, v ``[rows, lk,
    lanes]``): compiled once per padded shape and flags (see ``_flash_rows``); its mask is static, built
    here per (shape, causal, window, offset): a program per window (the window probes' windows differ)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    heads, lq, lk = q.shape[1], q.shape[2], k.shape[1]
    one = _splash_mask(lq, lk, causal, window, offset)
    blocks = sk.BlockSizes(block_q=lq, block_kv=lk, block_kv_compute=lk, block_q_dkv=lq,
                           block_kv_dkv=lk, block_kv_dkv_compute=lk, block_q_dq=lq, block_kv_dq=lk)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * heads), block_sizes=blocks, interpret=True,
                                              attn_logits_soft_cap=softcap)
    if sinks is None:
        return jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, sk.SegmentIds(q=qs, kv=ks)))(q, k, v, q_seg, kv_seg)
    return jax.vmap(lambda q, k, v, qs, ks, s: kernel(q, k, v, sk.SegmentIds(q=qs, kv=ks), sinks=s))(
        q, k, v, q_seg, kv_seg, sinks)


# --------------------------------------------------------------------------------------------------
# Paged KV (kernel_src.contract.paged_attention): JAX's own paged kernels of jax.experimental.pallas.ops.tpu,
# in TPU interpret mode on the CPU, for the paged rubric (tpu-kernel-rubric --paged). Layout only: the pool
# transposed or interleaved into the kernel's layout, query rows folded into the kernel's batch or token
# axis, the lengths and table repeated to match; the logits, masking and softmax are the kernels' own.
# Rows that see no key get the contract's exact zeros (as the dense adapters do, ``_zero_empty_rows``).

PAGED_BLOCK = 8  # pages per compute block (the table padded to a multiple with page 0: trailing entries)
RAGGED_QUERIES = 32  # query tokens per block of ragged_paged_attention (the token axis padded to a multiple)


@contextlib.contextmanager
def _tpu_interpret_scope():
    """TPU interpret mode (``pltpu.InterpretParams()``) for every pallas_call traced inside, and only those.

    jax >= 0.7: ``pltpu.force_tpu_interpret_mode``. jax 0.6.2 has no such switch and JAX's paged kernels take
    no ``interpret=``: there ``jax.experimental.pallas.pallas_call`` (which they call as ``pl.pallas_call``)
    is wrapped for the duration to pass ``interpret=pltpu.InterpretParams()``. Entered around every call, so
    each jitted kernel is traced (and cached) under it."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.tpu as pltpu

    if hasattr(pltpu, "force_tpu_interpret_mode"):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            yield
        return
    original = pl.pallas_call
    pl.pallas_call = functools.partial(original, interpret=pltpu.InterpretParams())
    try:
        yield
    finally:
        pl.pallas_call = original


def _paged_visible(kv_lengths, q_len: int, causal: bool, window) -> jax.Array:
    """Bool ``[batch, q_len]``: whether query row ``i`` of sequence ``b`` sees any key (the contract's
    positions ``kv_lengths[b] - q_len + i``)."""
    lengths = jnp.asarray(kv_lengths, jnp.int32)[:, None]
    pos = lengths - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    first = jnp.zeros_like(pos) if window is None or window[0] is None else pos - window[0]
    last = lengths - 1
    if causal:
        last = jnp.minimum(last, pos)
    if window is not None and window[1] is not None:
        last = jnp.minimum(last, pos + window[1])
    return jnp.maximum(first, 0) <= last


def _zero_unseen(out: jax.Array, seen: jax.Array) -> jax.Array:
    return jnp.where(seen[:, :, None, None], out, jnp.zeros_like(out))


@functools.partial(jax.jit, static_argnames=("causal", "block"))
def _paged_layout(q, k_pages, v_pages, kv_lengths, page_indices, scale, *, causal: bool, block: int):
    """JAX ``paged_attention``'s layout: each query row its own sequence (``[batch * q_len, heads, d]``, q
    scaled in float32), its length ``kv_lengths - q_len + i + 1`` (at least 0) under causal and
    ``kv_lengths`` otherwise; pools ``[kv_heads, pages, page_size, d]``; the table repeated per row and
    padded with page 0 to a multiple of ``block`` pages."""
    batch, q_len, hq, d = q.shape
    rows = (q.astype(jnp.float32) * scale).reshape(batch * q_len, hq, d)
    lengths = jnp.asarray(kv_lengths, jnp.int32)[:, None]
    if causal:
        lengths = jnp.maximum(lengths - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)[None, :], 0)
    lengths = jnp.broadcast_to(lengths, (batch, q_len)).reshape(-1)
    pps = page_indices.shape[1]
    table = jnp.pad(jnp.repeat(page_indices.astype(jnp.int32), q_len, axis=0), ((0, 0), (0, -pps % block)))
    k, v = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))
    return rows, k, v, lengths, table


@supports("softcap")
def jax_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True,
                        window_size=None, softcap=None, sinks=None):
    """``pallas.ops.tpu.paged_attention`` (``paged_attention(q, k_pages, v_pages, lengths, page_indices, *,
    attn_logits_soft_cap, pages_per_compute_block)``) in TPU interpret mode.

    It is a decode kernel: one query row per sequence (``q [batch, num_q_heads, head_dim]``), keys
    ``[0, lengths[b])``, no causal or window mask of its own, no scale, no sinks. The adapter gives each of
    the contract's ``q_len`` rows a sequence of its own with the same table: under causal with length
    ``kv_lengths - q_len + i + 1`` (row ``i`` sees exactly the keys at or before its position, the contract's
    causal among the new rows), otherwise ``kv_lengths``. It scales q in float32 (the kernel computes its
    logits in float32 from a float32 q). Pools become ``[num_kv_heads, num_pages, page_size, head_dim]``; the
    table is padded with page 0 to a multiple of ``PAGED_BLOCK`` pages (its ``pages_per_compute_block``; the
    padding is trailing entries, which the contract lets point anywhere). Declared: ``softcap`` (its
    ``attn_logits_soft_cap``); a window or sinks are refused."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    if window_size is not None or sinks is not None:
        raise ValueError("JAX's paged_attention has no window and no sinks (not declared features)")
    block = min(PAGED_BLOCK, dims.pages_per_sequence)
    rows, k, v, lengths, table = _paged_layout(q, k_pages, v_pages, kv_lengths, page_indices,
                                               jnp.float32(default_scale(dims.head_dim, scale)),
                                               causal=bool(causal), block=block)
    with _tpu_interpret_scope():
        out = paged_attention(rows, k, v, lengths, table, pages_per_compute_block=block,
                              attn_logits_soft_cap=None if softcap is None else float(softcap))
    out = out.reshape(q.shape).astype(q.dtype)
    return _zero_unseen(out, _paged_visible(kv_lengths, dims.q_len, bool(causal), None))


@jax.jit
def _zero_unheld(k_pages, v_pages, kv_lengths, page_indices):
    """The pools with every slot that holds no key of any sequence set to zero (shared pages stay held)."""
    num_pages, page_size = k_pages.shape[:2]
    slot = jnp.arange(page_indices.shape[1] * page_size, dtype=jnp.int32).reshape(page_indices.shape[1], page_size)
    held = slot[None] < jnp.asarray(kv_lengths, jnp.int32)[:, None, None]  # [batch, pages/seq, page_size]
    pages = jnp.where(held, page_indices.astype(jnp.int32)[:, :, None], num_pages)  # num_pages: dropped
    holds = jnp.zeros((num_pages, page_size), bool).at[pages, slot[None] % page_size].max(held, mode="drop")
    return tuple(jnp.where(holds[:, :, None, None], x, jnp.zeros_like(x)) for x in (k_pages, v_pages))


@supports("softcap")
def jax_paged_attention_zeroed_pool(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True,
                                    window_size=None, softcap=None, sinks=None):
    """A diagnostic, not the kernel as used: ``jax_paged_attention`` on pools whose slots that hold no key
    are zeroed first (``_zero_unheld``), as a serving engine that zero-fills its pool would give it. The
    kernel masks by adding ``mask_value`` to the logits, so NaN/Inf where no key is reach its output (every
    check of ``jax_paged_attention`` fails on that alone); this shows what it gets wrong besides."""
    k_pages, v_pages = _zero_unheld(k_pages, v_pages, kv_lengths, page_indices)
    return jax_paged_attention(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices, scale=scale,
                               causal=causal, window_size=window_size, softcap=softcap, sinks=sinks)


@functools.partial(jax.jit, static_argnames=("per_row", "queries"))
def _ragged_layout(q, k_pages, v_pages, kv_lengths, page_indices, *, per_row: bool, queries: int):
    """Ragged paged attention's layout: K and V interleaved on the head axis (``[pages, page_size, 2 kv_heads,
    lanes]``, K at even heads), the query tokens ``[tokens, heads, lanes]`` padded to a multiple of ``queries``
    (head_dim padded with zeros to whole 128-lane tiles: its accumulator update needs them); each
    sequence its ``q_len`` rows (``per_row``: each row a sequence of one token, with its sequence's length
    and table)."""
    batch, q_len, hq, d = q.shape
    num_pages, page_size, hk, _ = k_pages.shape
    lanes = -(-d // LANES) * LANES
    kv = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * hk, d)
    kv = _pad(kv, 3, 0, lanes)
    tokens = q.reshape(batch * q_len, hq, d)
    tokens = jnp.pad(tokens, ((0, -tokens.shape[0] % queries), (0, 0), (0, lanes - d)))
    lengths, table = jnp.asarray(kv_lengths, jnp.int32), page_indices.astype(jnp.int32)
    seqs, per_seq = (batch * q_len, 1) if per_row else (batch, q_len)
    if per_row:
        lengths, table = jnp.repeat(lengths, q_len), jnp.repeat(table, q_len, axis=0)
    cu_q_lens = (jnp.arange(seqs + 1, dtype=jnp.int32) * per_seq)
    return tokens, kv, lengths, table, cu_q_lens, jnp.asarray([seqs], jnp.int32)


def _ragged(kernel, q, k_pages, v_pages, kv_lengths, page_indices, scale, causal, window_size, softcap, sinks,
            **blocks):
    """The contract's call as ``kernel`` (ragged_paged_attention's signature) takes it; see
    ``jax_ragged_paged_attention``."""
    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    window = check_window(window_size)
    if sinks is not None:
        raise ValueError("JAX's ragged_paged_attention has no sinks (not a declared feature)")
    causal = bool(causal)
    if window is not None and not causal:
        raise ValueError("JAX's ragged_paged_attention's sliding window is causal and left-only: a window "
                         "with causal=False is outside it")
    sliding = None if window is None or window[0] is None else int(window[0]) + 1
    tokens, kv, lengths, table, cu_q_lens, num_seqs = _ragged_layout(
        q, k_pages, v_pages, kv_lengths, page_indices, per_row=not causal, queries=RAGGED_QUERIES)
    with _tpu_interpret_scope():
        out = kernel(tokens, kv, lengths, table, cu_q_lens, num_seqs, sm_scale=default_scale(dims.head_dim, scale),
                     sliding_window=sliding, soft_cap=None if softcap is None else float(softcap), **blocks)
    out = out[:dims.batch * dims.q_len, :, :dims.head_dim].reshape(q.shape)
    return _zero_unseen(out, _paged_visible(kv_lengths, dims.q_len, causal, window))


@supports("window", "softcap")
def jax_ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True,
                               window_size=None, softcap=None, sinks=None):
    """``pallas.ops.tpu.ragged_paged_attention`` (``ragged_paged_attention(q, kv_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, num_kv_pages_per_block,
    num_queries_per_block)``) in TPU interpret mode.

    Its layout: the new tokens of every sequence concatenated (``q [tokens, num_q_heads, head_dim]``,
    ``cu_q_lens`` their offsets), one pool with K and V interleaved on the head axis, head_dim a multiple of
    128 (``_ragged_layout`` pads it with zeros: exact). Its mask is the contract's bottom-right causal (row
    ``i`` of a sequence at ``kv_lens - q_len + i``) and, with ``sliding_window=w``, keys after
    ``position - w``: the contract's window ``(w - 1, 0)``. Causal: each sequence's ``q_len`` rows as they
    are. Not causal (the kernel is always causal): each row a sequence of one token whose position is its
    sequence's last key, so it sees every key; a window is then refused (its window is left-only and counts
    from the row's position, which that folding moves). Declared: ``window`` (causal, ``(left, right)`` as
    ``sliding_window=left + 1``; the right side hides nothing under causal) and ``softcap`` (its
    ``soft_cap``); ``scale`` is its ``sm_scale``; sinks are refused.

    TPU interpret mode cannot run it (jax 0.6.2 to 0.10.2): the kernel reshapes its VMEM K/V buffer
    (``wait().reshape(...)``, then strided loads) and the interpreter's reads handle only indexing
    transforms of a ref (``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``; 0.6.2:
    ``'RefReshaper'``); the generic interpreter (``interpret=True``) fails on it too. The layout is graded
    through JAX's own reference of the same signature (``jax_ragged_paged_reference``)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    return _ragged(ragged_paged_attention, q, k_pages, v_pages, kv_lengths, page_indices, scale, causal,
                   window_size, softcap, sinks, num_kv_pages_per_block=min(PAGED_BLOCK, dims.pages_per_sequence),
                   num_queries_per_block=RAGGED_QUERIES)


@supports("window", "softcap")
def jax_ragged_paged_reference(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True,
                               window_size=None, softcap=None, sinks=None):
    """JAX's pure-JAX ``ref_ragged_paged_attention`` (beside the kernel, the same signature and layout)
    through ``jax_ragged_paged_attention``'s adapter: what the adapter alone does to a correct
    implementation of that signature (it runs eagerly, a Python loop over the sequences)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    return _ragged(ref_ragged_paged_attention, q, k_pages, v_pages, kv_lengths, page_indices, scale, causal,
                   window_size, softcap, sinks)
