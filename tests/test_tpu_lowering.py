"""The Pallas kernels lower for TPU (Mosaic) from this CPU machine: export only, nothing runs.

``jax.export`` with ``platforms=["tpu"]`` traces and lowers the kernels to Mosaic and embeds them
as ``tpu_custom_call``s in StableHLO. Mosaic's own layout passes run later, in the TPU compiler, so
a kernel that exports here can still be refused on a TPU; this catches everything before that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export as jax_export  # jax.export is not an attribute of jax 0.6.2's top level

from kernel_src import SoftmaxBlockSizes, masked_softmax, pallas_attention, reference_attention

TPU_BLOCKS = SoftmaxBlockSizes.for_platform("tpu")
BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 128


def _structs(seq_len: int):
    q = jax.ShapeDtypeStruct((BATCH, seq_len, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((BATCH, seq_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return q, kv, kv, jax.ShapeDtypeStruct((BATCH,), jnp.int32)


def _attention(q, k, v, lengths):
    return pallas_attention(q, k, v, causal=True, kv_lengths=lengths, interpret=False,
                            block_sizes=TPU_BLOCKS)


def _loss(q, k, v, lengths):
    return _attention(q, k, v, lengths).astype(jnp.float32).sum()


def _tpu_stablehlo(fn, *structs) -> str:
    exported = jax_export.export(jax.jit(fn), platforms=["tpu"])(*structs)
    assert tuple(exported.platforms) == ("tpu",)
    return exported.mlir_module()


@pytest.mark.parametrize("seq_len", [128, 200, 512, 2048])
def test_attention_and_its_gradient_lower_to_mosaic(seq_len):
    structs = _structs(seq_len)
    forward = _tpu_stablehlo(_attention, *structs)
    assert forward.count("tpu_custom_call") == 1, "one Pallas softmax kernel in the forward pass"
    backward = _tpu_stablehlo(jax.grad(_loss, argnums=(0, 1, 2)), *structs)
    assert backward.count("tpu_custom_call") == 2, "forward and backward softmax kernels"


def test_masked_softmax_scope_lowers_to_mosaic():
    logits = jax.ShapeDtypeStruct((BATCH, Q_HEADS, 2048, 2048), jnp.float32)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)

    def softmax(x, lengths):
        return masked_softmax(x, causal=True, kv_lengths=lengths, interpret=False, block_sizes=TPU_BLOCKS)

    assert "tpu_custom_call" in _tpu_stablehlo(softmax, logits, lengths)


def test_reference_has_no_custom_call():
    """The check above can fail: the pure-XLA oracle exports without any Mosaic kernel."""
    ref = lambda q, k, v, lengths: reference_attention(q, k, v, causal=True, kv_lengths=lengths)
    assert "tpu_custom_call" not in _tpu_stablehlo(ref, *_structs(128))


def test_gpu_path_lowers_to_triton_where_jaxlib_can(monkeypatch):
    """The GPU branch (power-of-two tiles, lengths as an input) lowers to Triton IR.

    Only the lowering is checked (no GPU here, so Triton's own compile is not), and only where the
    installed jaxlib ships Pallas' Triton lowering (jax 0.6.2's CPU wheel does; newer ones do not).
    """
    monkeypatch.setattr("kernel_src.backend.platform", lambda: "gpu")
    blocks = SoftmaxBlockSizes.for_platform("gpu")

    def attention(q, k, v, lengths):
        return pallas_attention(q, k, v, causal=True, kv_lengths=lengths, interpret=False, block_sizes=blocks)

    def loss(q, k, v, lengths):
        return attention(q, k, v, lengths).astype(jnp.float32).sum()

    triton = "__gpu$xla.gpu.triton"
    unchecked = [jax_export.DisabledSafetyCheck.custom_call(triton)]
    for fn, kernels in ((attention, 1), (jax.grad(loss, argnums=(0, 1, 2)), 2)):
        try:
            exported = jax_export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)
            text = exported(*_structs(200)).mlir_module()
        except ValueError as err:
            if "Cannot lower pallas_call on platform: gpu" in str(err):
                pytest.skip(f"jaxlib {jax.__version__} on this machine has no Pallas GPU lowering")
            raise
        assert text.count(triton) == kernels
