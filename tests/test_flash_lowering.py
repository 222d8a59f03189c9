"""The flash kernels lower for real accelerators from this CPU-only machine (lowering only).

``jax.export`` with ``platforms=["tpu"]`` runs the Pallas -> Mosaic lowering of forward, dQ and
dK/dV at the benchmark shapes; the StableHLO must hold one ``tpu_custom_call`` per kernel. Mosaic's
own compilation happens in libtpu on a TPU and is not exercised here. The Triton (GPU) kernels
are lowered the same way to Triton IR (``platforms=["cuda"]``); Triton's own compilation needs a
GPU jaxlib and is not exercised either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from kernel_src.flash_attention import FlashBlockSizes, flash_attention

BATCH, Q_HEADS, KV_HEADS = 1, 4, 2


def _forward_and_vjp(q, k, v, kv_lengths, do, *, causal, variant):
    def attend(q, k, v):
        return flash_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, interpret=False,
                               variant=variant)

    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))


def _export(seq, head_dim, dtype, causal, with_lengths, platform, variant, **kwargs):
    q = jax.ShapeDtypeStruct((BATCH, seq, Q_HEADS, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((BATCH, seq, KV_HEADS, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32) if with_lengths else None
    fn = jax.jit(functools.partial(_forward_and_vjp, causal=causal, variant=variant))
    return export.export(fn, platforms=[platform], **kwargs)(q, kv, kv, lengths, q)


@pytest.mark.parametrize("seq", [128, 200, 256, 512, 1024, 2048, 4096, 8192])
def test_mosaic_lowers_for_tpu_at_benchmark_shapes(seq):
    """bf16, 4 q heads on 2 kv heads, head_dim 128, causal, kv_lengths; 200 is a non-128 width."""
    module = _export(seq, 128, jnp.bfloat16, True, True, "tpu", "mosaic").mlir_module()
    assert module.count("tpu_custom_call") == 3  # forward, dQ, dK/dV


@pytest.mark.parametrize("head_dim,dtype,causal,with_lengths", [
    (64, jnp.bfloat16, True, True),  # head_dim padded to 128 lanes inside the wrapper
    (128, jnp.float32, False, False),
])
def test_mosaic_lowers_for_tpu_other_layouts(head_dim, dtype, causal, with_lengths):
    module = _export(300, head_dim, dtype, causal, with_lengths, "tpu", "mosaic").mlir_module()
    assert module.count("tpu_custom_call") == 3


def test_tpu_defaults_are_lane_aligned():
    blocks = FlashBlockSizes.for_platform("tpu")
    assert all(getattr(blocks, name) % 128 == 0 for name in blocks.__dataclass_fields__)


@pytest.mark.parametrize("seq,head_dim", [(128, 128), (200, 64), (2048, 128)])
def test_triton_lowers_for_gpu(seq, head_dim):
    triton = "__gpu$xla.gpu.triton"
    try:
        exported = _export(seq, head_dim, jnp.bfloat16, True, True, "cuda", "triton",
                           disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])
    except ValueError as err:
        if "install jaxlib GPU" in str(err) or "Cannot lower pallas_call on platform" in str(err):
            pytest.skip(f"jax {jax.__version__} cannot lower Pallas for GPU without a GPU jaxlib")
        raise
    assert exported.mlir_module().count(f"@{triton}") == 3
