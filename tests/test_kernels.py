"""Attention kernels against the float64 NumPy oracle: forward, Q/K/V gradients, masks, precision.

Both the pure-JAX oracle (``reference_attention``) and the Pallas-backed ``pallas_attention`` run
the same sweep; on this CPU Pallas runs in interpret mode, and again in TPU interpret mode (race
detection, NaN-filled memory) where the installed JAX has it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src import (SoftmaxBlockSizes, masked_softmax, pallas_attention, reference_attention,
                        reference_masked_softmax)
from kernel_src.backend import tpu_interpret_races_found
from np_oracle import np_attention, np_attention_grads, np_masked_softmax, np_visible


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
IMPLS = {
    "reference": reference_attention,
    "pallas": pallas_attention,
}
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _lengths(case: Case):
    return None if case.kv_lengths is None else jnp.asarray(case.kv_lengths, jnp.int32)


def _inputs(make, case: Case, dtype=jnp.float32, seed=0):
    return make(case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads, case.head_dim,
                dtype=dtype, seed=seed)


def _forward_and_grads(attention, case: Case, q, k, v, do):
    """``attention``'s output and its ``(dq, dk, dv)`` for output cotangent ``do``, as NumPy."""
    lengths = _lengths(case)

    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=case.causal, kv_lengths=lengths),
                           q, k, v)
        return out, vjp(do.astype(out.dtype))

    out, grads = run(q, k, v, do)
    return np.asarray(out.astype(jnp.float32)), [np.asarray(g.astype(jnp.float32)) for g in grads]


def _oracle(case: Case, q, k, v, do):
    args = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, do)]
    kw = dict(causal=case.causal, kv_lengths=case.kv_lengths)
    return np_attention(*args[:3], **kw), np_attention_grads(*args, **kw)


def _empty_rows(case: Case) -> np.ndarray:
    """``[batch, q_len]`` bool: query rows that see no key."""
    return ~np_visible(case.batch, case.q_len, case.kv_len, case.causal, case.kv_lengths).any(-1)


def _check_against_oracle(case, out, grads, expected, expected_grads, tol=FP32_TOL):
    np.testing.assert_allclose(out, expected, **tol)
    for name, got, want in zip("qkv", grads, expected_grads):
        assert np.isfinite(got).all(), f"d{name} has NaN/Inf"
        np.testing.assert_allclose(got, want, **tol, err_msg=f"d{name}")
    empty = _empty_rows(case)
    assert (out[empty] == 0).all(), "rows with no visible key must be exact zeros"
    assert (grads[0][empty] == 0).all(), "rows with no visible key must get zero dq"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attention_matches_float64_oracle(impl, case, attention_inputs):
    q, k, v, do = _inputs(attention_inputs, case)
    out, grads = _forward_and_grads(IMPLS[impl], case, q, k, v, do)
    _check_against_oracle(case, out, grads, *_oracle(case, q, k, v, do))


@pytest.mark.parametrize("case", ["causal-q-longer-than-k", "causal-and-padding", "width-200"])
def test_pallas_row_blocks_of_8_match_oracle(case, attention_inputs):
    """Several row blocks per (batch, head): the causal mask must use each block's row offset."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, seed=1)
    attention = functools.partial(pallas_attention, block_sizes=ROW_BLOCKS_OF_8)
    out, grads = _forward_and_grads(attention, case, q, k, v, do)
    _check_against_oracle(case, out, grads, *_oracle(case, q, k, v, do))


@pytest.mark.parametrize("case", ["causal-and-padding", "width-200"])
def test_pallas_in_tpu_interpret_mode(case, attention_inputs, tpu_interpret):
    """TPU interpret mode: NaN-filled buffers expose reads of unwritten memory; races are detected."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, seed=2)
    attention = functools.partial(pallas_attention, interpret=tpu_interpret, block_sizes=ROW_BLOCKS_OF_8)
    out, grads = _forward_and_grads(attention, case, q, k, v, do)
    _check_against_oracle(case, out, grads, *_oracle(case, q, k, v, do))
    assert tpu_interpret_races_found() in (False, None), "TPU interpret mode found a data race"


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked_rows_are_exact_zeros_with_finite_gradients(impl, attention_inputs):
    case = Case(2, 16, 8, 4, 2, 8, causal=True, kv_lengths=(8, 0))
    empty = _empty_rows(case)
    assert empty[0, :8].all() and empty[1].all() and not empty[0, 8:].any()
    q, k, v, do = _inputs(attention_inputs, case, seed=3)
    out, (dq, dk, dv) = _forward_and_grads(IMPLS[impl], case, q, k, v, do)
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all(), "a batch with no keys has zero dk, dv"
    assert np.abs(out[~empty]).min() > 0


@pytest.mark.parametrize("case", ["causal-and-padding", "width-200"])
def test_pallas_gradients_match_reference_attention_in_bf16(case, attention_inputs):
    """Q, K, V gradient parity with the pure-JAX oracle (fp32 parity follows from the sweep above)."""
    case = CASES[case]
    q, k, v, do = _inputs(attention_inputs, case, dtype=jnp.bfloat16, seed=4)
    want_out, want = _forward_and_grads(reference_attention, case, q, k, v, do)
    got_out, got = _forward_and_grads(pallas_attention, case, q, k, v, do)
    # Results may differ by one rounding of the bf16 output (relative 2**-8).
    tol = dict(rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(got_out, want_out, **tol)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, **tol, err_msg=f"d{name}")


def _bf16_logits_attention(q, k, v, scale):
    """A precision-losing candidate (logits rounded to bf16), to show the bound below bites."""
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = np.asarray(jnp.asarray(logits, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    out = np.einsum("bhqk,bkhd->bqhd", np_masked_softmax(logits), v)
    return np.asarray(jnp.asarray(out, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs_keep_fp32_logits_and_reductions(impl, attention_inputs):
    """With bf16 inputs the error vs float64 stays at the bf16 output rounding (2**-9 relative).

    Sharp softmaxes (logits of tens) turn a bf16 rounding of the logits into a visible error.
    """
    case = Case(1, 16, 256, 2, 2, 64)
    q, k, v, _ = _inputs(attention_inputs, case, dtype=jnp.bfloat16, seed=5)
    q = q * 16  # exact in bf16: logits of standard deviation 16
    out = np.asarray(jax.jit(IMPLS[impl])(q, k, v).astype(jnp.float32))
    expected = np_attention(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)))
    bound = 2 ** -8 * np.abs(expected).max()
    assert np.abs(out - expected).max() <= bound
    lossy = _bf16_logits_attention(q, k, v, case.head_dim ** -0.5)
    assert np.abs(lossy - expected).max() > 4 * bound, "the bound must reject bf16 logits"


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

    exact = np_masked_softmax(np.asarray(logits.astype(jnp.float32)), causal=causal, kv_lengths=lengths)
    g = np.asarray(cotangent, np.float64)
    exact_dlogits = exact * (g - (g * exact).sum(-1, keepdims=True))
    np.testing.assert_allclose(probs, want, atol=1e-6)
    np.testing.assert_allclose(probs, exact, atol=1e-6)
    grad_tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(dlogits.astype(jnp.float32), want_dlogits.astype(jnp.float32), atol=grad_tol)
    np.testing.assert_allclose(dlogits.astype(jnp.float32), exact_dlogits, atol=grad_tol)

    seen = np_visible(shape[0], shape[2], shape[3], causal, lengths)[:, None]
    probs, dlogits = np.asarray(probs), np.asarray(dlogits.astype(jnp.float32))
    assert (probs[~np.broadcast_to(seen, shape)] == 0).all(), "masked keys must get exactly zero"
    sums = probs.sum(-1)
    has_keys = np.broadcast_to(seen.any(-1), sums.shape)
    np.testing.assert_allclose(sums[has_keys], 1.0, atol=1e-6)
    assert (sums[~has_keys] == 0).all() and (dlogits.sum(-1)[~has_keys] == 0).all()
    assert np.isfinite(dlogits).all()


def test_masked_logits_cannot_leak_probability():
    """Huge or NaN logits behind the mask change nothing: masks come from positions, not values."""
    shape, lengths = (2, 2, 8, 200), (150, 37)
    logits = jax.random.normal(jax.random.key(7), shape, jnp.float32)
    seen = np.broadcast_to(np_visible(2, 8, 200, True, lengths)[:, None], shape)
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


def test_np_oracle_gradients_match_finite_differences():
    """The oracle's analytic backward agrees with central differences of its own forward."""
    rng = np.random.default_rng(8)
    q, k, v = rng.normal(size=(1, 3, 2, 4)), rng.normal(size=(1, 5, 1, 4)), rng.normal(size=(1, 5, 1, 4))
    do = rng.normal(size=q.shape)
    kw = dict(causal=True, kv_lengths=(4,))
    grads = np_attention_grads(q, k, v, do, **kw)
    args, eps = [q, k, v], 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for idx in np.ndindex(grad.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = ((np_attention(*plus, **kw) - np_attention(*minus, **kw)) * do).sum() / (2 * eps)
        np.testing.assert_allclose(grad, numeric, atol=1e-7)
    assert np.abs(grads[1][:, 4]).max() == 0 and np.abs(grads[2][:, 4]).max() == 0  # padded key
