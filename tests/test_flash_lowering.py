"""The default ``flash_attention`` lowers for the platform it is lowered for (lowering only).

With no ``interpret=`` and no ``variant=``, ``jax.export`` for ``tpu`` runs the Pallas -> Mosaic
lowering of forward, dQ and dK/dV at the benchmark shapes (one ``tpu_custom_call`` per kernel),
for ``cuda`` the Pallas -> Triton lowering, and a ``["cpu", "tpu"]`` export holds both branches.
Mosaic's and Triton's own compilers (libtpu, a GPU jaxlib) are not exercised here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernel_src import reference_attention
from kernel_src.flash import FlashBlockSizes, flash_attention

BATCH, Q_HEADS, KV_HEADS = 1, 4, 2
TRITON = "__gpu$xla.gpu.triton"


def _forward_and_vjp(q, k, v, kv_lengths, do, *, causal, **options):
    def attend(q, k, v):
        return flash_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, **options)

    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))


def _export(seq, head_dim, dtype, causal, with_lengths, platforms, **options):
    q = jax.ShapeDtypeStruct((BATCH, seq, Q_HEADS, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((BATCH, seq, KV_HEADS, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32) if with_lengths else None
    fn = jax.jit(functools.partial(_forward_and_vjp, causal=causal, **options))
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    return export.export(fn, platforms=platforms, disabled_checks=checks)(q, kv, kv, lengths, q)


@pytest.mark.parametrize("seq", [128, 200, 512, 2048, 8192])
def test_default_api_lowers_to_mosaic_for_tpu_at_benchmark_shapes(seq):
    """bf16, 4 q heads on 2 kv heads, head_dim 128, causal, kv_lengths; 200 is a non-128 width."""
    module = _export(seq, 128, jnp.bfloat16, True, True, ["tpu"]).mlir_module()
    assert module.count("tpu_custom_call") == 3  # forward, dQ, dK/dV
    assert TRITON not in module


@pytest.mark.parametrize("head_dim,dtype,causal,with_lengths", [
    (64, jnp.bfloat16, True, True),  # head_dim padded to 128 lanes inside the wrapper
    (128, jnp.float32, False, False),
])
def test_default_api_lowers_to_mosaic_for_tpu_other_layouts(head_dim, dtype, causal, with_lengths):
    module = _export(300, head_dim, dtype, causal, with_lengths, ["tpu"]).mlir_module()
    assert module.count("tpu_custom_call") == 3


@pytest.mark.parametrize("seq,head_dim", [(200, 64), (2048, 128)])
def test_default_api_lowers_to_triton_for_cuda(seq, head_dim):
    module = _export(seq, head_dim, jnp.bfloat16, True, True, ["cuda"]).mlir_module()
    assert module.count(f"@{TRITON}") == 3
    assert "tpu_custom_call" not in module


@pytest.mark.slow  # the flash kernel's forward and backward exported for two platforms: about 10 s
def test_multi_platform_export_holds_mosaic_and_runs_on_cpu():
    exported = _export(72, 32, jnp.float32, True, True, ["cpu", "tpu"])
    assert exported.mlir_module().count("tpu_custom_call") == 3
    rng = np.random.default_rng(0)
    q, do = (jnp.asarray(rng.standard_normal((BATCH, 72, Q_HEADS, 32), np.float32)) for _ in "ab")
    k, v = (jnp.asarray(rng.standard_normal((BATCH, 72, KV_HEADS, 32), np.float32)) for _ in "ab")
    lengths = jnp.asarray([50], jnp.int32)
    got = exported.call(q, k, v, lengths, do)
    attend = lambda q, k, v: reference_attention(q, k, v, causal=True, kv_lengths=lengths)
    out, vjp = jax.vjp(attend, q, k, v)
    for g, w in zip(got, (out, *vjp(do))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)


def test_explicit_options_still_override():
    """``interpret=True`` exports no kernel call; a variant or blocks a target cannot take make
    lowering for that target fail, while the call still runs on CPU."""
    assert "tpu_custom_call" not in _export(128, 128, jnp.bfloat16, True, True, ["tpu"],
                                            interpret=True).mlir_module()
    with pytest.raises(ValueError, match="variant='triton' has no tpu lowering"):
        _export(128, 128, jnp.bfloat16, True, True, ["tpu"], variant="triton")
    small = FlashBlockSizes(*(64,) * 6)
    with pytest.raises(ValueError, match="multiples of 128"):
        _export(128, 128, jnp.bfloat16, True, True, ["tpu"], block_sizes=small)
    assert _export(128, 128, jnp.bfloat16, True, True, ["cuda"], block_sizes=small)
    q = jnp.ones((1, 64, 4, 32), jnp.float32)
    k = jnp.ones((1, 64, 2, 32), jnp.float32)
    assert flash_attention(q, k, k, block_sizes=small).shape == q.shape


def test_tpu_defaults_are_lane_aligned():
    blocks = FlashBlockSizes.for_platform("tpu")
    assert all(getattr(blocks, name) % 128 == 0 for name in blocks.__dataclass_fields__)


def test_every_feature_lowers_for_tpu_and_cuda():
    """A window, a cap, segment ids and sinks (their gradient too) lower to the Mosaic and the
    Triton kernels (Triton: the needed-block row read per block, a ``cond`` around each block)."""
    q = jax.ShapeDtypeStruct((BATCH, 72, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((BATCH, 72, 1, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((BATCH, 72), jnp.int32)

    def forward_and_vjp(q, k, v, lengths, q_ids, kv_ids, sinks):
        def attend(q, k, v, sinks):
            return flash_attention(q, k, v, causal=True, kv_lengths=lengths, window_size=(31, 0),
                                   softcap=20.0, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                   sinks=sinks)
        out, vjp = jax.vjp(attend, q, k, v, sinks)
        return (out, *vjp(out))

    args = (q, kv, kv, jax.ShapeDtypeStruct((BATCH,), jnp.int32), ids, ids,
            jax.ShapeDtypeStruct((2,), jnp.float32))
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    for platform, count in (("tpu", "tpu_custom_call"), ("cuda", f"@{TRITON}")):
        module = export.export(jax.jit(forward_and_vjp), platforms=[platform],
                               disabled_checks=checks)(*args).mlir_module()
        assert module.count(count) == 3, platform
