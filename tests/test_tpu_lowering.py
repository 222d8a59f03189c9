"""The default API lowers for the platform it is lowered for, from this CPU machine.

``jax.export`` with ``platforms=["tpu"]`` of ``pallas_attention`` / ``masked_softmax`` called with
no ``interpret=`` must hold the Mosaic kernels (``tpu_custom_call``), ``platforms=["cuda"]`` the
Triton kernels, and ``platforms=["cpu", "tpu"]`` both branches, the CPU one running here in
interpret mode. Only lowering is checked: Mosaic's and Triton's own compilers run on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export  # jax.export is not an attribute of jax 0.6.2's top level

from kernel_src import masked_softmax, pallas_attention, reference_attention

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 128
TRITON = "__gpu$xla.gpu.triton"


def _structs(seq_len: int, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((BATCH, seq_len, Q_HEADS, HEAD_DIM), dtype)
    kv = jax.ShapeDtypeStruct((BATCH, seq_len, KV_HEADS, HEAD_DIM), dtype)
    return q, kv, kv, jax.ShapeDtypeStruct((BATCH,), jnp.int32)


def _attention(q, k, v, lengths):
    return pallas_attention(q, k, v, causal=True, kv_lengths=lengths)


def _grads(q, k, v, lengths):
    loss = lambda q, k, v: _attention(q, k, v, lengths).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _export(fn, structs, platforms):
    checks = [jax_export.DisabledSafetyCheck.custom_call(TRITON)]
    exported = jax_export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*structs)
    assert tuple(exported.platforms) == tuple(platforms)
    return exported


@pytest.mark.parametrize("seq_len", [200, 2048])
def test_default_attention_and_gradient_lower_to_mosaic_for_tpu(seq_len):
    structs = _structs(seq_len)
    forward = _export(_attention, structs, ["tpu"]).mlir_module()
    assert forward.count("tpu_custom_call") == 1, "one Pallas softmax kernel in the forward pass"
    assert TRITON not in forward
    backward = _export(_grads, structs, ["tpu"]).mlir_module()
    assert backward.count("tpu_custom_call") == 2, "forward and backward softmax kernels"


def test_default_attention_and_gradient_lower_to_triton_for_cuda():
    structs = _structs(200)
    forward = _export(_attention, structs, ["cuda"]).mlir_module()
    backward = _export(_grads, structs, ["cuda"]).mlir_module()
    assert forward.count(f"@{TRITON}") == 1 and backward.count(f"@{TRITON}") == 2
    assert "tpu_custom_call" not in forward + backward


def test_multi_platform_export_holds_mosaic_and_runs_on_cpu():
    """One artifact for CPU and TPU: the TPU branch is Mosaic, the CPU branch runs here."""
    structs = _structs(40, jnp.float32)
    exported = _export(_grads, structs, ["cpu", "tpu"])
    assert exported.mlir_module().count("tpu_custom_call") == 2
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s.shape, np.float32)) for s in structs[:3])
    lengths = jnp.asarray([40, 9], jnp.int32)
    got = exported.call(q, k, v, lengths)
    loss = lambda q, k, v: reference_attention(q, k, v, causal=True, kv_lengths=lengths).sum()
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)


def test_masked_softmax_scope_lowers_per_platform():
    logits = jax.ShapeDtypeStruct((BATCH, Q_HEADS, 2048, 2048), jnp.float32)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)

    def softmax(x, lengths):
        return masked_softmax(x, causal=True, kv_lengths=lengths)

    assert _export(softmax, (logits, lengths), ["tpu"]).mlir_module().count("tpu_custom_call") == 1
    assert _export(softmax, (logits, lengths), ["cuda"]).mlir_module().count(f"@{TRITON}") == 1


def test_explicit_interpret_overrides_the_platform():
    """``interpret=True`` is plain HLO on every platform; ``interpret=False`` refuses CPU clearly."""
    structs = _structs(128)

    def interpreted(q, k, v, lengths):
        return pallas_attention(q, k, v, causal=True, kv_lengths=lengths, interpret=True)

    assert "tpu_custom_call" not in _export(interpreted, structs, ["tpu"]).mlir_module()
    logits = jnp.zeros((1, 1, 8, 128), jnp.float32)
    with pytest.raises(ValueError, match="interpret=False .* no CPU lowering"):
        jax.jit(lambda x: masked_softmax(x, interpret=False))(logits)


def test_reference_has_no_custom_call():
    """The checks above can fail: the pure-XLA oracle exports without any Mosaic kernel."""
    ref = lambda q, k, v, lengths: reference_attention(q, k, v, causal=True, kv_lengths=lengths)
    assert "tpu_custom_call" not in _export(ref, _structs(128), ["tpu"]).mlir_module()
