"""The model-sized cases of the ``tpu-v5e`` and ``gpu`` profiles: the case list and the FLOPs
they are credited with. Nothing here runs a model-sized case (interpret mode would take hours)."""

from __future__ import annotations

import pytest

from tpu_kernel_records_tools.bench import roofline
from tpu_kernel_records_tools.bench.cases import MODEL_SCOPES, SCOPES, build_cases, get_profile


def _model(platform: str, profile: str):
    return build_cases(get_profile(profile), MODEL_SCOPES, platform=platform)


def test_model_cases_cover_both_head_layouts_every_length_and_both_passes():
    cases, pairs = _model("tpu", "tpu-v5e")
    flash = {(c.scope, c.shape["num_q_heads"], c.shape["num_kv_heads"], c.seq_len)
             for c in cases if c.implementation == "flash"}
    assert flash == {(scope, hq, hk, seq) for scope in MODEL_SCOPES for hq, hk in ((32, 8), (16, 16))
                     for seq in (2048, 4096, 8192, 16384)}
    for case in cases:
        assert case.shape["batch"] == 8 and case.shape["head_dim"] == 128, case.case_id
        assert case.causal and not case.padded and not case.interpret and case.dtype == "bfloat16"
        assert case.tpu_fn is None, "never exported through interpret-mode tooling"
    # The XLA reference only where its fp32 logits fit v5e's HBM (doubled with the backward).
    xla = sorted(c.case_id for c in cases if c.implementation == "xla")
    assert xla == sorted(["model-fwd-xla-h32x8-s2048", "model-fwd-xla-h16x16-s2048",
                          "model-fwd-xla-h16x16-s4096", "model-fwd-bwd-xla-h32x8-s2048",
                          "model-fwd-bwd-xla-h16x16-s2048"])
    assert sorted((p.numerator, p.denominator) for p in pairs) == sorted(
        (x.replace("-xla-", "-flash-"), x) for x in xla)
    assert len({c.case_id for c in cases}) == len(cases) == 16 + 5


def test_gpu_model_cases_add_cudnn_and_pair_flash_with_it_everywhere():
    cases, pairs = _model("gpu", "gpu")
    cudnn = [c for c in cases if c.implementation == "cudnn"]
    assert len(cudnn) == 16
    vendor_pairs = [p for p in pairs if "-cudnn-" in p.denominator]
    assert len(vendor_pairs) == 16 and all("-flash-" in p.numerator for p in vendor_pairs)


def test_the_profiles_keep_the_seed_cases_and_add_model_scopes():
    for name in ("tpu-v5e", "gpu"):
        assert get_profile(name).scopes == SCOPES
        assert set(MODEL_SCOPES) <= set(SCOPES)
    seed, _ = build_cases(get_profile("tpu-v5e"), ("softmax", "attention"), platform="tpu")
    assert len(seed) == 20  # the published card's 20 cases, unchanged, for comparability


def test_model_scopes_are_refused_on_a_cpu_and_in_small_profiles():
    with pytest.raises(ValueError, match="needs a TPU or a GPU"):
        _model("cpu", "tpu-v5e")
    with pytest.raises(ValueError, match="no model-sized cases"):
        build_cases(get_profile("tiny"), ("model-fwd",), platform="tpu")


def test_a_causal_model_case_counts_half_the_pairs_and_the_backward_two_and_a_half_times():
    cases, _ = _model("tpu", "tpu-v5e")
    by_id = {c.case_id: c for c in cases}
    fwd = by_id["model-fwd-flash-h32x8-s2048"]
    # 4 * heads * head_dim per visible pair; causal: s (s + 1) / 2 pairs of s**2, per sequence.
    assert fwd.flops == 4 * 32 * 128 * 8 * (2048 * 2049 // 2) == 275_012_124_672
    dense = 4 * 32 * 128 * 8 * 2048 * 2048
    assert fwd.flops / dense == pytest.approx(0.5, abs=3e-4)
    both = by_id["model-fwd-bwd-flash-h32x8-s2048"]
    assert both.flops == 3.5 * fwd.flops
    # Least bytes: q, out, k, v forward; q, d_out, dq, k, v, dk, dv forward + backward (bf16).
    q_bytes, kv_bytes = 8 * 2048 * 32 * 128 * 2, 8 * 2048 * 8 * 128 * 2
    assert fwd.bytes_moved == 2 * q_bytes + 2 * kv_bytes
    assert both.bytes_moved == 3 * q_bytes + 4 * kv_bytes
    mha = by_id["model-fwd-flash-h16x16-s16384"]
    assert mha.flops == 4 * 16 * 128 * 8 * (16384 * 16385 // 2)


def test_achieved_tflops_are_useful_flops_over_the_median():
    fwd, _ = roofline.attention_work(8, 2048, 2048, 32, 8, 128, 2, True, None)
    rates = roofline.rates(fwd, None, 1.0, "TPU v5 lite", 1)
    assert rates["tflops"] == pytest.approx(275.012124672)
    assert rates["peak_flops_fraction"] == pytest.approx(275.012124672 / 197)


def test_model_inputs_match_their_abstract_shapes_without_building_them_big(monkeypatch):
    """``make_inputs`` follows ``abstract_args`` (checked on a shrunken copy of the shapes)."""
    import dataclasses

    from tpu_kernel_records_tools.bench import cases as cases_module
    small = dataclasses.replace(cases_module.MODEL_SHAPES, batch=1, heads=((4, 2),), head_dim=8,
                                seq_lens=(16,))
    profile = dataclasses.replace(get_profile("tpu-v5e"), model=small)
    cases, _ = build_cases(profile, MODEL_SCOPES, platform="tpu")
    for case in cases:
        inputs = case.make_inputs()
        assert [(x.shape, x.dtype.name) for x in inputs] == [
            (a.shape, a.dtype.name) for a in case.abstract_args], case.case_id
    assert [len(c.abstract_args) for c in cases if c.implementation == "flash"] == [3, 4]


def test_the_forward_backward_program_returns_the_vjp_at_its_cotangent():
    """On a shrunken copy, with the XLA reference (no Pallas: nothing in interpret mode)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_kernel_records_tools.bench import cases as cases_module
    from kernel_src import reference_attention

    small = dataclasses.replace(cases_module.MODEL_SHAPES, batch=1, heads=((4, 2),), head_dim=8,
                                seq_lens=(16,))
    profile = dataclasses.replace(get_profile("tpu-v5e"), model=small, dtype="float32")
    cases, _ = build_cases(profile, ("model-fwd-bwd",), platform="tpu")
    case = next(c for c in cases if c.implementation == "xla")
    q, k, v, d_out = case.make_inputs()
    dq, dk, dv = case.fn(q, k, v, d_out)

    def loss(q, k, v):
        out = reference_attention(q, k, v, causal=True, scale=8 ** -0.5)
        return jnp.sum(out * d_out)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(dk)).sum() > 0  # not a trivially zero gradient
