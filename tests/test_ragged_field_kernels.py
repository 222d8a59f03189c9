"""JAX's ``ragged_paged_attention`` graded by the ragged rubric as a field kernel (issue 53), through the layout
adapters of ``tests/ragged_field_adapters.py`` (K and V interleaved into one pool, the contract's window as its
``sliding_window``, the non-causal case folded into its causal one; never the numerics).

* ``jax_ragged_kernel``: the Pallas TPU kernel. Declares window (causal only), softcap and quantized_kv (Python
  float scales). It does not run in TPU interpret mode (it reshapes a VMEM ref, which the interpreter cannot read
  through: ``test_kernel_does_not_run_in_interpret_mode``), so it is not graded here.
* ``jax_ragged_reference``: JAX's ``ref_ragged_paged_attention`` in its place, same signature, layout and
  features, graded by the rubric. Verdict: every check passes but ragged-window, which grades windows without
  causal (both sides) that JAX's causal, left-only ``sliding_window`` cannot express (the adapter refuses them).

Cost (a shared 2-core machine, under load): the quick grade (default run) about 13 CPU-s, 2 min wall; the
rest of the default tests a few CPU-s; the full level (slow, seeds 0-2) one grade per seed.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src.reference import reference_ragged_paged_attention
from tpu_kernel_records_tools.grading.ragged.checks import ragged_checks_for
from tpu_kernel_records_tools.grading.rubric import grade

from tests import ragged_field_adapters as adapters

ADAPTERS = Path(adapters.__file__)
REFUSES_RAGGED = re.compile(r"'(ReshapeTransform|RefReshaper)' object has no attribute 'indices'")
FEATURES = ("window", "softcap", "quantized_kv")
FULL_TIME_LIMIT_S = 3600.0


def _problem(dtype=jnp.float32, quantized: str | None = None):
    """Three sequences of four table rows (q_len 3, 0, 5 over 20, 7, 5 keys) in pages of 8, two padding rows of
    NaN, NaN in every slot no key is on (int8: the type's extremes), garbage after num_seqs."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((10, 4, 16)).astype(np.float32)
    q[8:] = np.nan
    k, v = (rng.standard_normal((8, 8, 2, 16)).astype(np.float32) for _ in range(2))
    table = np.asarray([[5, 2, 7], [1, 3, 3], [6, 6, 6], [0, 4, 1]], np.int32)  # the last row: garbage
    lengths = np.asarray([20, 7, 5, 24], np.int32)
    held = np.zeros((8, 8), bool)
    held[5], held[2], held[7, :4], held[1, :7], held[6, :5] = True, True, True, True, True
    scales = {}
    if quantized:
        k, v = (np.round(x * 40).astype(np.int8) for x in (k, v))
        k[~held], v[~held] = 127, -128
        scales = {"k_scale": 0.02, "v_scale": 0.05}
    else:
        k[~held], v[~held] = np.nan, np.nan
    args = (jnp.asarray(q, dtype), *(jnp.asarray(x, x.dtype if quantized else dtype) for x in (k, v)))
    return args, dict(kv_lengths=jnp.asarray(lengths), page_indices=jnp.asarray(table),
                      cu_q_lens=jnp.asarray([0, 3, 3, 8, 2], jnp.int32), num_seqs=jnp.asarray([3], jnp.int32),
                      **scales)


# --------------------------------------------------------------------------------------------------
# What the adapters declare, and the layout (each a fraction of a second).

def test_adapters_declare_exactly_what_the_kernel_takes():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    for fn in (ragged_paged_attention, ref_ragged_paged_attention):
        params = set(inspect.signature(fn).parameters)
        assert {"sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale"} <= params and "sinks" not in params
    assert adapters.jax_ragged_kernel.features == ("window", "softcap", "quantized_kv")
    assert adapters.jax_ragged_reference.features == ("window", "softcap", "quantized_kv")


def test_window_is_sliding_window_minus_one():
    """sliding_window = W is window_size = (W - 1, 0); the right side hides nothing under causal."""
    assert adapters.sliding_window((4, 0), True) == 5
    assert adapters.sliding_window((0, None), True) == 1
    assert adapters.sliding_window((None, 0), True) is None and adapters.sliding_window(None, False) is None
    with pytest.raises(ValueError, match="causal and left-only"):
        adapters.sliding_window((4, 0), False)


def test_layout_interleaves_k_and_v_and_folds_non_causal_rows():
    (q, k, v), meta = _problem()
    tokens, kv, lengths, table, cu, num_seqs = adapters.layout(
        q, k, v, meta["kv_lengths"], meta["page_indices"], meta["cu_q_lens"], meta["num_seqs"], causal=False,
        lanes=128, queries=32)
    assert tokens.shape == (32, 4, 128) and kv.shape == (8, 8, 4, 128)
    np.testing.assert_array_equal(np.asarray(kv[:, :, 0::2, :16]), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(kv[:, :, 1::2, :16]), np.asarray(v))
    assert not np.asarray(kv[:, :, :, 16:]).any()
    # rows 0-2 are sequence 0's, 3-7 sequence 2's (sequence 1 has none): each a sequence of one token
    assert int(num_seqs[0]) == 8 and np.asarray(cu).tolist() == list(range(11))
    assert np.asarray(lengths[:8]).tolist() == [20] * 3 + [5] * 5
    np.testing.assert_array_equal(np.asarray(table[3]), [6, 6, 6])


def test_a_traced_scale_is_refused_in_one_line():
    (q, k, v), meta = _problem(quantized="int8")
    del meta["k_scale"], meta["v_scale"]
    call = jax.jit(lambda s: adapters.jax_ragged_reference(q, k, v, **meta, k_scale=s, v_scale=s))
    with pytest.raises(ValueError, match=r"^JAX's ragged_paged_attention takes k_scale as a Python float"):
        call(jnp.float32(0.02))


@pytest.mark.parametrize("dtype,quantized,flags", [
    (jnp.float32, None, {}),
    (jnp.float32, None, {"causal": False}),
    (jnp.float32, None, {"window_size": (6, 0), "softcap": 3.0, "scale": 0.7}),
    (jnp.bfloat16, None, {"window_size": (2, 5)}),
    (jnp.float32, "int8", {}),
], ids=["causal", "not-causal", "window-softcap", "bf16-window", "int8"])
def test_reference_adapter_agrees_with_the_contract(dtype, quantized, flags):
    """JAX's reference through the adapter gives the project reference's graded rows (rows 0-7) within the
    rounding it is allowed (bf16 probabilities, a dequantized pool rounded to q's dtype)."""
    args, meta = _problem(dtype, quantized)
    got = np.asarray(adapters.jax_ragged_reference(*args, **meta, **flags), np.float32)
    want = np.asarray(reference_ragged_paged_attention(*args, **meta, **flags), np.float32)
    assert got.shape == want.shape == (10, 4, 16)
    assert np.isfinite(got[:8]).all()
    np.testing.assert_allclose(got[:8], want[:8], atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert not got[8:].any()


def test_sinks_are_refused():
    args, meta = _problem()
    with pytest.raises(ValueError, match="has no sinks"):
        adapters.jax_ragged_reference(*args, **meta, sinks=jnp.zeros(4, jnp.float32))


@pytest.mark.slow
def test_kernel_does_not_run_in_interpret_mode():
    """TPU interpret mode cannot read through the kernel's reshaped VMEM ref. When a JAX release can, this fails:
    grade ``jax_ragged_kernel`` then, as ``jax_ragged_reference`` is graded."""
    args, meta = _problem()
    with pytest.raises(Exception, match=REFUSES_RAGGED):
        np.asarray(adapters.jax_ragged_kernel(*args, **meta))


# --------------------------------------------------------------------------------------------------
# The rubric's verdict on JAX's reference (worker process and all).

EXPECTED_FAILS = {"ragged-window": r"raised ValueError: JAX's ragged_paged_attention's sliding window is causal and "
                                   r"left-only"}


def _grade(level: str, seed: int):
    """Grade ``jax_ragged_reference``; exactly the checks of ``EXPECTED_FAILS`` fail, each for its reason."""
    card = grade(f"{ADAPTERS}:jax_ragged_reference", seed=seed, level=level, contract="ragged",
                 **({"time_limit_s": FULL_TIME_LIMIT_S} if level == "full" else {}))
    assert card.error is None, card.error
    assert card.contract == "ragged" and card.features == FEATURES
    assert [c.name for c in card.checks] == [*(c.name for c in ragged_checks_for(FEATURES)), "finite"]
    failed = {c.name: c.detail for c in card.checks if not c.passed}
    assert set(failed) == set(EXPECTED_FAILS), failed
    for name, pattern in EXPECTED_FAILS.items():
        assert re.search(pattern, failed[name]), (name, failed[name])


@pytest.mark.slow  # a quick grade in a worker of its own: about 13 CPU-s, 30 s of the default run's wall time
def test_jax_reference_passes_but_the_two_sided_window():
    """Every check passes but ragged-window, whose windows without causal (both sides) JAX's causal, left-only
    ``sliding_window`` cannot express: the adapter refuses them in one line, and the check names it."""
    _grade("quick", 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jax_reference_at_the_full_level(seed):
    _grade("full", seed)
