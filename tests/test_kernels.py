"""Attention kernels against the float64 oracle: forward, Q/K/V gradients, masks, precision.

Ground truth is ``grading.dense.truth`` and accuracy is judged by the rubric's tolerance policy
(``grading.tolerance``: within ``k`` times ``reference_attention``'s own error on the same inputs),
through the ``assert_accurate`` fixture of ``conftest.py``. The Pallas-backed ``pallas_attention``
runs the sweep in interpret mode (the default on this CPU), and again in TPU interpret mode (race
detection, NaN-filled memory) where the installed JAX has it. ``reference_attention`` is the
policy's yardstick, so its sweep checks exact zeros, dtypes and finiteness; its accuracy is held
to the contract's bf16 bound below, where a lossy reference would fail.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import truth as oracle

from tpu_kernel_records_tools.grading import tolerance
from tpu_kernel_records_tools.grading.dense.problems import Problem
from kernel_src import (SoftmaxBlockSizes, masked_softmax, pallas_attention, reference_attention,
                        reference_masked_softmax, registry)
from kernel_src.backend import tpu_interpret_races_found


class Case(NamedTuple):
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    kv_lengths: tuple[int, ...] | None = None


CASES = {
    "gqa-4q-on-2kv-width-40": Case(2, 8, 40, 4, 2, 8),
    "gqa-4q-on-1kv": Case(1, 8, 16, 4, 1, 8),
    "causal-k-longer-than-q": Case(1, 8, 24, 4, 2, 8, causal=True),
    "causal-q-longer-than-k": Case(1, 24, 8, 2, 1, 8, causal=True),
    "padding-with-zero-length": Case(3, 8, 16, 2, 1, 8, kv_lengths=(16, 5, 0)),
    "causal-and-padding": Case(2, 16, 16, 4, 2, 8, causal=True, kv_lengths=(11, 0)),
    "width-200": Case(1, 8, 200, 2, 1, 8, causal=True, kv_lengths=(150,)),
}
ROW_BLOCKS_OF_8 = SoftmaxBlockSizes(block_q=8, block_k=128)
# The implementations the benchmark's attention scope measures: "xla" (reference_attention) and
# "pallas" (pallas_attention), named once in kernel_src.registry.
IMPLS = {impl.name: impl.load() for impl in registry.for_scope("attention", "cpu")}


def _lengths(case: Case):
    return None if case.kv_lengths is None else jnp.asarray(case.kv_lengths, jnp.int32)


def _inputs(make, case: Case, dtype=jnp.float32, seed=0):
    return make(case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads, case.head_dim,
                dtype=dtype, seed=seed)


def _results(attention, case: Case, q, k, v, do, forward_and_grads):
    return forward_and_grads(attention, q, k, v, do, causal=case.causal, kv_lengths=_lengths(case))


def _empty_rows(case: Case) -> np.ndarray:
    """``[batch, q_len]`` bool: query rows that see no key."""
    lengths = None if case.kv_lengths is None else np.asarray(case.kv_lengths)
    visible = oracle.visible_keys(case.batch, case.q_len, case.kv_len, case.causal, lengths)
    return ~visible.any(-1)


# the default run: GQA at a width of 40, causal with padding, a width of 200; the slow run every case
DEFAULT_CASES = ("gqa-4q-on-2kv-width-40", "causal-and-padding", "width-200")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [case if name in DEFAULT_CASES else pytest.param(case, marks=pytest.mark.slow)
                                  for name, case in CASES.items()], ids=CASES.keys())
def test_attention_matches_float64_oracle(impl, case, attention_inputs, forward_and_grads,
                                          assert_accurate):
    q, k, v, do = _inputs(attention_inputs, case)
    results = _results(IMPLS[impl], case, q, k, v, do, forward_and_grads)
    assert_accurate(results, q, k, v, do, causal=case.causal, kv_lengths=_lengths(case))


@pytest.mark.parametrize("case", ["causal-q-longer-than-k", "causal-and-padding", "width-200"])
def test_pallas_row_blocks_of_8_match_oracle(case, attention_inputs, forward_and_grads,
                                             assert_accurate):
    """Several row blocks per (batch, head): the causal mask must use each block's row offset."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, seed=1)
    attention = functools.partial(pallas_attention, block_sizes=ROW_BLOCKS_OF_8)
    results = _results(attention, case, q, k, v, do, forward_and_grads)
    assert_accurate(results, q, k, v, do, causal=case.causal, kv_lengths=_lengths(case))


@pytest.mark.parametrize("case", ["causal-and-padding", "width-200"])
def test_pallas_in_tpu_interpret_mode(case, attention_inputs, tpu_interpret, forward_and_grads,
                                      assert_accurate):
    """TPU interpret mode: NaN-filled buffers expose reads of unwritten memory; races are detected."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, seed=2)
    attention = functools.partial(pallas_attention, interpret=tpu_interpret, block_sizes=ROW_BLOCKS_OF_8)
    results = _results(attention, case, q, k, v, do, forward_and_grads)
    assert_accurate(results, q, k, v, do, causal=case.causal, kv_lengths=_lengths(case))
    assert tpu_interpret_races_found() in (False, None), "TPU interpret mode found a data race"


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked_rows_are_exact_zeros_with_finite_gradients(impl, attention_inputs,
                                                               forward_and_grads):
    case = Case(2, 16, 8, 4, 2, 8, causal=True, kv_lengths=(8, 0))
    empty = _empty_rows(case)
    assert empty[0, :8].all() and empty[1].all() and not empty[0, 8:].any()
    q, k, v, do = _inputs(attention_inputs, case, seed=3)
    out, dq, dk, dv = (np.asarray(x) for x in _results(IMPLS[impl], case, q, k, v, do,
                                                        forward_and_grads))
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all(), "a batch with no keys has zero dk, dv"
    assert np.abs(out[~empty]).min() > 0


@pytest.mark.parametrize("case", ["causal-and-padding", "width-200"])
def test_pallas_in_bf16_passes_the_rubric_policy(case, attention_inputs, forward_and_grads,
                                                 assert_accurate):
    """bf16 forward and Q, K, V gradients within the policy's bound of the reference's error."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, dtype=jnp.bfloat16, seed=4)
    results = _results(pallas_attention, case, q, k, v, do, forward_and_grads)
    assert_accurate(results, q, k, v, do, causal=case.causal, kv_lengths=_lengths(case))


def _bf16_logits_attention(q, k, v, scale):
    """A precision-losing candidate (logits rounded to bf16), to show the bounds below bite."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    probs = oracle.masked_softmax(np.asarray(logits.astype(jnp.bfloat16)))
    out = np.einsum("bhqk,bkhd->bqhd", probs, oracle.as_f64(v))
    return np.asarray(jnp.asarray(out, jnp.float32).astype(jnp.bfloat16))


def test_bf16_inputs_keep_fp32_logits_and_reductions(attention_inputs):
    """With bf16 inputs the error vs float64 stays at the bf16 output rounding.

    The reference is held to half a bf16 ulp of the largest output magnitude (its fp32 internals
    leave only the rounding of the output); ``pallas_attention`` to the rubric's policy. Sharp
    softmaxes (logits of tens) turn a bf16 rounding of the logits into a visible error, so a
    candidate with bf16 logits fails both.
    """
    case = Case(1, 16, 256, 2, 2, 64)
    q, k, v, _ = _inputs(attention_inputs, case, dtype=jnp.bfloat16, seed=5)
    q = q * 16  # exact in bf16: logits of standard deviation 16
    problem = Problem("sharp-bf16", "bfloat16", q, k, v)
    truth, (reference,) = problem.truth, problem.baseline
    half_ulp = tolerance.EPS["bfloat16"] / 2
    assert tolerance.error(reference, truth.out, truth.magnitude["out"]).worst <= half_ulp
    lossy = _bf16_logits_attention(q, k, v, case.head_dim ** -0.5)
    assert tolerance.error(lossy, truth.out, truth.magnitude["out"]).worst > 4 * half_ulp

    def judged(candidate):
        return tolerance.judge("out", candidate, truth.out, reference, "bfloat16", gradient=False,
                               magnitude=truth.magnitude["out"], logit_scale=problem.logit_max)

    pallas = jax.jit(pallas_attention)(q, k, v)
    assert judged(pallas).ok, judged(pallas).describe()
    assert not judged(lossy).ok, "the policy must reject bf16 logits"


SOFTMAX_CASES = {
    "causal-padding-width-200": ((2, 3, 24, 200), True, (150, 0), jnp.float32, None),
    "row-blocks-of-8": ((2, 3, 24, 200), True, (150, 0), jnp.float32, ROW_BLOCKS_OF_8),
    "bf16-width-40": ((1, 2, 8, 40), False, None, jnp.bfloat16, None),
    "causal-q-longer-than-k": ((2, 1, 16, 8), True, (8, 3), jnp.float32, None),
}


@pytest.mark.parametrize("shape, causal, lengths, dtype, blocks", SOFTMAX_CASES.values(),
                         ids=SOFTMAX_CASES.keys())
def test_masked_softmax_matches_reference_and_oracle(shape, causal, lengths, dtype, blocks):
    kx, kg = jax.random.split(jax.random.key(6))
    logits = (3 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    cotangent = jax.random.normal(kg, shape, jnp.float32)
    kv_lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)

    def vjp(softmax, **kw):
        probs, pullback = jax.vjp(lambda x: softmax(x, causal=causal, kv_lengths=kv_lengths, **kw), logits)
        return probs, pullback(cotangent)[0]

    probs, dlogits = jax.jit(lambda: vjp(masked_softmax, block_sizes=blocks))()
    want, want_dlogits = jax.jit(lambda: vjp(reference_masked_softmax))()
    assert probs.dtype == jnp.float32 and probs.shape == shape and dlogits.dtype == dtype

    exact = oracle.masked_softmax(logits, causal=causal, kv_lengths=lengths)
    g = oracle.as_f64(cotangent.astype(dtype))  # the cotangent the VJP is given
    exact_dlogits = exact * (g - (g * exact).sum(-1, keepdims=True))
    dlogits_terms = exact * (np.abs(g) + (np.abs(g) * exact).sum(-1, keepdims=True))
    name = jnp.dtype(dtype).name
    visible = oracle.visible_keys(shape[0], shape[2], shape[3], causal,
                                  None if lengths is None else np.asarray(lengths))[:, None]
    logit_max = float(np.max(np.where(visible, np.abs(oracle.as_f64(logits)), 0.0)))
    for label, got, truth, baseline, magnitude in (
            ("probs", probs, exact, want, None),
            ("dlogits", dlogits, exact_dlogits, want_dlogits, dlogits_terms)):
        verdict = tolerance.judge(label, got, truth, baseline, name, gradient=label == "dlogits",
                                  magnitude=magnitude, logit_scale=logit_max)
        assert verdict.ok, verdict.describe()

    seen = np.broadcast_to(visible, shape)
    probs, dlogits = np.asarray(probs), np.asarray(dlogits.astype(jnp.float32))
    assert (probs[~seen] == 0).all(), "masked keys must get exactly zero"
    has_keys = seen.any(-1)
    assert (probs.sum(-1)[~has_keys] == 0).all() and (dlogits.sum(-1)[~has_keys] == 0).all()
    assert np.isfinite(dlogits).all()


def test_masked_logits_cannot_leak_probability():
    """Huge or NaN logits behind the mask change nothing: masks come from positions, not values."""
    shape, lengths = (2, 2, 8, 200), (150, 37)
    logits = jax.random.normal(jax.random.key(7), shape, jnp.float32)
    seen = np.broadcast_to(oracle.visible_keys(2, 8, 200, True, np.asarray(lengths))[:, None], shape)
    poisoned = jnp.where(seen, logits, jnp.float32(3e38)).at[..., -1].set(jnp.nan)
    kv_lengths = jnp.asarray(lengths, jnp.int32)
    clean = masked_softmax(logits, causal=True, kv_lengths=kv_lengths)
    dirty = masked_softmax(poisoned, causal=True, kv_lengths=kv_lengths)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_masked_softmax_rejects_bad_input():
    logits = jnp.zeros((2, 1, 4, 8))
    with pytest.raises(ValueError, match="4-D"):
        masked_softmax(logits[0])
    with pytest.raises(TypeError, match="float"):
        masked_softmax(logits.astype(jnp.int32))
    with pytest.raises(ValueError, match="kv_lengths"):
        masked_softmax(logits, kv_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(TypeError, match="kv_lengths"):
        masked_softmax(logits, kv_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="block_q"):
        SoftmaxBlockSizes(block_q=12, block_k=128)
    with pytest.raises(ValueError, match="block_k"):
        SoftmaxBlockSizes(block_q=8, block_k=100)


def test_default_block_sizes_follow_the_8x128_tile():
    for platform in ("cpu", "tpu", "gpu"):
        blocks = SoftmaxBlockSizes.for_platform(platform)
        assert blocks.block_q % 8 == 0 and blocks.block_k % 128 == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_contract_violations_raise(impl):
    attention = IMPLS[impl]
    q, kv = jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], kv, kv)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention(jnp.zeros((1, 4, 3, 8)), kv, kv)
    with pytest.raises(ValueError, match="kv_lengths"):
        attention(q, kv, kv, kv_lengths=jnp.array([4, 4]))


def test_registry_declares_each_implementation_once_and_loads_it():
    from tpu_kernel_records_tools.bench.cases import SCOPES

    impls = registry.IMPLEMENTATIONS
    assert set(IMPLS) == {"xla", "pallas"}
    assert IMPLS["xla"] is reference_attention and IMPLS["pallas"] is pallas_attention
    assert registry.by_grading_name("reference").name == "xla"
    assert [i.name for i in registry.for_scope("flash", "gpu")] == ["xla", "flash", "cudnn"]
    assert [i.name for i in registry.for_scope("flash", "cpu")] == ["xla", "flash"]
    for impl in impls.values():
        assert callable(impl.load()) and set(impl.scopes) <= set(SCOPES), impl.name
        assert impl.kind in ("reference", "kernel", "vendor")
    assert impls["pallas"].load_softmax() is masked_softmax
    with pytest.raises(ValueError, match="no separate masked softmax"):
        impls["flash"].load_softmax()
